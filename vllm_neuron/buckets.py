"""Bucket sets for static shapes: pure functions, no torch.

Every compiled call is padded to one bucket so the set of graph shapes is known, and compiled, before
serving. Three dimensions:
- prefill token buckets: tokens of one prefill chunk;
- decode batch buckets: requests in one decode step;
- context buckets: KV positions a call attends to (a multiple of the block size), so short requests read
  only the blocks they need instead of max_model_len.
"""

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


class BucketError(ValueError):
    """An invalid bucket configuration; the message says what to change."""


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


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class BucketConfig:
    prefill_tokens: tuple[int, ...]
    decode_batch: tuple[int, ...]
    context_tokens: tuple[int, ...]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(tokens, context) pairs a prefill call can take: a chunk that needs bucket T has more tokens than
        the bucket below T, so it never uses a context bucket smaller than that."""
        shapes = []
        previous = 0
        for tokens in self.prefill_tokens:
            smallest_context = pick_bucket(self.context_tokens, previous + 1)
            shapes += [(tokens, ctx) for ctx in self.context_tokens if ctx >= smallest_context]
            previous = tokens
        return shapes

    def decode_shapes(self) -> list[tuple[int, int]]:
        """(batch, context) pairs of decode calls."""
        return [(batch, ctx) for batch in self.decode_batch for ctx in self.context_tokens]

    @property
    def num_graphs(self) -> int:
        return len(self.prefill_shapes()) + len(self.decode_shapes())

    def describe(self) -> str:
        return (
            f"prefill tokens {list(self.prefill_tokens)}, decode batch {list(self.decode_batch)}, "
            f"context {list(self.context_tokens)} -> {self.num_graphs} graphs"
        )


def default_buckets(
    *, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, block_size: int
) -> BucketConfig:
    max_chunk = min(max_num_batched_tokens, max_model_len)
    max_context = round_up(max_model_len, block_size)
    return BucketConfig(
        prefill_tokens=tuple(powers_of_two(min(128, max_chunk), max_chunk)),
        decode_batch=tuple(powers_of_two(1, max_num_seqs)),
        context_tokens=tuple(powers_of_two(min(round_up(512, block_size), max_context), max_context)),
    )


def _check_ascending(name: str, values: Sequence[int], setting: str) -> None:
    if not values:
        raise BucketError(f"{name} buckets are empty: give at least one value in {setting}")
    if any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in values):
        raise BucketError(f"{name} buckets {list(values)} must be positive integers ({setting})")
    if list(values) != sorted(set(values)):
        raise BucketError(f"{name} buckets {list(values)} must be strictly ascending ({setting})")


def validate_buckets(
    buckets: BucketConfig,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
) -> None:
    """Raise BucketError naming the setting to change when the bucket set cannot serve this engine."""
    _check_ascending("prefill", buckets.prefill_tokens, "prefill_buckets / VLLM_NEURON_PREFILL_BUCKETS")
    _check_ascending(
        "decode batch", buckets.decode_batch, "decode_batch_buckets / VLLM_NEURON_DECODE_BATCH_BUCKETS"
    )
    _check_ascending("context", buckets.context_tokens, "context_buckets / VLLM_NEURON_CONTEXT_BUCKETS")
    if buckets.prefill_tokens[-1] > max_num_batched_tokens:
        raise BucketError(
            f"prefill bucket {buckets.prefill_tokens[-1]} exceeds "
            f"max_num_batched_tokens={max_num_batched_tokens}: "
            "lower the bucket or raise --max-num-batched-tokens"
        )
    if buckets.decode_batch[-1] > max_num_seqs:
        raise BucketError(
            f"decode batch bucket {buckets.decode_batch[-1]} exceeds max_num_seqs={max_num_seqs}: "
            "lower the bucket or raise --max-num-seqs"
        )
    misaligned = [c for c in buckets.context_tokens if c % block_size]
    if misaligned:
        raise BucketError(
            f"context buckets {misaligned} are not multiples of the KV block size {block_size}: "
            "change context_buckets / VLLM_NEURON_CONTEXT_BUCKETS or --block-size"
        )
    if buckets.context_tokens[-1] < max_model_len:
        raise BucketError(
            f"the largest context bucket {buckets.context_tokens[-1]} is below "
            f"max_model_len={max_model_len}: "
            f"add a context bucket >= {round_up(max_model_len, block_size)} or lower --max-model-len"
        )
    if buckets.prefill_tokens[-1] > buckets.context_tokens[-1]:
        raise BucketError(
            f"prefill bucket {buckets.prefill_tokens[-1]} exceeds the largest context bucket "
            f"{buckets.context_tokens[-1]}, so no chunk could use it: lower prefill_buckets"
        )
    # A bucket no call can use is a graph compiled for nothing.
    max_chunk = min(max_num_batched_tokens, max_model_len)
    if len(buckets.prefill_tokens) > 1 and buckets.prefill_tokens[-2] >= max_chunk:
        raise BucketError(
            f"prefill buckets above {buckets.prefill_tokens[-2]} are never used: no chunk is longer than "
            f"min(max_num_batched_tokens, max_model_len) = {max_chunk}; shorten prefill_buckets"
        )
    if len(buckets.context_tokens) > 1 and buckets.context_tokens[-2] >= max_model_len:
        raise BucketError(
            f"context buckets above {buckets.context_tokens[-2]} are never used: no context is longer than "
            f"max_model_len={max_model_len}; shorten context_buckets"
        )
