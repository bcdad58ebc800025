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
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_neuron.buckets import BucketConfig, BucketError, round_up, validate_buckets

# Prefill boundaries are rounded up to these multiples (tried in order) when that costs at most
# ROUNDING_TOLERANCE more token slots: hardware tiles and DMA like aligned sizes.
PREFILL_ALIGNMENTS = (16, 8)
ROUNDING_TOLERANCE = 0.005
# Weight of attention efficiency (prefill_context + decode_context) next to token and batch efficiency in the
# score auto_buckets maximises.
CONTEXT_WEIGHT = 0.5
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
            raise ValueError(
                f"traffic must be an object with prompt_len, output_len, concurrency; got {config!r}"
            )
        expected = {"prompt_len", "output_len", "concurrency"}
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


# ---- the step simulator ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _DecodeBlock:
    """`steps` consecutive decode steps of the same rows: row contexts (position + 1, in batch order) at the
    first step, each one longer at every following step."""

    contexts: np.ndarray
    steps: int


@dataclass(frozen=True)
class _Trace:
    """The model calls of a simulated run before bucketing. They do not depend on the buckets (vLLM's
    scheduler never sees them), so one trace can be bucketed many ways: that is what makes the search cheap.
    """

    prefill_len: np.ndarray  # tokens of each prefill chunk (> 1; a 1-token chunk runs as a decode row)
    prefill_start: np.ndarray  # the chunk's first position
    decode_blocks: tuple[_DecodeBlock, ...]
    decode_rows: np.ndarray  # per step with decode rows: how many
    decode_max_context: np.ndarray  # ... the longest row context
    decode_sum_context: np.ndarray  # ... the summed row contexts


def _expand(blocks: Sequence[_DecodeBlock], group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, longest context, summed contexts) per decode call when a step's rows are cut into calls of at
    most `group` rows in batch order, as the runner does."""
    rows: list[np.ndarray] = []
    longest: list[np.ndarray] = []
    summed: list[np.ndarray] = []
    for block in blocks:
        later = np.arange(block.steps, dtype=np.int64)
        for first in range(0, len(block.contexts), group):
            part = block.contexts[first : first + group]
            rows.append(np.full(block.steps, len(part), np.int64))
            longest.append(part.max() + later)
            summed.append(part.sum() + len(part) * later)
    if not rows:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    return np.concatenate(rows), np.concatenate(longest), np.concatenate(summed)


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
    """Run the scheduler model until `num_requests` requests finished.

    Clients keep `traffic.concurrency` requests in flight: a finished request is replaced at once, so the
    trace is the steady state (after the start-up burst) without a drain tail of shrinking batches that a
    server under constant load never sees. Each step, like vLLM's v1 scheduler with chunked prefill:
    running requests that are decoding get 1 token each, then requests part-way through their prompt get
    the next chunk, then waiting requests are admitted while fewer than max_num_seqs run, their prompt
    chunked to what is left of the token budget. The KV cache is assumed large enough (no preemption).
    """
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
    prefill_len: list[int] = []
    prefill_start: list[int] = []
    blocks: list[_DecodeBlock] = []

    while finished < num_requests:
        steps = _decode_only_steps(running, waiting, computed, prompts, generated, outputs, max_num_seqs)
        if steps and len(running) <= max_num_batched_tokens:
            # Nothing can change until the next request finishes: skip to it in one go (decode-heavy
            # traffic would otherwise cost one Python iteration per step).
            blocks.append(_DecodeBlock(np.asarray([computed[r] + 1 for r in running], np.int64), steps))
            scheduled = [(r, steps) for r in running]
        else:
            scheduled = _schedule(running, waiting, computed, prompts, max_num_seqs, max_num_batched_tokens)
            # Map to calls as the runner does: every 1-token request is a decode row, the rest prefill calls.
            rows = [computed[r] + 1 for r, count in scheduled if count == 1]
            if rows:
                blocks.append(_DecodeBlock(np.asarray(rows, np.int64), 1))
            for request, count in scheduled:
                if count > 1:
                    prefill_len.append(count)
                    prefill_start.append(computed[request])

        for request, count in scheduled:
            was_decoding = computed[request] >= prompts[request]
            computed[request] += count
            if computed[request] >= prompts[request]:  # a token was sampled at every decode step
                generated[request] += count if was_decoding else 1
                if generated[request] >= outputs[request]:
                    running.remove(request)
                    finished += 1
                    if next_arrival < len(prompts):
                        waiting.append(next_arrival)
                        next_arrival += 1

    rows, longest, summed = _expand(blocks, max(max_num_seqs, 1))
    return _Trace(
        prefill_len=np.asarray(prefill_len, np.int64),
        prefill_start=np.asarray(prefill_start, np.int64),
        decode_blocks=tuple(blocks),
        decode_rows=rows,
        decode_max_context=longest,
        decode_sum_context=summed,
    )


def _decode_only_steps(
    running: list[int],
    waiting: deque[int],
    computed: list[int],
    prompts: list[int],
    generated: list[int],
    outputs: list[int],
    max_num_seqs: int,
) -> int:
    """How many coming steps are plain decode steps of exactly the running requests (0 if the next is not):
    every running request is past its prompt and nobody can be admitted, until the first one finishes."""
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
    """One step: (request, tokens) in batch order; admits waiting requests into `running`."""
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


def _pick(buckets: Sequence[int], sizes: np.ndarray, name: str) -> np.ndarray:
    """Vectorised `buckets.pick_bucket`: the smallest bucket holding each size."""
    values = np.asarray(buckets, np.int64)
    index = np.searchsorted(values, sizes, side="left")
    if len(sizes) and index.max() == len(values):
        raise BucketError(
            f"{name} size {int(sizes.max())} exceeds the largest bucket {values[-1]} of {list(buckets)}"
        )
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
    decode bucket is split into calls of that many rows, as in the runner."""
    if not len(trace.decode_rows) or trace.decode_rows.max() <= largest:
        return trace.decode_rows, trace.decode_max_context, trace.decode_sum_context
    return _expand(trace.decode_blocks, largest)


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
    _check_limits(max_model_len, max_num_seqs, max_num_batched_tokens)
    trace = _trace(
        traffic,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_requests=num_requests,
        seed=seed,
    )
    return _evaluate(buckets, trace)


def _check_limits(*positive: int) -> None:
    names = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size")
    for name, value in zip(names, positive, strict=False):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


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
    """What auto_buckets maximises: token and batch padding efficiency of the two phases, plus attention
    efficiency at CONTEXT_WEIGHT (without it one context bucket at max_model_len always wins, since context
    buckets multiply graphs but do not change token or batch padding)."""
    attention = float(result["prefill_context"]) + float(result["decode_context"])
    return float(result["prefill"]) + float(result["decode"]) + CONTEXT_WEIGHT * attention


def auto_buckets(
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    graph_budget: int = 24,
    seed: int = 0,
    num_requests: int = 1600,
) -> BucketConfig:
    """The bucket set with the best simulated padding efficiency for `traffic` within `graph_budget` graphs.

    The largest bucket of each dimension is the engine limit (min(max_num_batched_tokens, max_model_len)
    tokens, max_num_seqs rows, max_model_len rounded up to the block size), so no chunk or decode step is
    ever split, and the result always passes `validate_buckets` for the same limits. `num_requests` is the
    length of the simulated run the buckets are fitted to: more than `simulate`'s default so the boundaries
    follow the traffic's distribution rather than one sample of it. Deterministic for a given `seed`.
    Raises ValueError if even one bucket per dimension exceeds the budget."""
    _check_limits(max_model_len, max_num_seqs, max_num_batched_tokens, block_size)
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
            f"graph_budget={graph_budget} is below the minimal bucket set ({minimal.describe()}): "
            f"raise graph_budget to at least {minimal.num_graphs}"
        )
    trace = _trace(traffic, **limits, num_requests=num_requests, seed=seed)
    # Each dimension gets at most graph_budget - 1 buckets: the other phase needs a graph too.
    most = graph_budget - 1
    prefill_options = _prefill_options(trace, max_chunk, most)
    decode_options = _decode_options(trace, max_num_seqs, most)
    context_options = _context_options(trace, block_size, max_context, most)

    best, best_key = minimal, None
    for prefill, decode, context in itertools.product(prefill_options, decode_options, context_options):
        # A lower bound: each prefill bucket has >= 1 graph, each decode bucket one per context bucket.
        if len(prefill) + len(decode) * len(context) > graph_budget:
            continue
        candidate = BucketConfig(prefill, decode, context)
        graphs = candidate.num_graphs
        if graphs > graph_budget:
            continue
        key = (_score(_evaluate(candidate, trace)), graphs)
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


def _coarsen(values: np.ndarray) -> np.ndarray:
    """Round each value up to 1/64 of its power of two (exact below 128): candidate boundaries stay within
    1.6% of any value, the dynamic programme stays small (64 candidates per octave) and the boundaries do
    not chase individual sampled lengths."""
    granule = 2 ** np.maximum(np.floor(np.log2(np.maximum(values, 1))).astype(np.int64) - 6, 0)
    return -(-values // granule) * granule


def _prefill_options(trace: _Trace, max_chunk: int, most: int) -> list[tuple[int, ...]]:
    lengths = np.minimum(trace.prefill_len, max_chunk)
    weights = np.ones(len(lengths))  # every chunk pays its bucket in token slots
    candidates = np.minimum(_coarsen(lengths), max_chunk)
    return [
        _align_prefill(b, lengths, weights) for b in _optimal_boundaries(candidates, weights, max_chunk, most)
    ]


def _decode_options(trace: _Trace, max_num_seqs: int, most: int) -> list[tuple[int, ...]]:
    rows = np.minimum(trace.decode_rows, max_num_seqs)  # every call pays its bucket in rows
    return [tuple(b) for b in _optimal_boundaries(rows, np.ones(len(rows)), max_num_seqs, most)]


def _context_options(trace: _Trace, block_size: int, max_context: int, most: int) -> list[tuple[int, ...]]:
    """Context needs rounded up to whole blocks (a context bucket must be a multiple of the block size),
    weighted by the rows or tokens that read them."""
    needs = np.concatenate((trace.prefill_start + trace.prefill_len, trace.decode_max_context))
    weights = np.concatenate((trace.prefill_len, trace.decode_rows)).astype(float)
    needs = np.minimum(round_up_array(_coarsen(needs), block_size), max_context)
    return [tuple(b) for b in _optimal_boundaries(needs, weights, max_context, most)]


def round_up_array(values: np.ndarray, multiple: int) -> np.ndarray:
    return -(-values // multiple) * multiple
