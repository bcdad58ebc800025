"""Bucket sets for static shapes: pure functions, no torch.

Every compiled call is padded to one bucket so the set of graph shapes is known, and compiled, before
serving. Three dimensions:
- prefill token buckets: tokens of one prefill chunk;
- decode batch buckets: requests in one decode step;
- context buckets: KV positions a call attends to (a multiple of the block size), so short requests read
  only the blocks they need instead of max_model_len. A prefill chunk attends to the context bucket of its
  end. A decode call of batch bucket B and context bucket c reads B x pages(c) pages of `page_tokens` KV
  positions, shared among its rows as each needs: the bucket follows the rows' average context, not the
  longest one. Decode calls may have context buckets of their own (`decode_context_buckets`): a full batch
  reads every page of its bucket, row after row, while a prefill chunk reads its context once for all its
  tokens, so decode gains from finer steps where prefill would only add graphs.

A mixed call runs decode rows and one prefill chunk of at most `mixed_chunk_bucket` tokens together, in one
pass over the weights: a step that carries the prefill share's chunk beside running streams
(vllm_neuron/scheduler.py) costs about one call, not two. Its shapes are those of the decode calls with a
batch bucket in `mixed_batch_buckets`; the chunk attends over the largest context bucket (a small chunk's
attention is cheap next to a pass over the weights, and a context dimension would multiply the graphs
again).

A fresh prefill call runs the first chunk of one request (position 0, nothing cached before it) on its own,
in a graph of its token bucket that attends over the chunk's own keys only (`fresh_buckets`; its graph key's
context is 0): causal attention with no mask and no cache read, the form TorchNeuron hands its NKI flash
attention kernel (docs/lowering.md, "Prefill on TorchNeuron's flash path"). Every other chunk (a prefix
hit, a later chunk, chunks packed together) takes the masked form over its context bucket.

With speculative decoding, a verify call checks each decode row's draft tokens in one pass: the row's last
token and its k drafts, `verify_tokens` = k + 1 queries a row, over the decode calls' shapes (batch bucket x
decode context bucket), its rows sharing KV pages as a decode call's do.
"""

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# A compiled graph: (phase, prefill token bucket or decode batch bucket, context bucket). A mixed graph's
# chunk bucket and chunk context are fixed by the bucket set, so batch and context name it. A fresh prefill
# graph's context is 0: it reads no cached KV.
GraphKey = tuple[Literal["prefill", "decode", "mixed", "verify"], int, int]


class BucketError(ValueError):
    """An invalid bucket configuration; the message says what to change."""


# The most requests' chunks one prefill call packs: a call's pass over the weights costs as much for a short
# prompt as for a long one, so the short prompts of one step share it. Every prefill call keeps this many
# logits rows, so packing changes no shape (a row's lm_head is about a fifth of a token's work in SmolLM2).
PACKED_CHUNKS = 8


# TorchNeuron's flash attention kernel takes query and key lengths in multiples of 128 and keys in whole
# sequence tiles of at least 512 (torch_neuronx's SDPA decomposition): the token buckets that get fresh
# prefill graphs by default.
FLASH_TOKENS = 512


def pick_bucket(buckets: Sequence[int], size: int) -> int:
    """The smallest bucket that holds `size` (buckets ascending)."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise BucketError(f"size {size} exceeds the largest bucket {buckets[-1]} of {list(buckets)}")
    return buckets[index]


def powers_of_two(start: int, stop: int) -> list[int]:
    """start, 2*start, 4*start, ... below stop, then stop itself."""
    values: list[int] = []
    value = start
    while value < stop:
        values.append(value)
        value *= 2
    values.append(stop)
    return values


def ceil_div(value: int, divisor: int) -> int:
    """`value` / `divisor` rounded up: the blocks that hold a number of tokens, the pages that hold a context
    (ints, or numpy arrays element-wise)."""
    return -(-value // divisor)


def round_up(value: int, multiple: int) -> int:
    return ceil_div(value, multiple) * multiple


# KV positions per decode attention page: large enough that a page is a good matmul tile (128 is also the
# partition width of a NeuronCore), small enough that rounding each row up to a page wastes little.
PAGE_TARGET_TOKENS = 128


def decode_page_tokens(block_size: int) -> int:
    """Decode pages hold whole KV blocks: PAGE_TARGET_TOKENS rounded up to the block size."""
    return round_up(PAGE_TARGET_TOKENS, block_size)


@dataclass(frozen=True)
class BucketConfig:
    # Each bucket list is named as its --additional-config key (config.py).
    prefill_buckets: tuple[int, ...]
    decode_batch_buckets: tuple[int, ...]
    context_buckets: tuple[int, ...]
    page_tokens: int = PAGE_TARGET_TOKENS  # decode_page_tokens(block size)
    # The prefill share (vllm_neuron/prefill_share.py): the most prefill tokens a step carries beside decode
    # rows under light load, and the chunk bucket of the mixed calls; 0: off.
    prefill_tokens_while_decoding: int = 0
    mixed_batch_buckets: tuple[int, ...] = ()  # the decode batch buckets with mixed calls
    decode_context_buckets: tuple[int, ...] = ()  # the decode calls' context buckets; (): context_buckets
    verify_tokens: int = (
        0  # queries a verify row (speculative decoding: 1 + draft tokens); 0: no verify calls
    )
    fresh_buckets: tuple[int, ...] = ()  # prefill token buckets with a fresh prefill graph

    def fresh_shapes(self) -> list[tuple[int, int]]:
        """(tokens, 0) of the fresh prefill graphs: a request's first chunk alone, over its own keys."""
        return [(tokens, 0) for tokens in self.fresh_buckets]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(tokens, context) pairs a prefill call can take: a chunk that needs bucket T has more tokens than
        the bucket below T, so it never uses a context bucket smaller than that."""
        shapes = []
        previous = 0
        for tokens in self.prefill_buckets:
            smallest_context = pick_bucket(self.context_buckets, previous + 1)
            shapes += [(tokens, ctx) for ctx in self.context_buckets if ctx >= smallest_context]
            previous = tokens
        return shapes

    def decode_contexts(self) -> list[int]:
        """The context buckets decode calls use (`decode_context_buckets`, else the context buckets): the
        smallest of those with the same number of pages."""
        contexts: list[int] = []
        for ctx in self.decode_context_buckets or self.context_buckets:
            if not contexts or ceil_div(ctx, self.page_tokens) > ceil_div(contexts[-1], self.page_tokens):
                contexts.append(ctx)
        return contexts

    def decode_shapes(self) -> list[tuple[int, int]]:
        """(batch, context) pairs of decode calls."""
        return [(batch, ctx) for batch in self.decode_batch_buckets for ctx in self.decode_contexts()]

    def verify_shapes(self) -> list[tuple[int, int]]:
        """(batch, context) pairs of verify calls: the decode shapes, with speculative decoding."""
        return self.decode_shapes() if self.verify_tokens else []

    def decode_pages(self, batch: int, context: int) -> int:
        """KV pages a decode call of this shape attends over, shared among its rows."""
        return batch * ceil_div(context, self.page_tokens)

    def pick_decode_context(self, batch: int, row_contexts: Sequence[int]) -> int:
        """The smallest context bucket whose pages hold every row's context, each rounded up to pages."""
        needed = sum(ceil_div(ctx, self.page_tokens) for ctx in row_contexts)
        for ctx in self.decode_contexts():
            if self.decode_pages(batch, ctx) >= needed:
                return ctx
        raise BucketError(
            f"decode rows of contexts {list(row_contexts)} need {needed} pages, more than a batch of {batch} "
            f"holds at the largest decode context bucket {self.decode_contexts()[-1]}"
        )

    @property
    def mixed_chunk_bucket(self) -> int:
        """A mixed call's chunk bucket: the prefill share where the set has mixed calls, else 0."""
        return self.prefill_tokens_while_decoding if self.mixed_batch_buckets else 0

    def mixed_shapes(self) -> list[tuple[int, int]]:
        """(batch, context) pairs of mixed calls: decode shapes whose batch bucket has mixed calls."""
        if not self.mixed_chunk_bucket:
            return []
        return [(batch, ctx) for batch, ctx in self.decode_shapes() if batch in self.mixed_batch_buckets]

    def has_mixed(self, batch: int, chunk_tokens: int) -> bool:
        """Whether a decode call of this batch bucket can take a prefill chunk of this many tokens along."""
        return batch in self.mixed_batch_buckets and 0 < chunk_tokens <= self.mixed_chunk_bucket

    @property
    def num_graphs(self) -> int:
        return (
            len(self.prefill_shapes())
            + len(self.fresh_shapes())
            + len(self.decode_shapes())
            + len(self.mixed_shapes())
            + len(self.verify_shapes())
        )

    def graphs(self) -> list[GraphKey]:
        """Every graph of the bucket set, in warm-up order: prefill (fresh last), decode, mixed, then verify
        shapes."""
        return [
            *(("prefill", tokens, ctx) for tokens, ctx in self.prefill_shapes()),
            *(("prefill", tokens, ctx) for tokens, ctx in self.fresh_shapes()),
            *(("decode", batch, ctx) for batch, ctx in self.decode_shapes()),
            *(("mixed", batch, ctx) for batch, ctx in self.mixed_shapes()),
            *(("verify", batch, ctx) for batch, ctx in self.verify_shapes()),
        ]

    def minimal_graphs(self) -> list[GraphKey]:
        """Two graphs that serve every step (calls.plan_step with only these ready): the smallest prefill
        token bucket over the largest context, longer prompts running as more chunks, and the smallest decode
        batch over the largest decode context, larger batches running as more calls. Each holds any chunk or
        row up to max_model_len. With speculative decoding, the smallest verify shape over the largest decode
        context too: a step with draft tokens verifies them."""
        graphs: list[GraphKey] = [
            ("prefill", self.prefill_buckets[0], self.context_buckets[-1]),
            ("decode", self.decode_batch_buckets[0], self.decode_contexts()[-1]),
        ]
        if self.verify_tokens:
            graphs.append(("verify", self.decode_batch_buckets[0], self.decode_contexts()[-1]))
        return graphs

    def describe(self) -> str:
        mixed_batch, chunk = list(self.mixed_batch_buckets), self.mixed_chunk_bucket
        mixed = (
            f", mixed: decode batch {mixed_batch} + a chunk of {chunk} tokens"
            if self.mixed_chunk_bucket
            else ""
        )
        decode_context = (
            f", decode context {list(self.decode_context_buckets)}" if self.decode_context_buckets else ""
        )
        verify = f", verify: {self.verify_tokens} tokens a row" if self.verify_tokens else ""
        fresh = f", fresh prefill {list(self.fresh_buckets)}" if self.fresh_buckets else ""
        return (
            f"prefill tokens {list(self.prefill_buckets)}{fresh}, decode batch "
            f"{list(self.decode_batch_buckets)}, context {list(self.context_buckets)}{decode_context}{mixed}"
            f"{verify} -> {self.num_graphs} graphs"
        )


@dataclass(frozen=True)
class PrefillCall:
    """One prefill call of a step: `parts` are (chunk index, start, length) in call order."""

    parts: tuple[tuple[int, int, int], ...]
    tokens: int
    context: int  # KV positions it attends over: each part's context (start + length) in whole blocks


def pack_prefill(
    chunks: Sequence[tuple[int, int]], largest_tokens: int, largest_context: int, block_size: int
) -> list[PrefillCall]:
    """The calls of one step's prefill chunks, given as (start, length) in batch order: packed in order, at
    most PACKED_CHUNKS to a call, while their tokens fit `largest_tokens` and their contexts, each in whole
    blocks, `largest_context`. A chunk longer than `largest_tokens` runs as consecutive sub-chunks, a call
    each: attention reads the earlier ones back from the cache. The runner and the bucket policy's simulation
    both call this, so the policy costs the calls the runner makes."""

    def blocks(start: int, length: int) -> int:
        return ceil_div(start + length, block_size)

    def call(parts: list[tuple[int, int, int]]) -> PrefillCall:
        context = sum(blocks(start, length) for _, start, length in parts) * block_size
        return PrefillCall(tuple(parts), sum(length for *_, length in parts), context)

    calls: list[PrefillCall] = []
    pack: list[tuple[int, int, int]] = []
    room = largest_context // block_size
    for index, (start, length) in enumerate(chunks):
        if length > largest_tokens:
            for offset in range(0, length, largest_tokens):
                calls.append(call([(index, start + offset, min(largest_tokens, length - offset))]))
            continue
        tokens = sum(n for *_, n in pack) + length
        needed = sum(blocks(s, n) for _, s, n in pack) + blocks(start, length)
        if len(pack) == PACKED_CHUNKS or tokens > largest_tokens or needed > room:
            calls.append(call(pack))
            pack = []
        pack.append((index, start, length))
    if pack:
        calls.append(call(pack))
    return calls


def light_load_batches(decode_batch_buckets: Sequence[int], max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch buckets of steps the scheduler caps prefill in (vllm_neuron/scheduler.py: at most
    half of max_num_seqs requests decoding): those that get mixed calls by default. A mixed call also holds
    the prefilling request, so its batch bucket stays below max_num_seqs."""
    light_load = min(max_num_seqs // 2, decode_batch_buckets[-1])
    if not light_load:
        return ()
    largest = pick_bucket(decode_batch_buckets, light_load)
    return tuple(batch for batch in decode_batch_buckets if batch <= largest and batch < max_num_seqs)


def default_buckets(
    *, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, block_size: int
) -> BucketConfig:
    max_chunk = min(max_num_batched_tokens, max_model_len)
    max_context = round_up(max_model_len, block_size)
    prefill_buckets = tuple(powers_of_two(min(128, max_chunk), max_chunk))
    return BucketConfig(
        prefill_buckets=prefill_buckets,
        decode_batch_buckets=tuple(powers_of_two(1, max_num_seqs)),
        context_buckets=tuple(powers_of_two(min(round_up(512, block_size), max_context), max_context)),
        page_tokens=decode_page_tokens(block_size),
        fresh_buckets=flash_buckets(prefill_buckets),
    )


def flash_buckets(prefill_buckets: Sequence[int]) -> tuple[int, ...]:
    """The prefill token buckets whose fresh graphs TorchNeuron's flash kernel can take (FLASH_TOKENS)."""
    return tuple(tokens for tokens in prefill_buckets if tokens % FLASH_TOKENS == 0)


def _check_ascending(name: str, values: Sequence[int], setting: str) -> None:
    if not values:
        raise BucketError(f"{name} buckets are empty: give at least one value in {setting}")
    if any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in values):
        raise BucketError(f"{name} buckets {list(values)} must be positive integers ({setting})")
    if list(values) != sorted(set(values)):
        raise BucketError(f"{name} buckets {list(values)} must be strictly ascending ({setting})")


def _check_contexts(
    name: str, values: Sequence[int], setting: str, *, max_model_len: int, block_size: int, page_tokens: int
) -> None:
    """Context buckets are whole KV blocks, the largest holds max_model_len (and not more than a decode page
    beyond it), and every one can be used."""
    misaligned = [c for c in values if c % block_size]
    if misaligned:
        raise BucketError(
            f"{name} buckets {misaligned} are not multiples of the KV block size {block_size}: "
            f"change {setting} or --block-size"
        )
    if values[-1] < max_model_len:
        raise BucketError(
            f"the largest {name} bucket {values[-1]} is below max_model_len={max_model_len}: "
            f"add a {name} bucket >= {round_up(max_model_len, block_size)} or lower --max-model-len"
        )
    if ceil_div(values[-1], page_tokens) > ceil_div(max_model_len, page_tokens):
        raise BucketError(
            f"the largest {name} bucket {values[-1]} reaches past max_model_len={max_model_len} by more "
            f"than a decode page ({page_tokens} tokens): use {round_up(max_model_len, block_size)} or raise "
            "--max-model-len"
        )
    # A bucket no call can use is a graph compiled for nothing.
    if len(values) > 1 and values[-2] >= max_model_len:
        raise BucketError(
            f"{name} buckets above {values[-2]} are never used: no context is longer than "
            f"max_model_len={max_model_len}; shorten {setting.split(' / ')[0]}"
        )


def validate_buckets(
    buckets: BucketConfig,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
) -> None:
    """Raise BucketError naming the setting to change when the bucket set cannot serve this engine."""
    _check_ascending("prefill", buckets.prefill_buckets, "prefill_buckets / VLLM_NEURON_PREFILL_BUCKETS")
    _check_ascending(
        "decode batch",
        buckets.decode_batch_buckets,
        "decode_batch_buckets / VLLM_NEURON_DECODE_BATCH_BUCKETS",
    )
    _check_ascending("context", buckets.context_buckets, "context_buckets / VLLM_NEURON_CONTEXT_BUCKETS")
    if buckets.prefill_buckets[-1] > max_num_batched_tokens:
        raise BucketError(
            f"prefill bucket {buckets.prefill_buckets[-1]} exceeds "
            f"max_num_batched_tokens={max_num_batched_tokens}: "
            "lower the bucket or raise --max-num-batched-tokens"
        )
    if buckets.decode_batch_buckets[-1] > max_num_seqs:
        raise BucketError(
            f"decode batch bucket {buckets.decode_batch_buckets[-1]} exceeds max_num_seqs={max_num_seqs}: "
            "lower the bucket or raise --max-num-seqs"
        )
    if buckets.page_tokens % block_size:
        raise BucketError(
            f"decode pages of {buckets.page_tokens} tokens are not whole KV blocks of {block_size}: "
            f"use decode_page_tokens({block_size}) = {decode_page_tokens(block_size)}"
        )
    sizes = dict(max_model_len=max_model_len, block_size=block_size, page_tokens=buckets.page_tokens)
    _check_contexts(
        "context", buckets.context_buckets, "context_buckets / VLLM_NEURON_CONTEXT_BUCKETS", **sizes
    )
    if buckets.decode_context_buckets:
        setting = "decode_context_buckets / VLLM_NEURON_DECODE_CONTEXT_BUCKETS"
        _check_ascending("decode context", buckets.decode_context_buckets, setting)
        _check_contexts("decode context", buckets.decode_context_buckets, setting, **sizes)
    stray_fresh = sorted(set(buckets.fresh_buckets) - set(buckets.prefill_buckets))
    if stray_fresh:
        raise BucketError(
            f"fresh prefill buckets {stray_fresh} are not prefill buckets {list(buckets.prefill_buckets)}: "
            "change fresh_prefill_buckets"
        )
    full = [batch for batch in buckets.mixed_batch_buckets if batch >= max_num_seqs]
    if full:
        raise BucketError(
            f"mixed batch buckets {full} leave no room for the prefilling request beside the decode rows "
            f"(max_num_seqs={max_num_seqs}): change mixed_batch_buckets"
        )
    stray = sorted(set(buckets.mixed_batch_buckets) - set(buckets.decode_batch_buckets))
    if stray:
        raise BucketError(
            f"mixed batch buckets {stray} are not decode batch buckets {list(buckets.decode_batch_buckets)}: "
            "change mixed_batch_buckets"
        )
    if buckets.prefill_buckets[-1] > buckets.context_buckets[-1]:
        raise BucketError(
            f"prefill bucket {buckets.prefill_buckets[-1]} exceeds the largest context bucket "
            f"{buckets.context_buckets[-1]}, so no chunk could use it: lower prefill_buckets"
        )
    # A bucket no call can use is a graph compiled for nothing.
    max_chunk = min(max_num_batched_tokens, max_model_len)
    if len(buckets.prefill_buckets) > 1 and buckets.prefill_buckets[-2] >= max_chunk:
        raise BucketError(
            f"prefill buckets above {buckets.prefill_buckets[-2]} are never used: no chunk is longer than "
            f"min(max_num_batched_tokens, max_model_len) = {max_chunk}; shorten prefill_buckets"
        )
