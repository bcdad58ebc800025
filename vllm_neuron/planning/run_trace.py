"""A simulated run recorded before bucketing, and its calls and their estimated time under a bucket set,
computed for many bucket sets at once with numpy. Pure Python and numpy, no torch.

vLLM's scheduler never sees the buckets, so the same steps happen whatever the bucket set, and one run can be
bucketed many ways: that is what makes the bucket search cheap. Each step becomes calls as `calls.plan_step`
makes them, whose rules this module applies in bulk: decode rows in calls of at most the largest batch bucket,
the step's first chunk of at most `mixed_chunk_bucket` tokens riding in a decode call whose batch bucket has
mixed calls (one mixed call), a request's first chunk alone in a fresh call where its bucket has a fresh graph
(`calls.fresh_calls`), the other chunks packed by `buckets.pack_prefill`. Identical calls are stored once with
a count, so a long decode-heavy run stays small. tests/unit/test_bucket_policy.py checks the bulk figures
against `plan_step` and `CallCosts.of` step by step."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_neuron.buckets import BucketConfig, BucketError, ceil_div, pack_prefill
from vllm_neuron.call_costs import CallCosts
from vllm_neuron.calls import fresh_calls, fresh_pairs
from vllm_neuron.planning.step_simulation import SimulatedStep


@dataclass(frozen=True)
class PrefillChunks:
    """Every prefill chunk as scheduled (more than one token; a 1-token chunk runs as a decode row), in step
    order. `rider`: for the chunk that rides in a mixed call where its step's decode calls have one, the
    index of its step in `DecodeSteps`; -1 for the others."""

    step: np.ndarray
    length: np.ndarray  # tokens
    start: np.ndarray  # tokens already in the cache
    rider: np.ndarray


@dataclass(frozen=True)
class PrefillCalls:
    """Distinct prefill calls: one or more chunks packed in one row of queries."""

    length: np.ndarray  # tokens
    context: np.ndarray  # KV positions the call attends over: its chunks' contexts, each in whole blocks;
    # 0: a fresh call, over its own keys
    attention: np.ndarray  # causal attention work of its real tokens: a token at position p reads p + 1 keys
    count: np.ndarray  # how many such calls ran


@dataclass(frozen=True)
class DecodeSteps:
    """Every step with decode rows, as run: `repeat` consecutive steps of the same rows whose contexts
    (position + 1, batch order) are `contexts[offset : offset + size]` at the first and grow by one a step.
    `rider_tokens`, `rider_work`: the tokens and causal attention work of the chunk that may ride along
    (0 where none may: such steps have a repeat of 1)."""

    contexts: np.ndarray
    size: np.ndarray
    repeat: np.ndarray
    rider_tokens: np.ndarray
    rider_work: np.ndarray


@dataclass(frozen=True)
class DecodeCalls:
    """Distinct runs of decode (or mixed) calls: `repeat` consecutive calls of `rows` rows whose contexts
    sum to `context_sum` at the first call and `rows` more at each next; `count` such runs."""

    rows: np.ndarray
    context_sum: np.ndarray
    repeat: np.ndarray
    count: np.ndarray


@dataclass(frozen=True)
class Trace:
    prefill: PrefillChunks
    decode_steps: DecodeSteps
    decode: DecodeCalls  # decode_steps in calls of at most max_num_seqs rows, the usual case
    mixed_chunk_bucket: int  # the largest chunk that rides in a mixed call (0: none)


def causal_work(length: int, start: int) -> int:
    """Keys read by the real tokens of a chunk: the token at position p reads p + 1."""
    return length * start + length * (length + 1) // 2


def record(steps: Iterable[SimulatedStep], *, max_num_seqs: int, mixed_chunk_bucket: int) -> Trace:
    """The trace of a run's steps (`step_simulation.traffic_steps`), for mixed calls of chunks of at most
    `mixed_chunk_bucket` tokens (0: no mixed calls)."""
    chunks: list[tuple[int, int, int, int]] = []  # (step, length, start, rider) of every prefill chunk
    contexts: list[int] = []
    decode: list[tuple[int, int, int, int]] = []  # (size, repeat, rider tokens, rider work) of each step
    for number, step in enumerate(steps):
        rider = None
        if step.decode_contexts:
            # plan_step's rider: the first chunk short enough to ride with the step's decode rows.
            rider = next((i for i, (_, n) in enumerate(step.chunks) if n <= mixed_chunk_bucket), None)
            start, length = step.chunks[rider] if rider is not None else (0, 0)
            contexts += step.decode_contexts
            decode.append((len(step.decode_contexts), step.repeat, length, causal_work(length, start)))
        chunks += [
            (number, length, start, len(decode) - 1 if index == rider else -1)
            for index, (start, length) in enumerate(step.chunks)
        ]
    size, repeat, rider_tokens, rider_work = np.asarray(decode, np.int64).reshape(-1, 4).T
    decode_steps = DecodeSteps(np.asarray(contexts, np.int64), size, repeat, rider_tokens, rider_work)
    step, length, start, rider = np.asarray(chunks, np.int64).reshape(-1, 4).T
    return Trace(
        PrefillChunks(step, length, start, rider),
        decode_steps,
        decode_calls(decode_steps, max_num_seqs),
        mixed_chunk_bucket,
    )


def pick(buckets: Sequence[int], sizes: np.ndarray, what: str) -> np.ndarray:
    """`buckets.pick_bucket` for many sizes at once: the smallest bucket holding each."""
    values = np.asarray(buckets, np.int64)
    if len(sizes) and sizes.max() > values[-1]:
        raise BucketError(
            f"{what} {int(sizes.max())} exceeds the largest bucket {values[-1]} of {list(buckets)}"
        )
    return values[np.searchsorted(values, sizes, side="left")]


def mixed_steps(
    trace: Trace,
    decode_batch_buckets: Sequence[int],
    mixed_batch_buckets: Sequence[int],
    mixed_chunk_bucket: int,
) -> np.ndarray:
    """Which decode steps run their rider in a mixed call: one of the step's decode calls (full calls of
    the largest batch bucket, then the rest) has a batch bucket with mixed calls."""
    steps = trace.decode_steps
    if not mixed_chunk_bucket or not mixed_batch_buckets:
        return np.zeros(len(steps.size), bool)
    if mixed_chunk_bucket != trace.mixed_chunk_bucket:
        raise ValueError(
            f"mixed calls of {mixed_chunk_bucket} tokens on a trace of "
            f"{trace.mixed_chunk_bucket}-token riders"
        )
    largest = decode_batch_buckets[-1]
    rest = steps.size % largest
    has_mixed = (steps.size >= largest) & (largest in mixed_batch_buckets)
    has_mixed |= (rest > 0) & np.isin(
        pick(decode_batch_buckets, rest, "decode batch of"), mixed_batch_buckets
    )
    return (steps.rider_tokens > 0) & has_mixed


def prefill_calls(
    trace: Trace,
    mixed: np.ndarray,
    largest_tokens: int,
    largest_context: int,
    block_size: int,
    fresh: Sequence[int] = (),
    prefill_buckets: Sequence[int] = (),
) -> PrefillCalls:
    """The prefill calls of the run: each step's chunks but those riding in mixed calls (`mixed`, per
    decode step), the first chunks of requests in fresh calls where their bucket of `prefill_buckets` is one
    of `fresh`, the others packed by `pack_prefill`."""
    chunks = trace.prefill
    kept = np.ones(len(chunks.step), bool)
    if mixed.any():
        kept = (chunks.rider < 0) | ~mixed[np.maximum(chunks.rider, 0)]
    step, start, length = chunks.step[kept], chunks.start[kept], chunks.length[kept]
    calls: list[tuple[int, int, int]] = []  # (tokens, context, attention)
    boundaries = np.flatnonzero(np.diff(step)) + 1
    for parts in np.split(np.stack((start, length), axis=1), boundaries):
        chunks = [(index, s, n) for index, (s, n) in enumerate(parts.tolist())]
        for plan in fresh_calls(chunks, set(fresh), prefill_buckets) if fresh else ():
            calls.append((plan.call.tokens, 0, causal_work(plan.call.tokens, 0)))
        packed = [(s, n) for _, s, n in chunks]
        for call in pack_prefill(packed, largest_tokens, largest_context, block_size):
            attention = sum(causal_work(n, s) for _, s, n in call.parts)
            calls.append((call.tokens, call.context, attention))
    if not calls:
        empty = np.zeros(0, np.int64)
        return PrefillCalls(empty, empty, empty, empty)
    distinct, count = np.unique(np.asarray(calls, np.int64), axis=0, return_counts=True)
    return PrefillCalls(distinct[:, 0], distinct[:, 1], distinct[:, 2], count.astype(np.int64))


def decode_calls(steps: DecodeSteps, group: int) -> DecodeCalls:
    """The decode calls of `steps` when a step's rows are cut into calls of at most `group` rows in batch
    order, as the runner does with its largest decode bucket."""
    if not len(steps.size):
        empty = np.zeros(0, np.int64)
        return DecodeCalls(empty, empty, empty, empty)
    first_row = np.concatenate(([0], np.cumsum(steps.size)[:-1]))
    position = np.arange(len(steps.contexts)) - np.repeat(first_row, steps.size)
    starts = np.flatnonzero(position % group == 0)  # where each call's rows begin
    rows = np.diff(np.append(starts, len(steps.contexts)))
    summed = np.add.reduceat(steps.contexts, starts)
    repeat = np.repeat(steps.repeat, ceil_div(steps.size, group))
    # Merge identical (rows, summed, repeat) runs: the key packs the three into one integer.
    key = (rows * (summed.max() + 1) + summed) * (repeat.max() + 1) + repeat
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return DecodeCalls(
        rows=rows[first], context_sum=summed[first], repeat=repeat[first], count=np.bincount(inverse)
    )


def _decode_context_sums(buckets: BucketConfig, batch: np.ndarray, calls: DecodeCalls) -> np.ndarray:
    """Per run, the KV positions its calls attend over: a decode call of `batch` rows attends over
    batch x (the pages of its context bucket), and takes the smallest bucket whose pages hold the rows'
    summed context, that is an average of ceil(summed / batch) per row. (The runner rounds each row up to
    whole pages; the model rounds the sum, which keeps runs mergeable and differs by under a page a row.)"""
    contexts = buckets.decode_contexts()
    capacity = np.asarray(
        [ceil_div(c, buckets.page_tokens) * buckets.page_tokens for c in contexts], np.int64
    )
    last = calls.context_sum + calls.rows * (calls.repeat - 1)
    if len(last) and ceil_div(last, batch).max() > capacity[-1]:
        raise BucketError(
            f"decode context {int(ceil_div(last, batch).max())} exceeds the largest context bucket "
            f"{contexts[-1]} of {list(buckets.context_buckets)}"
        )
    # Calls k = 0 .. repeat-1 of a run need ceil((context_sum + rows * k) / batch) per row; those that fit
    # capacity c are k <= (c * batch - context_sum) // rows.
    fitting = (capacity[None, :] * batch[:, None] - calls.context_sum[:, None]) // calls.rows[:, None] + 1
    fitting = np.clip(fitting, 0, calls.repeat[:, None])
    in_bucket = np.diff(fitting, axis=1, prepend=0)
    return in_bucket @ capacity * batch


def _ratio(real: float, padded: float) -> float:
    return float(real / padded) if padded else 1.0  # a phase without calls wastes nothing


def prefill_figures(buckets: BucketConfig, calls: PrefillCalls, costs: CallCosts) -> dict[str, float]:
    """Real and padded work and estimated time of the prefill calls."""
    tokens = pick(buckets.prefill_buckets, calls.length, "prefill call of")
    fresh = calls.context == 0
    context = pick(buckets.context_buckets, np.where(fresh, 1, calls.context), "prefill context")
    count = int(calls.count.sum())
    slots = (calls.count * tokens).sum()
    pairs = (calls.count * np.where(fresh, fresh_pairs(tokens), tokens * context)).sum()
    return {
        "prefill_calls": count,
        "prefill_tokens": float((calls.count * calls.length).sum()),
        "prefill_slots": float(slots),
        "prefill_attention": float((calls.count * calls.attention).sum()),
        "prefill_pairs": float(pairs),
        "prefill_ms": float(costs.call * count + costs.token * slots + costs.attention * pairs),
    }


def decode_figures(
    buckets: BucketConfig, trace: Trace, mixed: np.ndarray, costs: CallCosts
) -> dict[str, float]:
    """Real and padded work and estimated time of the decode calls, the mixed ones (`mixed`, per decode
    step) with their chunks."""
    decode = trace.decode
    if len(decode.rows) and decode.rows.max() > buckets.decode_batch_buckets[-1]:
        decode = decode_calls(trace.decode_steps, buckets.decode_batch_buckets[-1])
    calls = decode.count * decode.repeat
    batch = pick(buckets.decode_batch_buckets, decode.rows, "decode batch of")
    attended = (decode.count * _decode_context_sums(buckets, batch, decode)).sum()
    # Over a run the row contexts grow by `rows` a call: repeat * first + rows * (0 + 1 + ... + repeat - 1).
    per_run = decode.repeat * decode.context_sum + decode.rows * decode.repeat * (decode.repeat - 1) // 2
    slots = (calls * batch).sum()
    count = int(mixed.sum())
    chunk_slots = count * buckets.mixed_chunk_bucket
    chunk_pairs = chunk_slots * buckets.context_buckets[-1]  # a mixed call's chunk attends over the largest
    return {
        "decode_calls": int(calls.sum()) - count,
        "mixed_calls": count,
        "decode_rows": float((calls * decode.rows).sum()),
        "decode_slots": float(slots),
        "decode_real_context": float((decode.count * per_run).sum()),
        "decode_attended": float(attended),
        "mixed_tokens": float(trace.decode_steps.rider_tokens[mixed].sum()),
        "mixed_slots": float(chunk_slots),
        "mixed_attention": float(trace.decode_steps.rider_work[mixed].sum()),
        "mixed_pairs": float(chunk_pairs),
        "decode_ms": float(
            costs.call * calls.sum()
            + costs.row * slots
            + costs.kv_position * attended
            + costs.token * chunk_slots
            + costs.attention * chunk_pairs
        ),
    }


def evaluate(
    buckets: BucketConfig, trace: Trace, block_size: int, costs: CallCosts
) -> dict[str, float | int]:
    """The figures `bucket_policy.simulate` returns, for a recorded run."""
    mixed = mixed_steps(
        trace, buckets.decode_batch_buckets, buckets.mixed_batch_buckets, buckets.mixed_chunk_bucket
    )
    prefill = prefill_figures(
        buckets,
        prefill_calls(
            trace,
            mixed,
            buckets.prefill_buckets[-1],
            buckets.context_buckets[-1],
            block_size,
            buckets.fresh_buckets,
            buckets.prefill_buckets,
        ),
        costs,
    )
    decode = decode_figures(buckets, trace, mixed, costs)
    return {
        "prefill": _ratio(
            prefill["prefill_tokens"] + decode["mixed_tokens"],
            prefill["prefill_slots"] + decode["mixed_slots"],
        ),
        "decode": _ratio(decode["decode_rows"], decode["decode_slots"]),
        "prefill_context": _ratio(
            prefill["prefill_attention"] + decode["mixed_attention"],
            prefill["prefill_pairs"] + decode["mixed_pairs"],
        ),
        "decode_context": _ratio(decode["decode_real_context"], decode["decode_attended"]),
        "prefill_calls": prefill["prefill_calls"],
        "decode_calls": decode["decode_calls"],
        "mixed_calls": decode["mixed_calls"],
        "prefill_ms": prefill["prefill_ms"],
        "decode_ms": decode["decode_ms"],
        "graphs": buckets.num_graphs,
    }
