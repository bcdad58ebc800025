"""Instance prices and the arithmetic of $ per million tokens, so a trn2 run and a GPU run are priced alike.

Each price is what a public page said on the day it was read; docs/benchmarks.md#prices says how each was
found and what to check before relying on it. Prices change: `--price-per-hour` takes the rate you pay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_HOUR = 3600


@dataclass(frozen=True)
class Instance:
    name: str
    chips: int  # accelerator chips: Trainium2 chips or GPUs
    dollars_per_hour: float  # the whole instance, Linux
    basis: str  # how that price buys it: "Capacity Block" or "On-Demand"; compare like with like
    region: str
    source: str  # the page the price is from
    read: str  # ISO date the page was read


# No on-demand rate for trn2.48xlarge was found with a reliable source (docs/benchmarks.md#prices), so trn2 is
# priced at its Capacity Block rate, and the GPU row beside it comes from the same page on the same day.
_CAPACITY_BLOCKS = "https://aws.amazon.com/ec2/capacityblocks/pricing/"
INSTANCES: dict[str, Instance] = {
    instance.name: instance
    for instance in (
        Instance("trn2.48xlarge", 16, 35.7608, "Capacity Block", "us-east-2", _CAPACITY_BLOCKS, "2026-10-09"),
        Instance("p5en.48xlarge", 8, 63.158, "Capacity Block", "not given", _CAPACITY_BLOCKS, "2026-10-09"),
        Instance(
            "p5.48xlarge",
            8,
            55.04,
            "On-Demand",
            "us-east-1",
            "https://instances.vantage.sh/aws/ec2/p5.48xlarge",
            "2026-01-21",
        ),
    )
}
DEFAULT_INSTANCE = "trn2.48xlarge"


def instance_share(chips_used: int, instance_chips: int) -> float:
    """The share of an instance charged to a server on chips_used of its chips, as if the other chips
    served other work: TP=4 at LNC=2 is one Trainium2 chip, 1/16 of a trn2.48xlarge."""
    if not 1 <= chips_used <= instance_chips:
        raise ValueError(f"chips used must be 1 to {instance_chips} (the instance's chips), got {chips_used}")
    return chips_used / instance_chips


def dollars_per_million_tokens(tokens_per_s: float, dollars_per_hour: float) -> float:
    """What a million tokens cost at tokens_per_s on hardware charged dollars_per_hour. NaN when no token
    was made: there is no finite figure to report."""
    if not tokens_per_s > 0:  # zero or NaN
        return math.nan
    return dollars_per_hour / SECONDS_PER_HOUR / tokens_per_s * 1e6
