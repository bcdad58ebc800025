"""One compiled call, described as a value, and the rule that turns a scheduler step into calls. Pure Python,
no torch.

A `Call` is what the runner runs, what the compile recorder names in a recompile error and a lowered graph's
label, what the padding metrics count, and what the bucket policy's simulation predicts. `plan_step` is the
one rule that maps a step's decode rows and prefill chunks to calls: the runner (worker/step/model_runner.py)
and the simulation (vllm_neuron/planning/step_simulation.py) both call it. A step becomes one or more calls:
- prefill: one or more requests' chunks packed in one row of queries (`chunks`), `tokens` real tokens
  padded to `token_bucket`, attending over the context bucket `chunk_context`; a fresh prefill call
  (`chunk_context` 0) runs one request's first chunk over its own keys (buckets.py);
- decode: `rows` requests of one token each, padded to the batch bucket `batch`, over the decode context
  bucket `decode_context`;
- mixed: a decode call that also runs one prefill chunk of `tokens` tokens (padded to `token_bucket`), which
  attends over `chunk_context`;
- verify (speculative decoding): a decode call whose rows have `queries` query slots each, a row's last
  token and its draft tokens (a row without drafts uses one), over the decode shapes.
Each context bucket has one meaning whatever the phase: `decode_context` is the decode rows' (decode, mixed,
verify; 0 in a prefill call), `chunk_context` the prefill chunks' (prefill, mixed; 0 in a decode or verify
call). A call's graph (`graph`) has the chunks' context bucket in a prefill call, else the decode rows'.
"""

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

from vllm_neuron.buckets import BucketConfig, BucketError, GraphKey, ceil_div, pack_prefill, pick_bucket

Phase = Literal["prefill", "decode", "mixed", "verify"]


def fresh_pairs(tokens: int) -> int:
    """(query, key) pairs of causal attention over `tokens` tokens' own keys (ints or numpy arrays)."""
    return tokens * (tokens + 1) // 2


@dataclass(frozen=True)
class Call:
    phase: Phase
    rows: int = 0  # real decode rows (decode, mixed, verify)
    batch: int = 0  # their batch bucket
    decode_context: int = 0  # their context bucket (a decode context bucket)
    tokens: int = 0  # real prefill tokens (prefill, mixed)
    token_bucket: int = 0
    chunk_context: int = 0  # the context bucket the prefill chunks attend over (prefill, mixed)
    chunks: int = 0  # prefill chunks in the call (prefill: 1 to PACKED_CHUNKS; mixed: 1)
    start: int = 0  # position of the first prefill token (one chunk: where it starts in its request)
    queries: int = 1  # query slots a decode row has (verify: 1 + the draft tokens the config allows)

    @classmethod
    def prefill(
        cls, tokens: int, token_bucket: int, chunk_context: int, *, chunks: int = 1, start: int = 0
    ) -> "Call":
        return cls(
            "prefill",
            tokens=tokens,
            token_bucket=token_bucket,
            chunk_context=chunk_context,
            chunks=chunks,
            start=start,
        )

    @classmethod
    def decode(cls, rows: int, batch: int, decode_context: int) -> "Call":
        return cls("decode", rows=rows, batch=batch, decode_context=decode_context)

    @classmethod
    def verify(cls, rows: int, batch: int, decode_context: int, queries: int) -> "Call":
        return cls("verify", rows=rows, batch=batch, decode_context=decode_context, queries=queries)

    def with_chunk(self, tokens: int, start: int, token_bucket: int, chunk_context: int) -> "Call":
        """This decode call as a mixed call that also runs a prefill chunk."""
        assert self.phase == "decode", self
        return Call(
            "mixed",
            rows=self.rows,
            batch=self.batch,
            decode_context=self.decode_context,
            tokens=tokens,
            token_bucket=token_bucket,
            chunk_context=chunk_context,
            chunks=1,
            start=start,
        )

    @property
    def fresh(self) -> bool:
        """A fresh prefill call: one request's first chunk, over its own keys (no context bucket)."""
        return self.phase == "prefill" and not self.chunk_context

    @property
    def chunk_pairs(self) -> int:
        """(query, key) pairs its prefill chunk's attention computes: token bucket x context bucket, or a
        fresh chunk's causal triangle over its own keys."""
        if self.fresh:
            return fresh_pairs(self.token_bucket)
        return self.token_bucket * self.chunk_context

    @property
    def graph(self) -> GraphKey:
        """The compiled graph this call runs."""
        if self.phase == "prefill":
            return ("prefill", self.token_bucket, self.chunk_context)
        return (self.phase, self.batch, self.decode_context)

    @property
    def bucket(self) -> str:
        """The graph's shape, as the bucket label of vllm_neuron:bucket_calls: prefill tokens x context,
        decode batch x context, mixed batch x context + chunk tokens."""
        if self.phase == "prefill":
            return f"{self.token_bucket}x{self.chunk_context}"
        decode = f"{self.batch}x{self.decode_context}"
        return decode if self.phase == "decode" else f"{decode}+{self.token_bucket}"

    def padding(self) -> dict[str, tuple[int, int]]:
        """(real, computed slots) for each token phase the call computes: a mixed call computes both."""
        figures = {}
        if self.phase != "prefill":
            figures["decode"] = (self.rows, self.batch)
        if self.phase != "decode":
            figures["prefill"] = (self.tokens, self.token_bucket)
        return figures

    def __str__(self) -> str:
        decode = f"decode of {self.rows} requests: batch {self.batch} x context {self.decode_context}"
        if self.phase == "verify":
            shape = f"batch {self.batch} x context {self.decode_context}"
            return f"verify of {self.rows} requests, {self.queries} query slots each: {shape}"
        if self.phase == "decode":
            return decode
        if self.phase == "mixed":
            return (
                f"{decode}, with prefill of {self.tokens} tokens at {self.start}: "
                f"tokens {self.token_bucket} x context {self.chunk_context}"
            )
        shape = f"tokens {self.token_bucket} x context {self.chunk_context}"
        if self.fresh:
            return f"fresh prefill of {self.tokens} tokens: tokens {self.token_bucket}, over its own keys"
        if self.chunks == 1:
            return f"prefill of {self.tokens} tokens at {self.start}: {shape}"
        return f"prefill of {self.chunks} requests, {self.tokens} tokens: {shape}"


@dataclass(frozen=True)
class CallPlan:
    """A call of a step and what it runs: `decode_rows` index the step's decode rows, `parts` are
    (chunk index, start, length) of the prefill chunks it runs, in call order."""

    call: Call
    decode_rows: tuple[int, ...] = ()
    parts: tuple[tuple[int, int, int], ...] = ()


def plan_step(
    decode_contexts: Sequence[int],
    chunks: Sequence[tuple[int, int]],
    buckets: BucketConfig,
    block_size: int,
    ready: Collection[GraphKey] | None = None,
    verify: bool = False,
) -> list[CallPlan]:
    """The calls of one step, in the order they run. `decode_contexts`: each decode row's context (its
    last query's position + 1), in batch order; `chunks`: each prefill chunk's (start, length), in batch
    order; `ready`: the graphs calls may use (None: every graph of the bucket set; staged readiness passes
    those compiled so far, which always include `buckets.minimal_graphs()`); `verify`: a decode row has draft
    tokens, so the decode rows run in verify calls (the same shapes, `buckets.verify_tokens` queries a row),
    which take no chunk along.

    Decode rows run in calls of at most the largest batch bucket, each call the smallest shape that holds
    its rows; the first of those whose mixed graph exists takes along the first chunk of at most
    `buckets.mixed_chunk_bucket` tokens. The other chunks are packed into prefill calls by `pack_prefill`,
    up to the largest token bucket over the largest context, each call the smallest shape that holds it."""
    phase: Phase = "verify" if verify else "decode"
    decode_shapes = _usable(buckets.verify_shapes() if verify else buckets.decode_shapes(), phase, ready)
    plans: list[CallPlan] = []
    chunk_bucket = 0 if verify else buckets.mixed_chunk_bucket
    rider = next((i for i, (_, length) in enumerate(chunks) if length <= chunk_bucket), None)
    taken = None
    for rows, call in _decode_calls(decode_contexts, decode_shapes, buckets):
        if verify:
            plans.append(
                CallPlan(Call.verify(call.rows, call.batch, call.decode_context, buckets.verify_tokens), rows)
            )
            continue
        mixed_ready = ready is None or ("mixed", call.batch, call.decode_context) in ready
        if (
            taken is None
            and rider is not None
            and mixed_ready
            and buckets.has_mixed(call.batch, chunks[rider][1])
        ):
            taken = rider
            start, length = chunks[rider]
            call = call.with_chunk(length, start, buckets.mixed_chunk_bucket, buckets.context_buckets[-1])
            plans.append(CallPlan(call, rows, ((rider, start, length),)))
            continue
        plans.append(CallPlan(call, rows))
    prefill_shapes = _usable(buckets.prefill_shapes(), "prefill", ready)
    largest_context = buckets.context_buckets[-1]
    remaining = [(index, *chunks[index]) for index in range(len(chunks)) if index != taken]
    fresh = {tokens for tokens, _ in _usable(buckets.fresh_shapes(), "prefill", ready)}
    if fresh:
        plans += fresh_calls(remaining, fresh, buckets.prefill_buckets)
    packed_calls = pack_prefill(
        [(start, length) for _, start, length in remaining],
        max(tokens for tokens, ctx in prefill_shapes if ctx == largest_context),
        largest_context,
        block_size,
    )
    for packed in packed_calls:
        parts = tuple((remaining[index][0], start, length) for index, start, length in packed.parts)
        token_bucket, context = next(
            (tokens, ctx)
            for tokens, ctx in prefill_shapes
            if tokens >= packed.tokens and ctx >= packed.context
        )
        call = Call.prefill(packed.tokens, token_bucket, context, chunks=len(parts), start=parts[0][1])
        plans.append(CallPlan(call, parts=parts))
    return plans


def most_calls_per_step(
    buckets: BucketConfig,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    *,
    staged: bool,
    draft_model: bool = False,
    head: bool = False,
) -> int:
    """The most compiled calls one step makes: plan_step's, and with a draft model or an EAGLE3 head (`head`)
    theirs. `staged`:
    graphs may still compile while serving (staged readiness), so a step may find only the minimal ones
    ready; else every graph is.

    Each scheduled request may take a call of its own: a decode row (with only the smallest batch bucket
    ready), a chunk whose context leaves no room in a prefill call for the next one's. A chunk of L tokens
    takes at most 1 + (L - 1) // T calls, T the largest ready prefill bucket over the largest context: the
    smallest under staged readiness, else the largest. With k requests, each of at least one token, that is
    k + (tokens - k) // T, the most at k = min(max_num_seqs, max_num_batched_tokens). The most over the steps
    the scheduler may form, reached where the KV cache holds every scheduled request past half the largest
    context (each chunk then fills a call's context); with fewer blocks a step makes fewer.

    A draft model runs beside each call of the model, then proposes a token a pass for each of its
    verify_tokens - 1 passes, in decode calls of at most max_num_seqs rows: as many as the smallest batch
    bucket takes under staged readiness, else the largest. An EAGLE3 head runs its passes in one propose call
    per such decode call."""
    requests = min(max_num_seqs, max_num_batched_tokens)
    token_bucket = buckets.prefill_buckets[0] if staged else buckets.prefill_buckets[-1]
    calls = requests + (max_num_batched_tokens - requests) // token_bucket
    if not draft_model and not head:
        return calls
    batch = buckets.decode_batch_buckets[0] if staged else buckets.decode_batch_buckets[-1]
    if head:
        return calls + ceil_div(max_num_seqs, batch)
    return 2 * calls + (buckets.verify_tokens - 1) * ceil_div(max_num_seqs, batch)


def fresh_calls(
    chunks: list[tuple[int, int, int]], fresh: set[int], prefill_buckets: Sequence[int]
) -> list[CallPlan]:
    """Fresh prefill calls for the chunks (index, start, length) that start their request (position 0) and
    whose token bucket has a fresh graph: each alone, over its own keys. A chunk longer than the largest
    bucket runs its first bucket's worth fresh, and the rest stays in `chunks` (updated in place) for the
    packed calls, which run after it and read its KV from the cache."""
    plans = []
    largest = prefill_buckets[-1]
    for position, (index, start, length) in enumerate(chunks):
        tokens = min(length, largest)
        bucket = pick_bucket(prefill_buckets, tokens)
        if start or bucket not in fresh:
            continue
        plans.append(CallPlan(Call.prefill(tokens, bucket, 0), parts=((index, 0, tokens),)))
        chunks[position] = (index, tokens, length - tokens)
    chunks[:] = [chunk for chunk in chunks if chunk[2]]
    return plans


def _usable(shapes: list[tuple[int, int]], phase: Phase, ready: Collection[GraphKey] | None) -> list:
    """The (bucket, context) shapes of a phase that calls may use, ascending."""
    return sorted(shapes if ready is None else [s for s in shapes if (phase, *s) in ready])


def _decode_calls(
    contexts: Sequence[int], shapes: list[tuple[int, int]], buckets: BucketConfig
) -> list[tuple[tuple[int, ...], Call]]:
    """Decode rows in batch order as calls: each takes as many of the next rows as a usable shape holds (at
    most its batch bucket), the smallest such shape."""
    pages = [0, *accumulate(ceil_div(ctx, buckets.page_tokens) for ctx in contexts)]
    calls = []
    first = 0
    while first < len(contexts):
        best = None
        for batch, ctx in shapes:  # ascending: the first of those taking the most rows is the smallest
            take = min(batch, len(contexts) - first)
            fits = buckets.decode_pages(batch, ctx) >= pages[first + take] - pages[first]
            if fits and (best is None or take > best[0]):
                best = (take, batch, ctx)
        if best is None:
            raise BucketError(f"no usable decode graph holds the decode rows of contexts {list(contexts)}")
        take, batch, ctx = best
        calls.append((tuple(range(first, first + take)), Call.decode(take, batch, ctx)))
        first += take
    return calls
