"""Automatic bucket policy: bucket sets chosen for a declared traffic shape. Pure Python and numpy, no torch.

Every bucket shape is a compiled graph (minutes each on Trainium) and every call is padded up to a bucket, so
a bucket set trades padding (compute wasted on every step) against graph count (warm-up time, graph memory).
The right trade depends on the traffic: short prompts want small prefill buckets, a server kept full wants
decode buckets just below max_num_seqs. This module

- simulates vLLM-like continuous batching under a `TrafficShape` and maps each step to bucketed calls as
  `worker/model_runner.py` does (`simulate`), and
- picks the bucket set with the least estimated serving time that fits a graph budget (`auto_buckets`):
  optimal 1-D bucketing of each dimension by dynamic programming, then a search over how many buckets each
  dimension gets, every candidate costed on the same simulated run with `CallCosts`. Prefill calls depend
  only on the prefill token and context buckets, decode calls only on the decode batch and decode context
  buckets, so the two halves are searched apart and joined under the budget.
"""

import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vllm_neuron.buckets import (
    BucketConfig,
    BucketError,
    decode_page_tokens,
    light_load_batches,
    mixed_graphs,
    pack_prefill,
    round_up,
    validate_buckets,
)

# Prefill boundaries are rounded up to these multiples (tried in order) where that costs at most
# ROUNDING_TOLERANCE more token slots: hardware tiles and DMA prefer aligned sizes.
PREFILL_ALIGNMENTS = (16, 8)
ROUNDING_TOLERANCE = 0.005
# Share of the simulated requests run at the declared concurrency, at half of it, and at a quarter of it.
LOAD_PROFILE = (0.6, 0.2, 0.2)
LOAD_DIVISORS = (1, 2, 4)
LOAD_PROFILE_CUMULATIVE = tuple(sum(LOAD_PROFILE[: i + 1]) for i in range(len(LOAD_PROFILE)))
# Candidate times closer than this fraction are a tie, and a tie goes to fewer graphs (shorter warm-up).
TIME_TIE = 1e-3
# Requests in the simulated run auto_buckets fits to: more than simulate's default, so the boundaries follow
# the traffic's distribution rather than one small sample of it.
FIT_REQUESTS = 1600


@dataclass(frozen=True)
class CallCosts:
    """What a compiled call costs, in milliseconds, by what its bucket shape makes it compute.

    The defaults are SmolLM2-135M in CPU mode on 2 cores (docs/batching.md): a 1-row decode call 79 ms, a
    32-row one over 128 pages 295 ms (half of it reading the pages), a 484-token prefill chunk 580 ms, a
    48-token one 120 ms. Only their ratios matter to the choice. Trainium's, estimated from its HBM bandwidth
    and matmul throughput for the same model, land within about 3x of these ratios: a call's pass over the
    weights dominates small calls, and decode pages are read once per row."""

    call: float = 70.0  # a pass over the weights, whatever the shape
    token: float = 1.1  # each prefill token slot
    row: float = 2.3  # each decode row slot (its logits and sampling too)
    kv_position: float = 0.0092  # each KV position a decode call reads: batch x pages x page tokens
    attention: float = 0.00025  # each (query, key) pair of a prefill chunk: token bucket x context bucket


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


# ---- the simulated run -------------------------------------------------------------------------------
#
# A run is recorded before bucketing: vLLM's scheduler never sees the buckets, so the same calls happen
# whatever the bucket set, and one run can be bucketed many ways (that is what makes the search cheap).
# Identical calls are stored once with a count, so a long decode-heavy run stays small.


@dataclass(frozen=True)
class _PrefillChunks:
    """Every prefill chunk as scheduled (more than one token; a 1-token chunk runs as a decode row), in step
    order: the runner packs the chunks of one step into shared calls, as the bucket set allows."""

    step: np.ndarray
    length: np.ndarray  # tokens
    start: np.ndarray  # tokens already in the cache


@dataclass(frozen=True)
class _PrefillCalls:
    """Distinct prefill calls: one or more chunks packed in one row of queries."""

    length: np.ndarray  # tokens
    context: np.ndarray  # KV positions the call attends over: its chunks' contexts, each in whole blocks
    attention: np.ndarray  # causal attention work of its real tokens: a token at position p reads p + 1 keys
    count: np.ndarray  # how many such calls ran


@dataclass(frozen=True)
class _DecodeSteps:
    """Every step with decode rows, as run: `repeat` consecutive steps of the same rows whose contexts
    (position + 1, batch order) are `contexts[offset : offset + size]` at the first and grow by one a step."""

    contexts: np.ndarray
    size: np.ndarray
    repeat: np.ndarray


@dataclass(frozen=True)
class _DecodeCalls:
    """Distinct runs of decode calls: `repeat` consecutive calls of `rows` rows whose contexts sum to
    `context_sum` at the first call and `rows` more at each next; `count` such runs."""

    rows: np.ndarray
    context_sum: np.ndarray
    repeat: np.ndarray
    count: np.ndarray


@dataclass(frozen=True)
class _Trace:
    prefill: _PrefillChunks
    decode_steps: _DecodeSteps
    decode: _DecodeCalls  # decode_steps as calls of at most max_num_seqs rows, the usual case


def _log_uniform(rng: np.random.Generator, bounds: tuple[int, int], size: int) -> np.ndarray:
    low, high = bounds
    values = np.floor(np.exp(rng.uniform(math.log(low), math.log(high + 1), size))).astype(np.int64)
    return np.clip(values, low, high)


def _sample_requests(
    traffic: TrafficShape, max_model_len: int, count: int, seed: int
) -> tuple[list[int], list[int]]:
    """Prompt and output lengths, clamped so prompt + output <= max_model_len with at least one output."""
    rng = np.random.default_rng(seed)
    prompts = np.minimum(_log_uniform(rng, traffic.prompt_len, count), max(max_model_len - 1, 1))
    outputs = np.maximum(np.minimum(_log_uniform(rng, traffic.output_len, count), max_model_len - prompts), 1)
    return prompts.tolist(), outputs.tolist()


def _trace(
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_requests: int,
    seed: int,
) -> _Trace:
    """Run the scheduler model until `num_requests` requests have finished.

    Clients keep requests in flight and replace a finished one at once: `traffic.concurrency` of them for the
    first part of the run, then lighter loads (see `_load`). The KV cache is assumed large enough (no
    preemption)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    # Enough requests that arrivals never run dry before `num_requests` have finished.
    prompts, outputs = _sample_requests(traffic, max_model_len, num_requests + traffic.concurrency, seed)
    computed = [0] * len(prompts)  # tokens with KV in the cache
    generated = [0] * len(prompts)
    waiting = deque(range(traffic.concurrency))
    next_arrival = traffic.concurrency
    running: list[int] = []  # admission order stands in for the runner's batch order
    finished = 0
    chunks: list[tuple[int, int, int]] = []  # (step, length, start) of every prefill chunk
    contexts: list[int] = []
    sizes: list[int] = []
    repeats: list[int] = []

    step_number = 0
    while finished < num_requests:
        step_number += 1
        steps = _decode_only_steps(running, waiting, computed, prompts, generated, outputs, max_num_seqs)
        if steps and len(running) <= max_num_batched_tokens:
            # Nothing changes until the first running request finishes: take those steps in one go, or a
            # decode-heavy run would cost one Python iteration per step.
            scheduled = [(r, steps) for r in running]
            rows = [computed[r] + 1 for r in running]
        else:
            steps = 1
            scheduled = _schedule(running, waiting, computed, prompts, max_num_seqs, max_num_batched_tokens)
            # As the runner does: every 1-token request is a decode row, the others' chunks prefill calls.
            rows = [computed[r] + 1 for r, count in scheduled if count == 1]
            chunks += [(step_number, count, computed[r]) for r, count in scheduled if count > 1]
        if rows:
            contexts += rows
            sizes.append(len(rows))
            repeats.append(steps)

        for request, count in scheduled:
            was_decoding = computed[request] >= prompts[request]
            computed[request] += count
            if computed[request] < prompts[request]:
                continue
            generated[request] += count if was_decoding else 1  # every step past the prompt samples a token
            if generated[request] >= outputs[request]:
                running.remove(request)
                finished += 1
                # Top up to the load of this part of the run (lighter loads only stop replacing requests).
                target = _load(traffic.concurrency, next_arrival, num_requests)
                while next_arrival < len(prompts) and len(running) + len(waiting) < target:
                    waiting.append(next_arrival)
                    next_arrival += 1

    decode_steps = _DecodeSteps(
        np.asarray(contexts, np.int64), np.asarray(sizes, np.int64), np.asarray(repeats, np.int64)
    )
    step, length, start = np.asarray(chunks, np.int64).reshape(-1, 3).T
    prefill = _PrefillChunks(step, length, start)
    return _Trace(prefill, decode_steps, _decode_calls(decode_steps, max_num_seqs))


def _load(concurrency: int, arrival: int, num_requests: int) -> int:
    """Requests kept in flight when request `arrival` may arrive: the declared concurrency for the first
    LOAD_PROFILE[0] of the run, then lighter loads, because real traffic is not a constant peak and a bucket
    set fitted only to the peak pads every lighter step up to it."""
    position = arrival / max(num_requests, 1)
    for share, divisor in zip(LOAD_PROFILE_CUMULATIVE, LOAD_DIVISORS, strict=True):
        if position < share:
            return max(1, concurrency // divisor)
    return max(1, concurrency // LOAD_DIVISORS[-1])


def _decode_only_steps(
    running: list[int],
    waiting: deque[int],
    computed: list[int],
    prompts: list[int],
    generated: list[int],
    outputs: list[int],
    max_num_seqs: int,
) -> int:
    """How many coming steps are plain decode steps of exactly the running requests (0 if the next one is
    not): every running request is past its prompt and nobody can be admitted, until the first finishes."""
    if not running or (waiting and len(running) < max_num_seqs):
        return 0
    if any(computed[r] < prompts[r] for r in running):
        return 0
    return min(outputs[r] - generated[r] for r in running)


def _schedule(
    running: list[int],
    waiting: deque[int],
    computed: list[int],
    prompts: list[int],
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> list[tuple[int, int]]:
    """One step of vLLM's v1 scheduler with chunked prefill, as (request, tokens) in batch order: decoding
    requests get 1 token each, then requests part-way through their prompt the next chunk, then waiting
    requests are admitted (into `running`) while fewer than max_num_seqs run and tokens are left."""
    budget = max_num_batched_tokens
    scheduled: list[tuple[int, int]] = []
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
        count = min(prompts[request] - computed[request], budget)
        scheduled.append((request, count))
        budget -= count
    while waiting and budget > 0 and len(running) < max_num_seqs:
        request = waiting.popleft()
        running.append(request)
        count = min(prompts[request], budget)
        scheduled.append((request, count))
        budget -= count
    return scheduled


def _causal_work(length: int, start: int) -> int:
    """Keys read by the real tokens of a chunk: the token at position p reads p + 1."""
    return length * start + length * (length + 1) // 2


def _prefill_calls(
    chunks: _PrefillChunks, largest_tokens: int, largest_context: int, block_size: int
) -> _PrefillCalls:
    """The calls the runner makes of these chunks: each step's chunks packed by `pack_prefill`."""
    calls: list[tuple[int, int, int]] = []  # (tokens, context, attention)
    boundaries = np.flatnonzero(np.diff(chunks.step)) + 1
    for step in np.split(np.stack((chunks.start, chunks.length), axis=1), boundaries):
        for call in pack_prefill(step.tolist(), largest_tokens, largest_context, block_size):
            attention = sum(_causal_work(length, start) for _, start, length in call.parts)
            calls.append((call.tokens, call.context, attention))
    if not calls:
        empty = np.zeros(0, np.int64)
        return _PrefillCalls(empty, empty, empty, empty)
    distinct, count = np.unique(np.asarray(calls, np.int64), axis=0, return_counts=True)
    return _PrefillCalls(distinct[:, 0], distinct[:, 1], distinct[:, 2], count.astype(np.int64))


def _decode_calls(steps: _DecodeSteps, group: int) -> _DecodeCalls:
    """The decode calls of `steps` when a step's rows are cut into calls of at most `group` rows in batch
    order, as the runner does with its largest decode bucket."""
    if not len(steps.size):
        empty = np.zeros(0, np.int64)
        return _DecodeCalls(empty, empty, empty, empty, empty)
    first_row = np.concatenate(([0], np.cumsum(steps.size)[:-1]))
    position = np.arange(len(steps.contexts)) - np.repeat(first_row, steps.size)
    starts = np.flatnonzero(position % group == 0)  # where each call's rows begin
    rows = np.diff(np.append(starts, len(steps.contexts)))
    summed = np.add.reduceat(steps.contexts, starts)
    repeat = np.repeat(steps.repeat, -(-steps.size // group))
    # Merge identical (rows, summed, repeat) runs: the key packs the three into one integer.
    key = (rows * (summed.max() + 1) + summed) * (repeat.max() + 1) + repeat
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return _DecodeCalls(
        rows=rows[first],
        context_sum=summed[first],
        repeat=repeat[first],
        count=np.bincount(inverse),
    )


# ---- bucketing a run ---------------------------------------------------------------------------------


def _pick(buckets: Sequence[int], sizes: np.ndarray, what: str) -> np.ndarray:
    """`buckets.pick_bucket` for many sizes at once: the smallest bucket holding each."""
    values = np.asarray(buckets, np.int64)
    if len(sizes) and sizes.max() > values[-1]:
        raise BucketError(
            f"{what} {int(sizes.max())} exceeds the largest bucket {values[-1]} of {list(buckets)}"
        )
    return values[np.searchsorted(values, sizes, side="left")]


def _decode_context_sums(buckets: BucketConfig, batch: np.ndarray, calls: _DecodeCalls) -> np.ndarray:
    """Per run, the KV positions its calls attend over: a decode call of `batch` rows attends over
    batch x (the pages of its context bucket), and takes the smallest bucket whose pages hold the rows'
    summed context, that is an average of ceil(summed / batch) per row. (The runner rounds each row up to
    whole pages; the model rounds the sum, which keeps runs mergeable and differs by under a page a row.)"""
    contexts = buckets.decode_contexts()
    capacity = np.asarray([-(-c // buckets.page_tokens) * buckets.page_tokens for c in contexts], np.int64)
    last = calls.context_sum + calls.rows * (calls.repeat - 1)
    if len(last) and (-(-last // batch)).max() > capacity[-1]:
        raise BucketError(
            f"decode context {int((-(-last // batch)).max())} exceeds the largest context bucket "
            f"{contexts[-1]} of {list(buckets.context_tokens)}"
        )
    # Calls k = 0 .. repeat-1 of a run need ceil((context_sum + rows * k) / batch) per row; those that fit
    # capacity c are k <= (c * batch - context_sum) // rows.
    fitting = (capacity[None, :] * batch[:, None] - calls.context_sum[:, None]) // calls.rows[:, None] + 1
    fitting = np.clip(fitting, 0, calls.repeat[:, None])
    in_bucket = np.diff(fitting, axis=1, prepend=0)
    return in_bucket @ capacity * batch


def _ratio(real: float, padded: float) -> float:
    return float(real / padded) if padded else 1.0  # a phase without calls wastes nothing


def _prefill_figures(
    buckets: BucketConfig, prefill: _PrefillCalls, costs: CallCosts
) -> dict[str, float | int]:
    tokens = _pick(buckets.prefill_tokens, prefill.length, "prefill call of")
    context = _pick(buckets.context_tokens, prefill.context, "prefill context")
    calls = int(prefill.count.sum())
    slots = (prefill.count * tokens).sum()
    pairs = (prefill.count * tokens * context).sum()
    return {
        "prefill": _ratio((prefill.count * prefill.length).sum(), slots),
        "prefill_context": _ratio((prefill.count * prefill.attention).sum(), pairs),
        "prefill_calls": calls,
        "prefill_ms": float(costs.call * calls + costs.token * slots + costs.attention * pairs),
    }


def _decode_figures(buckets: BucketConfig, trace: _Trace, costs: CallCosts) -> dict[str, float | int]:
    decode = trace.decode
    if len(decode.rows) and decode.rows.max() > buckets.decode_batch[-1]:
        decode = _decode_calls(trace.decode_steps, buckets.decode_batch[-1])
    calls = decode.count * decode.repeat
    batch = _pick(buckets.decode_batch, decode.rows, "decode batch of")
    attended = (decode.count * _decode_context_sums(buckets, batch, decode)).sum()
    # Over a run the row contexts grow by `rows` a call: repeat * first + rows * (0 + 1 + ... + repeat - 1).
    per_run = decode.repeat * decode.context_sum + decode.rows * decode.repeat * (decode.repeat - 1) // 2
    slots = (calls * batch).sum()
    return {
        "decode": _ratio((calls * decode.rows).sum(), slots),
        "decode_context": _ratio((decode.count * per_run).sum(), attended),
        "decode_calls": int(calls.sum()),
        "decode_ms": float(costs.call * calls.sum() + costs.row * slots + costs.kv_position * attended),
    }


def _evaluate(
    buckets: BucketConfig, trace: _Trace, block_size: int, costs: CallCosts
) -> dict[str, float | int]:
    prefill = _prefill_calls(
        trace.prefill, buckets.prefill_tokens[-1], buckets.context_tokens[-1], block_size
    )
    return {
        **_prefill_figures(buckets, prefill, costs),
        **_decode_figures(buckets, trace, costs),
        "graphs": buckets.num_graphs,
    }


def _check_limits(**limits: int) -> None:
    for name, value in limits.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def simulate(
    buckets: BucketConfig,
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_requests: int = 400,
    seed: int = 0,
    block_size: int = 32,
    costs: CallCosts = CallCosts(),
) -> dict[str, float | int]:
    """Padding efficiency and estimated time of `buckets` under `traffic`, from a deterministic simulation of
    continuous batching (same arguments, same result) until `num_requests` requests have finished.
    `block_size` is the KV block size (the plugin's default 32): packed prefill chunks take whole blocks.

    Returns
    - `prefill`: real prefill tokens / token-bucket slots computed;
    - `decode`: real decode rows / batch-bucket slots computed;
    - `prefill_context`: causal attention work of the real chunk tokens / (token bucket x context bucket);
    - `decode_context`: summed real row contexts / KV positions attended (batch bucket x the pages of
      the context bucket: see `_decode_context_sums`);
    - `prefill_calls`, `decode_calls`: compiled calls of each phase; `graphs`: `buckets.num_graphs`;
    - `prefill_ms`, `decode_ms`: the calls' estimated time by `costs`.
    An efficiency is 1.0 where a phase made no calls. Raises BucketError if a call fits no bucket.
    """
    limits = dict(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    _check_limits(**limits, block_size=block_size)
    trace = _trace(traffic, **limits, num_requests=num_requests, seed=seed)
    return _evaluate(buckets, trace, block_size, costs)


# ---- optimal 1-D bucketing ---------------------------------------------------------------------------


def _optimal_boundaries(values: np.ndarray, weights: np.ndarray, top: int, most: int) -> list[list[int]]:
    """For k = 1..most: the k ascending boundaries, the last one `top`, that minimise the padded slots
    sum(weight * bucket(value)).

    Dynamic programming over the sorted distinct values v_0 < ... < v_n-1 (= top): a bucket holding values
    i..j is best placed at v_j, so best_k[j] = min over i of best_k-1[i - 1] + v_j * (W[j + 1] - W[i]), W the
    cumulative weights. One (n x n) numpy step per k. Fewer than k distinct values give no k-bucket answer.
    """
    distinct, inverse = np.unique(np.append(values, top), return_inverse=True)
    totals = np.bincount(inverse, weights=np.append(weights, 0.0).astype(float))
    n = len(distinct)
    cumulative = np.concatenate(([0.0], np.cumsum(totals)))
    # cost[i, j]: one bucket at v_j holding v_i..v_j; infinite below the diagonal (i > j)
    cost = distinct[None, :] * (cumulative[None, 1:] - cumulative[:n, None])
    cost[np.tril_indices(n, -1)] = np.inf
    best = cost[0].copy()
    choices: list[np.ndarray] = []  # per k >= 2: for each j, where the last bucket starts
    results = [[int(top)]]
    for _ in range(2, min(most, n) + 1):
        total = np.full((n, n), np.inf)
        total[1:] = best[:-1, None] + cost[1:]
        choices.append(np.argmin(total, axis=0))
        best = total[choices[-1], np.arange(n)]
        ends, j = [n - 1], n - 1
        for choice in reversed(choices):
            j = int(choice[j]) - 1
            ends.append(j)
        results.append([int(distinct[end]) for end in reversed(ends)])
    return results


def _coarsen(values: np.ndarray) -> np.ndarray:
    """Round each value up to 1/64 of its power of two (exact below 128): candidate boundaries stay within
    1.6% of every value, the dynamic programme stays small (64 candidates an octave) and boundaries do not
    chase individual sampled lengths."""
    granule = 2 ** np.maximum(np.floor(np.log2(np.maximum(values, 1))).astype(np.int64) - 6, 0)
    return -(-values // granule) * granule


def _slots(boundaries: Sequence[int], values: np.ndarray, weights: np.ndarray) -> float:
    return float((_pick(boundaries, values, "value") * weights).sum())


def _align(boundaries: list[int], values: np.ndarray, weights: np.ndarray) -> tuple[int, ...]:
    """Round each boundary but the last up to a multiple of 16 (else 8) where that adds at most
    ROUNDING_TOLERANCE padded slots: values between the old and the new boundary move down into it, the rest
    of its bucket pays a few more slots."""
    aligned = list(boundaries)
    allowed = _slots(aligned, values, weights) * (1 + ROUNDING_TOLERANCE)
    for index in range(len(aligned) - 1):
        for multiple in PREFILL_ALIGNMENTS:
            rounded = round_up(aligned[index], multiple)
            if rounded == aligned[index]:
                break
            trial = [*aligned[:index], rounded, *aligned[index + 1 :]]
            if rounded < aligned[index + 1] and _slots(trial, values, weights) <= allowed:
                aligned = trial
                break
    return tuple(aligned)


def _prefill_options(calls: _PrefillCalls, max_chunk: int, most: int) -> list[tuple[int, ...]]:
    length = np.minimum(calls.length, max_chunk)
    candidates = np.minimum(_coarsen(length), max_chunk)
    return [
        _align(b, length, calls.count) for b in _optimal_boundaries(candidates, calls.count, max_chunk, most)
    ]


def _decode_options(trace: _Trace, max_num_seqs: int, most: int) -> list[tuple[int, ...]]:
    """Decode batch sets fitted to the declared load, each with a bucket of 1 as well: traffic is never only
    the declared concurrency, and a lone request should not pay a full batch on every token."""
    calls = trace.decode
    weights = calls.count * calls.repeat  # every call pays its bucket in rows
    options = {tuple(sorted({1, *b})) for b in _optimal_boundaries(calls.rows, weights, max_num_seqs, most)}
    return sorted(options)


def _context_boundaries(
    needs: np.ndarray, weights: np.ndarray, step: int, max_context: int, most: int
) -> list[tuple[int, ...]]:
    needs = np.minimum(-(-_coarsen(needs) // step) * step, max_context)
    return [tuple(b) for b in _optimal_boundaries(needs, weights, max_context, most)]


def _prefill_context_options(
    calls: _PrefillCalls, block_size: int, max_context: int, most: int
) -> list[tuple[int, ...]]:
    """Context sets for the calls' contexts, weighted by their tokens (each attends over the bucket), in
    whole blocks (context buckets are multiples of the block size)."""
    return _context_boundaries(calls.context, calls.length * calls.count, block_size, max_context, most)


def _decode_context_options(
    trace: _Trace, page_tokens: int, max_context: int, most: int
) -> list[tuple[int, ...]]:
    """Decode context sets for the rows' average contexts, weighted by rows, in whole decode pages (a
    bucket between two page counts reads as many pages as the one below it)."""
    decode = trace.decode
    # A run of decode calls needs its rows' average context, which grows by one a call: spread its weight
    # over average, average + 1, ... with a difference array.
    average = np.minimum(-(-decode.context_sum // decode.rows), max_context)
    spread = np.zeros(max_context + 2)
    np.add.at(spread, average, decode.rows * decode.count)
    np.add.at(spread, np.minimum(average + decode.repeat, max_context + 1), -decode.rows * decode.count)
    weight = np.cumsum(spread)[: max_context + 1]
    needs = np.flatnonzero(weight > 0.5)
    return _context_boundaries(needs, weight[needs], page_tokens, max_context, most)


# ---- the search --------------------------------------------------------------------------------------


def _better(key: tuple[float, int], than: tuple[float, int]) -> bool:
    """A clearly shorter time wins; within TIME_TIE of each other, fewer graphs win."""
    (time, graphs), (best_time, best_graphs) = key, than
    if abs(time - best_time) <= TIME_TIE * best_time:
        return graphs < best_graphs or (graphs == best_graphs and time < best_time)
    return time < best_time


def _fastest_by_graphs(candidates: Iterable[tuple[float, int, Any]]) -> dict[int, tuple[float, Any]]:
    """For each graph count, the fastest (time, choice) among (time, graphs, choice) candidates."""
    fastest: dict[int, tuple[float, Any]] = {}
    for time, graphs, choice in candidates:
        if graphs not in fastest or time < fastest[graphs][0]:
            fastest[graphs] = (time, choice)
    return fastest


def auto_buckets(
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    graph_budget: int = 24,
    seed: int = 0,
    mixed_calls: bool = False,
    costs: CallCosts = CallCosts(),
) -> BucketConfig:
    """The bucket set with the least estimated time (by `costs`) for a simulated run of `traffic`, within
    `graph_budget` graphs. Decode calls get context buckets of their own where theirs differ.

    The largest bucket of each dimension is the engine limit (min(max_num_batched_tokens, max_model_len)
    tokens, max_num_seqs rows, max_model_len rounded up to the block size), so no chunk or decode step is ever
    split, and the result always passes `validate_buckets` for the same limits. Deterministic for a `seed`.
    Raises ValueError if even one bucket per dimension needs more than `graph_budget` graphs. With
    `mixed_calls`, the budget also covers the mixed calls the set gets by default (`light_load_batches`).
    """
    limits = dict(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    _check_limits(**limits, block_size=block_size)
    max_chunk = min(max_num_batched_tokens, max_model_len)
    max_context = round_up(max_model_len, block_size)
    page_tokens = decode_page_tokens(block_size)

    def graphs_of(buckets: BucketConfig) -> int:
        if not mixed_calls:
            return buckets.num_graphs
        mixed_batch = light_load_batches(buckets.decode_batch, max_num_seqs)
        return buckets.num_graphs + mixed_graphs(buckets, mixed_batch)

    minimal = BucketConfig((max_chunk,), (max_num_seqs,), (max_context,), page_tokens)
    if graphs_of(minimal) > graph_budget:
        raise ValueError(
            f"graph_budget={graph_budget} is below the smallest bucket set ({minimal.describe()}"
            f"{' and its mixed calls' if mixed_calls else ''}): "
            f"raise graph_budget to at least {graphs_of(minimal)}"
        )
    trace = _trace(traffic, **limits, num_requests=FIT_REQUESTS, seed=seed)
    # Every candidate's largest buckets are the engine limits, so the calls are the same for all of them.
    prefill_calls = _prefill_calls(trace.prefill, max_chunk, max_context, block_size)
    most = graph_budget - 1  # buckets in one dimension: the other phase needs a graph too

    def prefill_candidates() -> Iterator[tuple[float, int, tuple[tuple[int, ...], tuple[int, ...]]]]:
        for tokens, contexts in itertools.product(
            _prefill_options(prefill_calls, max_chunk, most),
            _prefill_context_options(prefill_calls, block_size, max_context, most),
        ):
            if len(tokens) >= graph_budget:  # each prefill bucket has >= 1 graph; decode needs one too
                continue
            half = BucketConfig(tokens, (max_num_seqs,), contexts, page_tokens)
            graphs = len(half.prefill_shapes())
            if graphs < graph_budget:
                yield _prefill_figures(half, prefill_calls, costs)["prefill_ms"], graphs, (tokens, contexts)

    def decode_candidates() -> Iterator[tuple[float, int, tuple[tuple[int, ...], tuple[int, ...]]]]:
        for batch, contexts in itertools.product(
            _decode_options(trace, max_num_seqs, most),
            _decode_context_options(trace, page_tokens, max_context, most),
        ):
            if len(batch) * len(contexts) >= graph_budget:  # the contexts are distinct page counts
                continue
            half = BucketConfig(
                (max_chunk,), batch, (max_context,), page_tokens, decode_context_tokens=contexts
            )
            graphs = len(half.decode_shapes())
            if mixed_calls:
                graphs += mixed_graphs(half, light_load_batches(batch, max_num_seqs))
            if graphs < graph_budget:
                yield _decode_figures(half, trace, costs)["decode_ms"], graphs, (batch, contexts)

    prefill_halves, decode_halves = (
        _fastest_by_graphs(prefill_candidates()),
        _fastest_by_graphs(decode_candidates()),
    )
    best, best_key = minimal, None
    for (prefill_graphs, (prefill_ms, prefill)), (decode_graphs, (decode_ms, decode)) in itertools.product(
        sorted(prefill_halves.items()), sorted(decode_halves.items())
    ):
        if prefill_graphs + decode_graphs > graph_budget:
            continue
        key = (prefill_ms + decode_ms, prefill_graphs + decode_graphs)
        if best_key is None or _better(key, best_key):
            (tokens, contexts), (batch, decode_contexts) = prefill, decode
            # Decode contexts that read the same pages as the context buckets are no setting of their own.
            own = BucketConfig(tokens, batch, contexts, page_tokens, decode_context_tokens=decode_contexts)
            shared = replace(own, decode_context_tokens=())
            best = shared if shared.decode_contexts() == own.decode_contexts() else own
            best_key = key
    validate_buckets(best, **limits, block_size=block_size)
    return best
