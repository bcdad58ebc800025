"""$ per million tokens and instance shares against hand-computed figures; the price table's own rules."""

import datetime
import math

import pytest

from vllm_neuron.planning.pricing import (
    DEFAULT_INSTANCE,
    INSTANCES,
    dollars_per_million_tokens,
    instance_share,
)


def test_dollars_per_million_tokens():
    # $36/h is $0.01 a second; at 1,000 tokens/s a token costs $1e-5, a million $10.
    assert dollars_per_million_tokens(1000.0, 36.0) == pytest.approx(10.0)
    # Half the rate, twice the cost per token.
    assert dollars_per_million_tokens(500.0, 36.0) == pytest.approx(20.0)
    # A whole trn2.48xlarge at $35.7608/h serving 3,765 tok/s: 35.7608 / 3600 / 3765 * 1e6 = $2.6384.
    assert dollars_per_million_tokens(3765.0, 35.7608) == pytest.approx(2.638395, rel=1e-6)
    # No tokens: no finite cost, never a made-up number.
    assert math.isnan(dollars_per_million_tokens(0.0, 36.0))
    assert math.isnan(dollars_per_million_tokens(math.nan, 36.0))


def test_instance_share_charges_the_chips_used():
    assert instance_share(1, 16) == 1 / 16  # TP=4 at LNC=2: one Trainium2 chip of a trn2.48xlarge
    assert instance_share(4, 16) == 0.25
    assert instance_share(16, 16) == 1.0
    # One chip of sixteen at $35.7608/h is $2.23505/h; at 500 tok/s a million tokens cost $1.24169.
    trn2 = INSTANCES["trn2.48xlarge"]
    charge = trn2.dollars_per_hour * instance_share(1, trn2.chips)
    assert charge == pytest.approx(2.23505)
    assert dollars_per_million_tokens(500.0, charge) == pytest.approx(1.241694, rel=1e-6)
    for bad in (0, 17, -1):
        with pytest.raises(ValueError, match="1 to 16"):
            instance_share(bad, 16)


def test_price_table():
    assert DEFAULT_INSTANCE == "trn2.48xlarge" and INSTANCES[DEFAULT_INSTANCE].chips == 16
    for name, instance in INSTANCES.items():
        assert instance.name == name
        assert instance.chips > 0 and instance.dollars_per_hour > 0
        assert instance.basis in ("Capacity Block", "On-Demand")
        assert instance.source.startswith("https://")
        datetime.date.fromisoformat(instance.read)
    # The like-for-like pair of docs/benchmarks.md#prices: one basis, one page, one day.
    trn2, gpu = INSTANCES["trn2.48xlarge"], INSTANCES["p5en.48xlarge"]
    assert (trn2.basis, trn2.source, trn2.read) == (gpu.basis, gpu.source, gpu.read)
