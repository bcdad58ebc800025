"""Automatic bucket policy: choose bucket sets for a declared traffic shape. Pure Python and numpy, no torch.

Every bucket is a compiled graph (minutes each on Trainium), and every call is padded up to a bucket, so the
bucket set trades padding (wasted compute on every step) against graph count (warm-up time and graph memory).
The right trade depends on traffic: short chat prompts want small prefill buckets, a full batch of decodes
wants decode buckets just below max_num_seqs. This module

- simulates vLLM-like continuous batching under a `TrafficShape` and maps each step to bucketed calls exactly
  as `worker/model_runner.py` does (`simulate`), and
- picks the bucket set with the best padding efficiency that fits a graph budget (`auto_buckets`): optimal
  1-D bucketing per dimension by dynamic programming, then a search over how many buckets each dimension
  gets, each candidate scored on the simulated trace.
"""

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_neuron.buckets import BucketConfig, BucketError, round_up, validate_buckets

# Prefill boundaries are rounded up to these multiples (tried in order) when that costs at most
# ROUNDING_TOLERANCE more token slots: hardware tiles and DMA like aligned sizes.
PREFILL_ALIGNMENTS = (16, 8)
ROUNDING_TOLERANCE = 0.005
# Candidate scores closer than this count as a tie, and the tie goes to fewer graphs (shorter warm-up).
SCORE_TIE = 1e-3


# ---- traffic -----------------------------------------------------------------------------------------


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
    """Declared traffic: prompt and output lengths (tokens, log-uniform between min and max, both inclusive)
    and how many requests clients keep in flight."""

    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    concurrency: int

    def __post_init__(self) -> None:
        # Normalise lists (from JSON) to tuples so the frozen instance stays hashable.
        object.__setattr__(self, "prompt_len", _length_range("prompt_len", self.prompt_len))
        object.__setattr__(self, "output_len", _length_range("output_len", self.output_len))
        if (
            not isinstance(self.concurrency, int)
            or isinstance(self.concurrency, bool)
            or self.concurrency < 1
        ):
            raise ValueError(f"concurrency must be a positive integer, got {self.concurrency!r}")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "TrafficShape":
        """From JSON config: {"prompt_len": [8, 2048], "output_len": [8, 256], "concurrency": 32}."""
        if not isinstance(config, Mapping):
            raise ValueError(f"traffic must be an object with prompt_len, output_len, concurrency; got {config!r}")
        expected = {"prompt_len", "output_len", "concurrency"}
        unknown, missing = sorted(set(config) - expected), sorted(expected - set(config))
        if unknown or missing:
            raise ValueError(
                f"traffic needs exactly the keys {sorted(expected)}"
                + (f"; unknown {unknown}" if unknown else "")
                + (f"; missing {missing}" if missing else "")
            )
        return cls(
            prompt_len=config["prompt_len"], output_len=config["output_len"], concurrency=config["concurrency"]
        )


# ---- the step simulator ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Trace:
    """The model calls a simulated run makes before bucketing: they do not depend on the buckets, because
    vLLM's scheduler never sees them. Bucketing one trace many ways is what makes the search cheap."""

    prefill_len: np.ndarray  # tokens of each prefill chunk (> 1 token; 1-token chunks run as decode rows)
    prefill_start: np.ndarray  # its first position
    decode_steps: tuple[np.ndarray, ...]  # per step with decode rows: each row's context (position + 1)
    decode_rows: np.ndarray  # rows of each such step
    decode_max_context: np.ndarray  # the longest row context of each step
    decode_sum_context: np.ndarray  # the summed row contexts of each step


def _log_uniform(rng: np.random.Generator, bounds: tuple[int, int], size: int) -> np.ndarray:
    low, high = bounds
    values = np.floor(np.exp(rng.uniform(math.log(low), math.log(high + 1), size))).astype(np.int64)
    return np.clip(values, low, high)


def _sample_requests(
    traffic: TrafficShape, max_model_len: int, count: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths, clamped so prompt + output <= max_model_len with at least one output."""
    rng = np.random.default_rng(seed)
    prompts = np.minimum(_log_uniform(rng, traffic.prompt_len, count), max(max_model_len - 1, 1))
    outputs = np.maximum(np.minimum(_log_uniform(rng, traffic.output_len, count), max_model_len - prompts), 1)
    return prompts, outputs


def _trace(
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_requests: int,
    seed: int,
) -> _Trace:
    """Run the scheduler model until `num_requests` requests finished.

    Clients keep `traffic.concurrency` requests in flight: a finished request is replaced at once, so the
    trace is the steady state (plus the start-up burst), without a drain tail of shrinking batches that a
    real server under constant load never sees. Per step, like vLLM's v1 scheduler with chunked prefill:
    running requests that are decoding get 1 token each, then requests part-way through their prompt, then
    waiting requests are admitted while fewer than max_num_seqs run; prompts are chunked to fit the token
    budget. The KV cache is assumed large enough (no preemption)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    # More requests than will finish are drawn so that the arrivals never run dry during the measured part.
    prompts, outputs = _sample_requests(traffic, max_model_len, num_requests + traffic.concurrency, seed)
    computed = np.zeros(len(prompts), np.int64)  # tokens with KV in the cache
    generated = np.zeros(len(prompts), np.int64)
    waiting = list(range(min(traffic.concurrency, len(prompts))))
    next_arrival = len(waiting)
    running: list[int] = []
    finished = 0
    prefill_len: list[int] = []
    prefill_start: list[int] = []
    decode_steps: list[np.ndarray] = []

    while finished < num_requests:
        budget = max_num_batched_tokens
        scheduled: list[tuple[int, int]] = []  # (request, tokens) in batch order
        decoding = [r for r in running if computed[r] >= prompts[r]]
        prefilling = [r for r in running if computed[r] < prompts[r]]
        for request in decoding:
            if budget == 0:
                break
            scheduled.append((request, 1))
            budget -= 1
        for request in prefilling:
            if budget == 0:
                break
            count = min(int(prompts[request] - computed[request]), budget)
            scheduled.append((request, count))
            budget -= count
        while waiting and budget > 0 and len(running) < max_num_seqs:
            request = waiting.pop(0)
            running.append(request)
            count = min(int(prompts[request]), budget)
            scheduled.append((request, count))
            budget -= count

        # Map to calls as the runner does: every 1-token request is a decode row, the rest prefill calls.
        rows = [int(computed[r]) + 1 for r, count in scheduled if count == 1]
        if rows:
            decode_steps.append(np.asarray(rows, np.int64))
        for request, count in scheduled:
            if count > 1:
                prefill_len.append(count)
                prefill_start.append(int(computed[request]))

        for request, count in scheduled:
            computed[request] += count
            if computed[request] >= prompts[request]:  # this step sampled a token
                generated[request] += 1
                if generated[request] >= outputs[request]:
                    running.remove(request)
                    finished += 1
                    if next_arrival < len(prompts):
                        waiting.append(next_arrival)
                        next_arrival += 1

    return _Trace(
        prefill_len=np.asarray(prefill_len, np.int64),
        prefill_start=np.asarray(prefill_start, np.int64),
        decode_steps=tuple(decode_steps),
        decode_rows=np.asarray([len(s) for s in decode_steps], np.int64),
        decode_max_context=np.asarray([s.max() for s in decode_steps], np.int64),
        decode_sum_context=np.asarray([s.sum() for s in decode_steps], np.int64),
    )


def _pick(buckets: Sequence[int], sizes: np.ndarray, name: str) -> np.ndarray:
    """Vectorised `buckets.pick_bucket`: the smallest bucket holding each size."""
    values = np.asarray(buckets, np.int64)
    index = np.searchsorted(values, sizes, side="left")
    if len(sizes) and index.max() == len(values):
        raise BucketError(f"{name} size {int(sizes.max())} exceeds the largest bucket {values[-1]} of {list(buckets)}")
    return values[index]


def _split_prefill(trace: _Trace, largest: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunks longer than the largest prefill bucket run as consecutive sub-chunks, as in the runner."""
    lengths, starts = trace.prefill_len, trace.prefill_start
    if not len(lengths) or lengths.max() <= largest:
        return lengths, starts
    parts_len: list[int] = []
    parts_start: list[int] = []
    for length, start in zip(lengths.tolist(), starts.tolist(), strict=True):
        for offset in range(0, length, largest):
            parts_len.append(min(largest, length - offset))
            parts_start.append(start + offset)
    return np.asarray(parts_len, np.int64), np.asarray(parts_start, np.int64)


def _decode_calls(trace: _Trace, largest: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, longest context, summed contexts) per decode call; a step with more rows than the largest
    decode bucket is split into groups of that size in batch order, as in the runner."""
    if not len(trace.decode_rows) or trace.decode_rows.max() <= largest:
        return trace.decode_rows, trace.decode_max_context, trace.decode_sum_context
    groups = [
        step[first : first + largest] for step in trace.decode_steps for first in range(0, len(step), largest)
    ]
    return (
        np.asarray([len(g) for g in groups], np.int64),
        np.asarray([g.max() for g in groups], np.int64),
        np.asarray([g.sum() for g in groups], np.int64),
    )


def _ratio(real: float, padded: float) -> float:
    # No calls of a phase waste nothing.
    return real / padded if padded else 1.0


def _evaluate(buckets: BucketConfig, trace: _Trace) -> dict[str, float | int]:
    lengths, starts = _split_prefill(trace, buckets.prefill_tokens[-1])
    token_buckets = _pick(buckets.prefill_tokens, lengths, "prefill chunk")
    prefill_contexts = _pick(buckets.context_tokens, starts + lengths, "prefill context")
    # Causal attention work of a real chunk: token at position p reads p + 1 keys.
    prefill_attention = lengths * starts + lengths * (lengths + 1) // 2

    rows, max_context, sum_context = _decode_calls(trace, buckets.decode_batch[-1])
    batch_buckets = _pick(buckets.decode_batch, rows, "decode batch")
    decode_contexts = _pick(buckets.context_tokens, max_context, "decode context")

    return {
        "prefill": _ratio(lengths.sum(), token_buckets.sum()),
        "decode": _ratio(rows.sum(), batch_buckets.sum()),
        "prefill_context": _ratio(prefill_attention.sum(), (token_buckets * prefill_contexts).sum()),
        "decode_context": _ratio(sum_context.sum(), (batch_buckets * decode_contexts).sum()),
        "prefill_calls": len(lengths),
        "decode_calls": len(rows),
        "graphs": buckets.num_graphs,
    }


def simulate(
    buckets: BucketConfig,
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_requests: int = 400,
    seed: int = 0,
) -> dict[str, float | int]:
    """Padding efficiency of `buckets` under `traffic`, from a deterministic simulation of continuous
    batching (same seed, same result).

    Returns
    - `prefill`: real prefill tokens / token-bucket slots computed;
    - `decode`: real decode rows / batch-bucket slots computed;
    - `prefill_context`: causal attention work of the real chunk tokens / (token bucket x context bucket);
    - `decode_context`: summed real row contexts / (batch bucket x context bucket);
    - `prefill_calls`, `decode_calls`: compiled calls of each phase; `graphs`: `buckets.num_graphs`.
    An efficiency is 1.0 where a phase made no calls. Raises BucketError if a call fits no bucket.
    """
    trace = _trace(
        traffic,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_requests=num_requests,
        seed=seed,
    )
    return _evaluate(buckets, trace)


# ---- optimal 1-D bucketing ---------------------------------------------------------------------------


def _optimal_boundaries(values: np.ndarray, weights: np.ndarray, top: int, max_k: int) -> list[list[int]]:
    """For k = 1..max_k, the k boundaries (ascending, the last one `top`) minimising the padded slots
    sum(weight x bucket(value)) of the sample.

    Dynamic programming over the sorted distinct values: a bucket covering values i+1..j is best placed at
    value j, so best[k][j] = min over i of best[k-1][i] + v_j * (W_j - W_i) with W the cumulative weights.
    `top` is always the largest boundary (the engine limit), so no call is ever split."""
    distinct, inverse = np.unique(np.append(values, top), return_inverse=True)
    totals = np.bincount(inverse, weights=np.append(weights, 0.0))
    distinct, totals = distinct[distinct <= top], totals[distinct <= top]
    n = len(distinct)
    cumulative = np.concatenate(([0.0], np.cumsum(totals)))  # W_i: weight of the first i values
    # cost[i, j]: a bucket at value j holding values i..j (rows i, columns j, 0-based, i <= j)
    cost = distinct[None, :] * (cumulative[None, 1:] - cumulative[:n, None])
    cost = np.where(np.triu(np.ones((n, n), bool)), cost, np.inf)
    best = cost[0].copy()  # one bucket at value j covering every value <= j
    choice: list[np.ndarray] = []
    results = [[int(distinct[-1])]]
    for _ in range(2, min(max_k, n) + 1):
        # best[i - 1] + cost[i, j]: the previous buckets end at value i - 1, the new one covers i..j
        total = np.full((n, n), np.inf)
        total[1:, :] = best[:-1, None] + cost[1:, :]
        choice.append(np.argmin(total, axis=0))
        best = total[choice[-1], np.arange(n)]
        boundaries, j = [n - 1], n - 1
        for step in reversed(choice):
            j = int(step[j]) - 1
            boundaries.append(j)
        results.append([int(distinct[b]) for b in reversed(boundaries)])
    return results


def _slots(boundaries: Sequence[int], values: np.ndarray, weights: np.ndarray) -> float:
    return float((_pick(boundaries, values, "value") * weights).sum())


def _align_prefill(boundaries: list[int], values: np.ndarray, weights: np.ndarray) -> tuple[int, ...]:
    """Round each boundary but the last up to a multiple of 16 (else 8) where that costs little: values
    between the old and new boundary move down into it, the rest of its bucket pays a few more slots."""
    aligned = list(boundaries)
    budget = _slots(aligned, values, weights) * (1 + ROUNDING_TOLERANCE)
    for index in range(len(aligned) - 1):
        for multiple in PREFILL_ALIGNMENTS:
            rounded = round_up(aligned[index], multiple)
            if rounded == aligned[index]:
                break
            if rounded >= aligned[index + 1]:
                continue
            trial = [*aligned[:index], rounded, *aligned[index + 1 :]]
            if _slots(trial, values, weights) <= budget:
                aligned = trial
                break
    return tuple(aligned)


# ---- the search --------------------------------------------------------------------------------------


def _score(result: Mapping[str, float | int]) -> float:
    """What auto_buckets maximises: token and batch padding efficiency of the two phases."""
    return float(result["prefill"]) + float(result["decode"])


def auto_buckets(
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    graph_budget: int = 24,
    seed: int = 0,
) -> BucketConfig:
    """The bucket set with the best simulated padding efficiency for `traffic` within `graph_budget` graphs.

    The largest bucket of each dimension is the engine limit (min(max_num_batched_tokens, max_model_len)
    tokens, max_num_seqs rows, max_model_len rounded up to the block size), so no chunk or decode step is
    ever split, and the result always passes `validate_buckets` for the same limits. Raises ValueError if
    even one bucket per dimension exceeds the budget."""
    limits = dict(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    max_chunk = min(max_num_batched_tokens, max_model_len)
    max_context = round_up(max_model_len, block_size)
    minimal = BucketConfig((max_chunk,), (max_num_seqs,), (max_context,))
    if minimal.num_graphs > graph_budget:
        raise ValueError(
            f"graph_budget={graph_budget} is below the minimal bucket set {minimal.describe()}: "
            f"raise graph_budget to at least {minimal.num_graphs}"
        )
    trace = _trace(traffic, **limits, num_requests=400, seed=seed)
    prefill_options = _prefill_options(trace, max_chunk, graph_budget)
    decode_options = _decode_options(trace, max_num_seqs, graph_budget)
    context_options = _context_options(trace, block_size, max_context, graph_budget)

    best, best_key = minimal, None
    for prefill, decode, context in itertools.product(prefill_options, decode_options, context_options):
        # Each prefill bucket needs >= 1 graph, each decode bucket one per context bucket.
        if len(prefill) + len(decode) * len(context) > graph_budget:
            continue
        candidate = BucketConfig(prefill, decode, context)
        graphs = candidate.num_graphs
        if graphs > graph_budget:
            continue
        score = _score(_evaluate(candidate, trace))
        key = (score, graphs)
        if best_key is None or _better(key, best_key):
            best, best_key = candidate, key
    validate_buckets(best, **limits, block_size=block_size)
    return best


def _better(key: tuple[float, int], than: tuple[float, int]) -> bool:
    """A clearly higher score wins; within SCORE_TIE, fewer graphs win."""
    (score, graphs), (best_score, best_graphs) = key, than
    if abs(score - best_score) <= SCORE_TIE:
        return graphs < best_graphs or (graphs == best_graphs and score > best_score)
    return score > best_score


def _prefill_options(trace: _Trace, max_chunk: int, budget: int) -> list[tuple[int, ...]]:
    lengths = np.minimum(trace.prefill_len, max_chunk)
    weights = np.ones(len(lengths))  # every chunk pays its bucket in token slots
    return [
        _align_prefill(b, lengths, weights) for b in _optimal_boundaries(lengths, weights, max_chunk, budget)
    ]


def _decode_options(trace: _Trace, max_num_seqs: int, budget: int) -> list[tuple[int, ...]]:
    rows = np.minimum(trace.decode_rows, max_num_seqs)
    return [tuple(b) for b in _optimal_boundaries(rows, np.ones(len(rows)), max_num_seqs, budget)]


def _context_options(trace: _Trace, block_size: int, max_context: int, budget: int) -> list[tuple[int, ...]]:
    """Context needs rounded up to whole blocks (a context bucket must be a multiple of the block size),
    weighted by the rows or tokens that read them."""
    needs = np.concatenate((trace.prefill_start + trace.prefill_len, trace.decode_max_context))
    weights = np.concatenate((trace.prefill_len, trace.decode_rows)).astype(float)
    needs = np.minimum(-(-needs // block_size) * block_size, max_context)
    return [tuple(b) for b in _optimal_boundaries(needs, weights, max_context, budget)]
