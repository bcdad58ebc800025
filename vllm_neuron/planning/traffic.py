"""Declared traffic for the automatic bucket policy: request lengths and how many requests clients keep in
flight, and the lighter loads a real day has besides its peak. Pure Python and numpy, no torch."""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Share of the simulated requests run at the declared concurrency, at half of it, and at a quarter of it.
LOAD_PROFILE = (0.6, 0.2, 0.2)
LOAD_DIVISORS = (1, 2, 4)


def _length_range(name: str, value: Any) -> tuple[int, int]:
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise ValueError(f"{name} must be a [min, max] pair of token counts, got {value!r}")
    low, high = value
    for bound in (low, high):
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
            raise ValueError(f"{name} bounds must be positive integers, got {list(value)}")
    if low > high:
        raise ValueError(f"{name} min {low} is above its max {high}: give [min, max]")
    return (low, high)


@dataclass(frozen=True)
class TrafficShape:
    """Declared traffic: prompt and output lengths in tokens (log-uniform between min and max, both
    included) and how many requests clients keep in flight."""

    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    concurrency: int

    def __post_init__(self) -> None:
        # Lists (from JSON) become tuples so that the frozen instance stays hashable.
        object.__setattr__(self, "prompt_len", _length_range("prompt_len", self.prompt_len))
        object.__setattr__(self, "output_len", _length_range("output_len", self.output_len))
        concurrency = self.concurrency
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "TrafficShape":
        """From JSON config: {"prompt_len": [8, 2048], "output_len": [8, 256], "concurrency": 32}."""
        expected = {"prompt_len", "output_len", "concurrency"}
        if not isinstance(config, Mapping):
            raise ValueError(f"traffic must be an object with the keys {sorted(expected)}, got {config!r}")
        unknown, missing = sorted(set(config) - expected), sorted(expected - set(config))
        if unknown or missing:
            raise ValueError(
                f"traffic needs exactly the keys {sorted(expected)}"
                + (f"; unknown {unknown}" if unknown else "")
                + (f"; missing {missing}" if missing else "")
            )
        return cls(
            prompt_len=config["prompt_len"],
            output_len=config["output_len"],
            concurrency=config["concurrency"],
        )


def _log_uniform(rng: np.random.Generator, bounds: tuple[int, int], size: int) -> np.ndarray:
    low, high = bounds
    values = np.floor(np.exp(rng.uniform(math.log(low), math.log(high + 1), size))).astype(np.int64)
    return np.clip(values, low, high)


def sample_requests(
    traffic: TrafficShape, max_model_len: int, count: int, seed: int
) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of `count` requests, clamped so that prompt + output <= max_model_len with
    at least one output token. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    prompts = np.minimum(_log_uniform(rng, traffic.prompt_len, count), max(max_model_len - 1, 1))
    outputs = np.maximum(np.minimum(_log_uniform(rng, traffic.output_len, count), max_model_len - prompts), 1)
    return prompts.tolist(), outputs.tolist()


def load_at(concurrency: int, arrival: int, num_requests: int) -> int:
    """Requests kept in flight when request `arrival` of `num_requests` may arrive: the declared concurrency
    for the first LOAD_PROFILE[0] of the run, then lighter loads, because real traffic is not a constant
    peak and a bucket set fitted only to the peak pads every lighter step up to it."""
    position = arrival / max(num_requests, 1)
    reached = 0.0
    for share, divisor in zip(LOAD_PROFILE, LOAD_DIVISORS, strict=True):
        reached += share
        if position < reached:
            return max(1, concurrency // divisor)
    return max(1, concurrency // LOAD_DIVISORS[-1])
