"""Automatic bucket policy: the bucket set with the least estimated serving time for a declared traffic shape,
within a graph budget. Pure Python and numpy, no torch.

Every bucket shape is a compiled graph (minutes each on Trainium) and every call is padded up to a bucket, so
a bucket set trades padding (compute wasted on every step) against graph count (warm-up time, graph memory).
The right trade depends on the traffic: short prompts want small prefill buckets, a server kept full wants
decode buckets just below max_num_seqs. The steps come from `step_simulation` (the plugin's scheduler on a
`traffic.TrafficShape`), their calls and estimated time under a bucket set from `run_trace`, by `CallCosts`
(`call_costs`). This module

- measures a bucket set on a simulated run (`simulate`), and
- searches for the best set (`auto_buckets`): optimal 1-D bucketing of each dimension by dynamic programming,
  then a search over how many buckets each dimension gets, every candidate costed on the same simulated run.
  Prefill calls depend on the prefill token and context buckets, decode and mixed calls on the decode batch
  and decode context buckets; the decode batch buckets decide which steps' chunks ride in mixed calls, and so
  which chunks are left to prefill calls. So the two halves are searched apart, for each such choice of
  mixed steps, and joined under the budget.
"""

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from vllm_neuron.buckets import (
    BucketConfig,
    ceil_div,
    decode_page_tokens,
    light_load_batches,
    round_up,
    validate_buckets,
)
from vllm_neuron.call_costs import CallCosts
from vllm_neuron.planning.run_trace import (
    PrefillCalls,
    Trace,
    decode_figures,
    evaluate,
    mixed_steps,
    pick,
    prefill_calls,
    prefill_figures,
    record,
)
from vllm_neuron.planning.step_simulation import traffic_steps
from vllm_neuron.planning.traffic import TrafficShape

# Prefill boundaries are rounded up to these multiples (tried in order) where that costs at most
# ROUNDING_TOLERANCE more token slots: hardware tiles and DMA prefer aligned sizes.
PREFILL_ALIGNMENTS = (16, 8)
ROUNDING_TOLERANCE = 0.005
# Candidate times closer than this fraction are a tie, and a tie goes to fewer graphs (shorter warm-up).
TIME_TIE = 1e-3
# Requests in the simulated run auto_buckets fits to: more than simulate's default, so the boundaries follow
# the traffic's distribution rather than one small sample of it.
FIT_REQUESTS = 1600


def _check_limits(**limits: int) -> None:
    for name, value in limits.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_share(share: int) -> None:
    if not isinstance(share, int) or isinstance(share, bool) or share < 0:
        raise ValueError(f"prefill_tokens_while_decoding must be a non-negative integer, got {share!r}")


def simulated_run(
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    prefill_tokens_while_decoding: int,
    mixed_chunk_bucket: int,
    num_requests: int,
    seed: int,
) -> Trace:
    """The recorded run of `traffic` that `simulate` and `auto_buckets` bucket."""
    steps = traffic_steps(
        traffic,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_tokens_while_decoding=prefill_tokens_while_decoding,
        num_requests=num_requests,
        seed=seed,
    )
    return record(steps, max_num_seqs=max_num_seqs, mixed_chunk_bucket=mixed_chunk_bucket)


def simulate(
    buckets: BucketConfig,
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    costs: CallCosts,
    num_requests: int = 400,
    seed: int = 0,
    block_size: int = 32,
) -> dict[str, float | int]:
    """Padding efficiency and estimated time of `buckets` (with their mixed calls, if any) under `traffic`,
    from a deterministic simulation of the plugin's scheduler (same arguments, same result) until
    `num_requests` requests have finished. The scheduler's prefill share under light load is the buckets'
    `prefill_tokens_while_decoding` (0: vLLM's whole budget every step); a bucket set with mixed calls takes
    chunks of that size along. `block_size` is the KV block size (the plugin's default 32): packed prefill
    chunks take whole blocks.

    Returns
    - `prefill`: real prefill tokens / token-bucket slots computed (mixed calls' chunks included);
    - `decode`: real decode rows / batch-bucket slots computed (mixed calls' rows included);
    - `prefill_context`: causal attention work of the real chunk tokens / (token bucket x context bucket);
    - `decode_context`: summed real row contexts / KV positions attended (batch bucket x the pages of
      the context bucket: see `run_trace`);
    - `prefill_calls`, `decode_calls`, `mixed_calls`: compiled calls of each phase; `graphs`:
      `buckets.num_graphs`;
    - `prefill_ms`: the prefill calls' estimated time by `costs`; `decode_ms`: the decode and mixed calls'.
    An efficiency is 1.0 where a phase made no calls. Raises BucketError if a call fits no bucket.
    """
    limits = dict(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    _check_limits(**limits, block_size=block_size)
    _check_share(buckets.prefill_tokens_while_decoding)
    trace = simulated_run(
        traffic,
        **limits,
        prefill_tokens_while_decoding=buckets.prefill_tokens_while_decoding,
        mixed_chunk_bucket=buckets.mixed_chunk_bucket,
        num_requests=num_requests,
        seed=seed,
    )
    return evaluate(buckets, trace, block_size, costs)


# ---- optimal 1-D bucketing ---------------------------------------------------------------------------


def optimal_boundaries(values: np.ndarray, weights: np.ndarray, top: int, most: int) -> list[list[int]]:
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
    return ceil_div(values, granule) * granule


def _slots(boundaries: Sequence[int], values: np.ndarray, weights: np.ndarray) -> float:
    return float((pick(boundaries, values, "value") * weights).sum())


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


def prefill_options(calls: PrefillCalls, max_chunk: int, most: int) -> list[tuple[int, ...]]:
    """Prefill token sets of 1..`most` buckets, each the least padding for the calls' lengths, aligned."""
    length = np.minimum(calls.length, max_chunk)
    candidates = np.minimum(_coarsen(length), max_chunk)
    return [
        _align(b, length, calls.count) for b in optimal_boundaries(candidates, calls.count, max_chunk, most)
    ]


def decode_options(trace: Trace, max_num_seqs: int, most: int) -> list[tuple[int, ...]]:
    """Decode batch sets fitted to the declared load, each with a bucket of 1 as well: traffic is never only
    the declared concurrency, and a lone request should not pay a full batch on every token."""
    calls = trace.decode
    weights = calls.count * calls.repeat  # every call pays its bucket in rows
    options = {tuple(sorted({1, *b})) for b in optimal_boundaries(calls.rows, weights, max_num_seqs, most)}
    return sorted(options)


def _context_boundaries(
    needs: np.ndarray, weights: np.ndarray, step: int, max_context: int, most: int
) -> list[tuple[int, ...]]:
    needs = np.minimum(ceil_div(_coarsen(needs), step) * step, max_context)
    return [tuple(b) for b in optimal_boundaries(needs, weights, max_context, most)]


def prefill_context_options(
    calls: PrefillCalls, block_size: int, max_context: int, most: int
) -> list[tuple[int, ...]]:
    """Context sets for the calls' contexts, weighted by their tokens (each attends over the bucket), in
    whole blocks (context buckets are multiples of the block size)."""
    return _context_boundaries(calls.context, calls.length * calls.count, block_size, max_context, most)


def decode_context_options(
    trace: Trace, page_tokens: int, max_context: int, most: int
) -> list[tuple[int, ...]]:
    """Decode context sets for the rows' average contexts, weighted by rows, in whole decode pages (a
    bucket between two page counts reads as many pages as the one below it)."""
    decode = trace.decode
    # A run of decode calls needs its rows' average context, which grows by one a call: spread its weight
    # over average, average + 1, ... with a difference array.
    average = np.minimum(ceil_div(decode.context_sum, decode.rows), max_context)
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


# A half of a bucket set: (prefill tokens, contexts) or (decode batch, decode contexts)
Half = tuple[tuple[int, ...], tuple[int, ...]]


def _joined(
    prefill_halves: dict[int, tuple[float, Half]], decode_halves: dict[int, tuple[float, Half]], budget: int
) -> Iterator[tuple[tuple[float, int], tuple[Half, Half]]]:
    """((time, graphs), (prefill half, decode half)) of every pair of halves that fits the budget."""
    for (prefill_graphs, (prefill_ms, prefill)), (decode_graphs, (decode_ms, decode)) in itertools.product(
        sorted(prefill_halves.items()), sorted(decode_halves.items())
    ):
        if prefill_graphs + decode_graphs <= budget:
            yield (prefill_ms + decode_ms, prefill_graphs + decode_graphs), (prefill, decode)


def auto_buckets(
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    prefill_tokens_while_decoding: int,
    costs: CallCosts,
    graph_budget: int = 24,
    seed: int = 0,
    mixed_calls: bool = False,
) -> BucketConfig:
    """The bucket set with the least estimated time (by `costs`) for a simulated run of `traffic` under the
    scheduler's prefill share `prefill_tokens_while_decoding`, within `graph_budget` graphs. Decode calls
    get context buckets of their own where theirs differ.

    The largest bucket of each dimension is the engine limit (min(max_num_batched_tokens, max_model_len)
    tokens, max_num_seqs rows, max_model_len rounded up to the block size), so no chunk or decode step is ever
    split, and the result always passes `validate_buckets` for the same limits. Deterministic for a `seed`.
    Raises ValueError if even one bucket per dimension needs more than `graph_budget` graphs. The set
    carries the prefill share; with `mixed_calls` it gets the mixed calls the server gives it by default
    (chunks of the share, for the batch buckets of `light_load_batches`), and the budget covers them.
    """
    limits = dict(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    _check_limits(**limits, block_size=block_size)
    _check_share(prefill_tokens_while_decoding)
    if mixed_calls and not prefill_tokens_while_decoding:
        raise ValueError(
            "mixed calls carry the capped prefill chunk: they need prefill_tokens_while_decoding"
        )
    max_chunk = min(max_num_batched_tokens, max_model_len)
    max_context = round_up(max_model_len, block_size)
    page_tokens = decode_page_tokens(block_size)
    chunk_bucket = prefill_tokens_while_decoding if mixed_calls else 0

    def mixed_batch_of(batch: tuple[int, ...]) -> tuple[int, ...]:
        return light_load_batches(batch, max_num_seqs) if mixed_calls else ()

    def with_mixed(buckets: BucketConfig) -> BucketConfig:
        """The set with the prefill share, and its mixed calls where it gets them."""
        return replace(
            buckets,
            prefill_tokens_while_decoding=prefill_tokens_while_decoding,
            mixed_batch_buckets=mixed_batch_of(buckets.decode_batch_buckets),
        )

    minimal = with_mixed(BucketConfig((max_chunk,), (max_num_seqs,), (max_context,), page_tokens))
    if minimal.num_graphs > graph_budget:
        raise ValueError(
            f"graph_budget={graph_budget} is below the smallest bucket set ({minimal.describe()}): "
            f"raise graph_budget to at least {minimal.num_graphs}"
        )
    trace = simulated_run(
        traffic,
        **limits,
        prefill_tokens_while_decoding=prefill_tokens_while_decoding,
        mixed_chunk_bucket=chunk_bucket,
        num_requests=FIT_REQUESTS,
        seed=seed,
    )
    most = graph_budget - 1  # buckets in one dimension: the other phase needs a graph too
    # Which steps' chunks ride in mixed calls depends on the decode batch buckets only, and decides which
    # chunks are left to prefill calls: the halves are searched and joined for each such choice.
    groups: dict[bytes, tuple[np.ndarray, list[tuple[int, ...]]]] = {}
    for batch in decode_options(trace, max_num_seqs, most):
        mixed = mixed_steps(trace, batch, mixed_batch_of(batch), chunk_bucket)
        groups.setdefault(mixed.tobytes(), (mixed, []))[1].append(batch)
    decode_context_sets = decode_context_options(trace, page_tokens, max_context, most)

    def prefill_candidates(mixed: np.ndarray) -> Iterator[tuple[float, int, Half]]:
        calls = prefill_calls(trace, mixed, max_chunk, max_context, block_size)
        for tokens, contexts in itertools.product(
            prefill_options(calls, max_chunk, most),
            prefill_context_options(calls, block_size, max_context, most),
        ):
            if len(tokens) >= graph_budget:  # each prefill bucket has >= 1 graph; decode needs one too
                continue
            half = BucketConfig(tokens, (max_num_seqs,), contexts, page_tokens)
            graphs = len(half.prefill_shapes())
            if graphs < graph_budget:
                yield prefill_figures(half, calls, costs)["prefill_ms"], graphs, (tokens, contexts)

    def decode_candidates(
        mixed: np.ndarray, batches: list[tuple[int, ...]]
    ) -> Iterator[tuple[float, int, Half]]:
        for batch, contexts in itertools.product(batches, decode_context_sets):
            if len(batch) * len(contexts) >= graph_budget:  # the contexts are distinct page counts
                continue
            half = with_mixed(
                BucketConfig(
                    (max_chunk,), batch, (max_context,), page_tokens, decode_context_buckets=contexts
                )
            )
            graphs = len(half.decode_shapes()) + len(half.mixed_shapes())
            if graphs < graph_budget:
                yield decode_figures(half, trace, mixed, costs)["decode_ms"], graphs, (batch, contexts)

    best, best_key = minimal, None
    for mixed, batches in groups.values():
        prefill_halves = _fastest_by_graphs(prefill_candidates(mixed))
        decode_halves = _fastest_by_graphs(decode_candidates(mixed, batches))
        for key, ((tokens, contexts), (batch, decode_contexts)) in _joined(
            prefill_halves, decode_halves, graph_budget
        ):
            if best_key is None or _better(key, best_key):
                # Decode contexts that read the same pages as the context buckets are no setting of their own.
                own = BucketConfig(
                    tokens, batch, contexts, page_tokens, decode_context_buckets=decode_contexts
                )
                shared = replace(own, decode_context_buckets=())
                best = with_mixed(shared if shared.decode_contexts() == own.decode_contexts() else own)
                best_key = key
    validate_buckets(best, **limits, block_size=block_size)
    return best
