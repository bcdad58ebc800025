"""Latency and throughput statistics of a run, from per-request timings. Pure functions, no I/O."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_neuron.planning.pricing import SECONDS_PER_HOUR, dollars_per_million_tokens

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default, and
    what `vllm bench serve` reports), so figures compare with vLLM's own. NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int]:
    """count, mean and p50/p90/p99 of values times scale (1e3: seconds to milliseconds)."""
    scaled = [v * scale for v in values]
    summary: dict[str, float | int] = {
        "count": len(scaled),
        "mean": sum(scaled) / len(scaled) if scaled else math.nan,
    }
    for q in PERCENTILES:
        summary[f"p{q}"] = percentile(scaled, q)
    return summary


def inter_token_latencies(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive token-bearing stream chunks. A chunk that carries several tokens counts as
    one arrival (as in `vllm bench serve`): the client cannot see when the tokens inside it were made."""
    return [later - earlier for earlier, later in zip(chunk_times, chunk_times[1:], strict=False)]


def time_per_output_token(start: float, chunk_times: Sequence[float], output_tokens: int) -> float | None:
    """(end - first token) / (tokens - 1): decode time per token after the first; None below 2 tokens."""
    if output_tokens < 2 or not chunk_times:
        return None
    return (chunk_times[-1] - chunk_times[0]) / (output_tokens - 1)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds on one monotonic clock."""

    start: float
    end: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token-bearing chunk
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None  # kind of failure (see client.py), None when it succeeded

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start


def level_summary(
    records: Sequence[RequestRecord], wall_seconds: float, dollars_per_hour: float | None = None
) -> dict[str, object]:
    """Figures of one measured run: latencies of the successful requests, throughput over the wall time
    of the measured window (warm-up excluded), failures by kind and, given the hourly charge of what the
    server runs on, its cost (see run_cost)."""
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for record in records:
        if record.error is not None:
            errors[record.error] = errors.get(record.error, 0) + 1
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [t for r in ok if (t := time_per_output_token(r.start, r.chunk_times, r.output_tokens))]
    summary: dict[str, object] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(errors.items())),
        "wall_s": wall_seconds,
        "requests_per_s": rate(len(ok), wall_seconds),
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": rate(output_tokens, wall_seconds),
        "prompt_tokens_per_s": rate(prompt_tokens, wall_seconds),
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None], 1e3),
        "itl_ms": summarize([gap for r in ok for gap in inter_token_latencies(r.chunk_times)], 1e3),
        "tpot_ms": summarize(tpots, 1e3),
        "e2e_ms": summarize([r.latency for r in ok], 1e3),
    }
    if dollars_per_hour is not None:
        summary.update(run_cost(summary, dollars_per_hour))
    return summary


def run_cost(summary: dict, dollars_per_hour: float) -> dict[str, float]:
    """What the measured window cost at dollars_per_hour, and that cost divided by the output tokens and by
    the prompt tokens, per million. Both divide the whole cost: they are not a split of it between prefill
    and decode, so they do not add up."""
    return {
        "dollars_per_hour": dollars_per_hour,
        "cost_dollars": dollars_per_hour * summary["wall_s"] / SECONDS_PER_HOUR,
        "dollars_per_million_output_tokens": dollars_per_million_tokens(
            summary["output_tokens_per_s"], dollars_per_hour
        ),
        "dollars_per_million_prompt_tokens": dollars_per_million_tokens(
            summary["prompt_tokens_per_s"], dollars_per_hour
        ),
    }


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan


def measured_window(records: Sequence[RequestRecord]) -> float:
    """Seconds from the first measured request's start to the last one's end."""
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)
