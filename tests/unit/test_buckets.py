"""vllm_neuron.buckets: picking, default sets, the (tokens, context) shapes to compile, validation."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

from vllm_neuron.buckets import (
    PACKED_CHUNKS,
    BucketConfig,
    BucketError,
    PrefillCall,
    default_buckets,
    light_load_batches,
    pack_prefill,
    pick_bucket,
    powers_of_two,
    validate_buckets,
)

# ---- pick_bucket, powers_of_two --------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, bucket", [(1, 1), (2, 4), (4, 4), (5, 16), (15, 16), (16, 16), (17, 128), (128, 128)]
)
def test_pick_bucket_is_the_smallest_that_holds_the_size(size, bucket):
    assert pick_bucket([1, 4, 16, 128], size) == bucket


def test_pick_bucket_above_the_largest_raises_naming_the_size():
    with pytest.raises(BucketError, match=r"\b129\b.*\b128\b"):
        pick_bucket([1, 4, 16, 128], 129)
    assert issubclass(BucketError, ValueError)


@pytest.mark.parametrize(
    "start, stop, expected",
    [
        (1, 1, [1]),
        (1, 8, [1, 2, 4, 8]),
        (1, 6, [1, 2, 4, 6]),
        (128, 300, [128, 256, 300]),
        (512, 512, [512]),
        (128, 64, [64]),  # a start above stop gives stop alone
    ],
)
def test_powers_of_two(start, stop, expected):
    assert powers_of_two(start, stop) == expected


# ---- default_buckets -------------------------------------------------------------------------------

LIMITS = [
    dict(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192, block_size=16),
    dict(max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=2048, block_size=32),
    dict(max_model_len=100, max_num_seqs=3, max_num_batched_tokens=64, block_size=16),
    dict(max_model_len=1000, max_num_seqs=1, max_num_batched_tokens=4096, block_size=128),
    dict(max_model_len=513, max_num_seqs=5, max_num_batched_tokens=513, block_size=16),
    dict(max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=512, block_size=48),
]


def is_strictly_ascending(values) -> bool:
    return all(a < b for a, b in itertools.pairwise(values))


@pytest.mark.parametrize("limits", LIMITS, ids=lambda lim: "-".join(map(str, lim.values())))
def test_default_buckets_cover_the_engine_limits(limits):
    buckets = default_buckets(**limits)
    block_size, max_model_len = limits["block_size"], limits["max_model_len"]

    assert buckets.prefill_buckets[-1] == min(limits["max_num_batched_tokens"], max_model_len)
    assert buckets.decode_batch_buckets[-1] == limits["max_num_seqs"]
    assert buckets.context_buckets[-1] >= max_model_len
    assert buckets.context_buckets[-1] - max_model_len < block_size  # no more than one block of slack
    assert all(c % block_size == 0 for c in buckets.context_buckets)
    assert buckets.decode_batch_buckets[0] == 1
    for values in (buckets.prefill_buckets, buckets.decode_batch_buckets, buckets.context_buckets):
        assert is_strictly_ascending(values)
    validate_buckets(buckets, **limits)  # the defaults are always a valid set
    assert set(reachable_prefill_shapes(buckets)) == set(buckets.prefill_shapes())


def test_default_buckets_example():
    buckets = default_buckets(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512, block_size=16)
    assert buckets == BucketConfig(
        prefill_buckets=(128, 256, 512),
        decode_batch_buckets=(1, 2, 4, 8),
        context_buckets=(512, 1024, 2048),
        fresh_buckets=(512,),  # the multiples of 512: TorchNeuron's flash kernel takes them
    )


# ---- shapes ----------------------------------------------------------------------------------------

PAGE = 8  # decode page tokens of these sets, small enough that most context buckets differ in pages
CONFIGS = [
    BucketConfig(
        prefill_buckets=(4, 16, 64),
        decode_batch_buckets=(1, 2),
        context_buckets=(8, 16, 32, 64),
        page_tokens=PAGE,
    ),
    BucketConfig(
        prefill_buckets=(8,), decode_batch_buckets=(1,), context_buckets=(8, 24, 40), page_tokens=PAGE
    ),
    BucketConfig(
        prefill_buckets=(3, 5, 32),
        decode_batch_buckets=(1, 4),
        context_buckets=(4, 12, 16, 48),
        page_tokens=PAGE,
    ),
    BucketConfig(
        prefill_buckets=(16, 32), decode_batch_buckets=(2,), context_buckets=(64,), page_tokens=PAGE
    ),
]


def reachable_prefill_shapes(buckets: BucketConfig) -> set[tuple[int, int]]:
    """Brute force: every chunk of n tokens starting at `start` that fits the largest context bucket."""
    max_context = buckets.context_buckets[-1]
    context_of_end = np.array(
        [pick_bucket(buckets.context_buckets, end) for end in range(1, max_context + 1)]
    )
    shapes = set()
    for n in range(1, min(buckets.prefill_buckets[-1], max_context) + 1):
        tokens = pick_bucket(buckets.prefill_buckets, n)
        ends = n + np.arange(0, max_context - n + 1)  # start + n for every start
        shapes.update((tokens, int(context)) for context in np.unique(context_of_end[ends - 1]))
    return shapes


@pytest.mark.parametrize("buckets", CONFIGS, ids=range(len(CONFIGS)))
def test_prefill_shapes_hold_every_reachable_combination(buckets):
    shapes = buckets.prefill_shapes()
    assert len(shapes) == len(set(shapes)), "duplicate shapes"
    assert reachable_prefill_shapes(buckets) <= set(shapes)


@pytest.mark.parametrize("buckets", CONFIGS, ids=range(len(CONFIGS)))
def test_prefill_shapes_skip_contexts_too_small_for_the_token_bucket(buckets):
    """A chunk using token bucket T is longer than the bucket below T, so needs at least that context."""
    below = dict(zip(buckets.prefill_buckets, (0, *buckets.prefill_buckets[:-1]), strict=True))
    for tokens, context in buckets.prefill_shapes():
        assert tokens in buckets.prefill_buckets and context in buckets.context_buckets
        assert context >= pick_bucket(buckets.context_buckets, below[tokens] + 1)
    # ... and holds nothing no chunk can reach: every shape is a graph compiled at startup.
    assert set(buckets.prefill_shapes()) == reachable_prefill_shapes(buckets)


def test_prefill_shapes_example():
    buckets = CONFIGS[0]
    assert buckets.prefill_shapes() == [
        (4, 8), (4, 16), (4, 32), (4, 64),
        (16, 8), (16, 16), (16, 32), (16, 64),
        (64, 32), (64, 64),
    ]  # fmt: skip


@pytest.mark.parametrize("buckets", CONFIGS, ids=range(len(CONFIGS)))
def test_decode_shapes_are_every_batch_with_every_distinct_page_count(buckets):
    shapes = buckets.decode_shapes()
    assert shapes == list(itertools.product(buckets.decode_batch_buckets, buckets.decode_contexts()))
    for batch in buckets.decode_batch_buckets:  # no two shapes of one batch bucket attend over the same pages
        pages = [buckets.decode_pages(batch, context) for context in buckets.decode_contexts()]
        assert pages == sorted(set(pages))


def test_decode_contexts_keep_the_smallest_bucket_of_each_page_count():
    # Pages of 8 tokens: 4 -> 1, 12 -> 2, 16 -> 2, 48 -> 6. 16 would compile the same graph as 12.
    assert CONFIGS[2].decode_contexts() == [4, 12, 48]
    assert CONFIGS[2].decode_pages(4, 12) == 8
    # Contexts below one page of the default 128 tokens are one decode graph.
    assert BucketConfig((8,), (1,), (32, 64, 128, 256)).decode_contexts() == [32, 256]


def test_decode_context_buckets_of_their_own_shape_decode_and_mixed_calls_only():
    # contexts 8, 16, 32, 64
    shared = replace(CONFIGS[0], prefill_tokens_while_decoding=16, mixed_batch_buckets=(2,))
    own = replace(shared, decode_context_buckets=(24, 64))  # pages of 8: 3 and 8 a row
    assert own.prefill_shapes() == shared.prefill_shapes()
    assert own.decode_contexts() == [24, 64]
    assert own.decode_shapes() == [(1, 24), (1, 64), (2, 24), (2, 64)]
    assert own.mixed_shapes() == [(2, 24), (2, 64)]
    assert own.num_graphs == len(own.prefill_shapes()) + 4 + 2
    assert own.pick_decode_context(2, [20, 20]) == 24  # 6 pages: 2 x 3
    assert own.pick_decode_context(2, [40, 20]) == 64  # 8 pages: more than 2 x 3
    assert "context [8, 16, 32, 64], decode context [24, 64], mixed" in own.describe()
    with pytest.raises(BucketError, match="largest decode context bucket 64"):
        own.pick_decode_context(1, [65])


def test_pick_decode_context_follows_the_summed_pages_not_the_longest_row():
    buckets = CONFIGS[0]  # contexts 8, 16, 32, 64: 1, 2, 4, 8 pages a row
    assert buckets.pick_decode_context(2, [1, 8]) == 8  # 2 pages
    assert buckets.pick_decode_context(2, [9, 8]) == 16  # 3 pages
    # One long row next to a short one: 8 + 1 pages fit a batch of 2 at context 64 only...
    assert buckets.pick_decode_context(2, [64, 1]) == 64
    # ... but one long row in a padded batch shares the pages of the empty row.
    assert buckets.pick_decode_context(2, [60]) == 32
    with pytest.raises(BucketError, match="need 9 pages"):
        buckets.pick_decode_context(1, [65])


def test_num_graphs_counts_prefill_and_decode_shapes():
    buckets = CONFIGS[0]
    assert buckets.num_graphs == 10 + 2 * 4
    for config in CONFIGS:
        assert config.num_graphs == len(config.prefill_shapes()) + len(config.decode_shapes())
    assert "18 graphs" in buckets.describe()


def test_mixed_shapes_are_the_decode_shapes_of_the_mixed_batches():
    plain = CONFIGS[0]  # decode shapes: batch 1, 2 x contexts 8, 16, 32, 64
    buckets = replace(plain, prefill_tokens_while_decoding=16, mixed_batch_buckets=(2,))
    assert buckets.mixed_shapes() == [(2, 8), (2, 16), (2, 32), (2, 64)]
    assert buckets.num_graphs == plain.num_graphs + 4
    assert "mixed: decode batch [2] + a chunk of 16 tokens -> 22 graphs" in buckets.describe()
    assert buckets.has_mixed(2, 16) and buckets.has_mixed(2, 1)
    assert not buckets.has_mixed(2, 17)  # a longer chunk runs as its own call
    assert not buckets.has_mixed(1, 4)  # batch 1 has no mixed calls
    assert plain.mixed_shapes() == [] and not plain.has_mixed(1, 1)


@pytest.mark.parametrize(
    "decode_batch, max_num_seqs, expected",
    [
        ((1, 2, 4, 8, 16, 32), 32, (1, 2, 4, 8, 16)),  # at most 16 rows decode in a capped step
        ((1, 4, 32), 40, (1, 4, 32)),  # 20 rows pad to bucket 32
        ((1, 4, 32), 32, (1, 4)),  # ... but 32 rows leave no room for the prefilling request
        ((1, 2, 4), 4, (1, 2)),
        ((1,), 1, ()),  # one request at a time: no step is capped
        ((1, 2), 64, (1, 2)),  # the largest bucket at most
    ],
)
def test_light_load_batches(decode_batch, max_num_seqs, expected):
    assert light_load_batches(decode_batch, max_num_seqs) == expected


# ---- pack_prefill ---------------------------------------------------------------------------------


def test_pack_prefill_packs_in_order_until_a_largest_bucket_is_full():
    # (start, length) with blocks of 8: contexts of 1, 2, 3 and 1 blocks; largest buckets 32 tokens, 40
    # positions (5 blocks). The third chunk would make 6 blocks: a new call.
    calls = pack_prefill([(0, 5), (4, 9), (10, 7), (0, 3)], 32, 40, 8)
    assert calls == [
        PrefillCall(parts=((0, 0, 5), (1, 4, 9)), tokens=14, context=24),
        PrefillCall(parts=((2, 10, 7), (3, 0, 3)), tokens=10, context=32),
    ]
    # Tokens: 20 + 20 would pass the largest prefill bucket.
    assert [c.tokens for c in pack_prefill([(0, 20), (0, 20)], 32, 400, 8)] == [20, 20]
    # At most PACKED_CHUNKS chunks a call.
    calls = pack_prefill([(0, 2)] * (PACKED_CHUNKS + 1), 64, 400, 8)
    assert [len(c.parts) for c in calls] == [PACKED_CHUNKS, 1]


def test_pack_prefill_runs_a_long_chunk_as_sub_chunks_each_alone():
    calls = pack_prefill([(0, 3), (16, 70), (0, 4)], 32, 128, 8)
    assert [c.parts for c in calls] == [
        ((1, 16, 32),),
        ((1, 48, 32),),
        ((1, 80, 6),),
        ((0, 0, 3), (2, 0, 4)),  # the short chunks around it still share a call
    ]
    assert [c.context for c in calls] == [48, 80, 88, 16]


# ---- validate_buckets ------------------------------------------------------------------------------

ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=8)
VALID = dict(prefill_buckets=(8, 32), decode_batch_buckets=(1, 2, 4), context_buckets=(16, 64))


def validate(**changes):
    validate_buckets(BucketConfig(**{**VALID, **changes}), **ENGINE)


def test_validate_accepts_a_valid_set():
    validate()
    validate(context_buckets=(72,))  # above max_model_len is fine, within the same decode page
    validate(page_tokens=16)
    validate(decode_context_buckets=(24, 32, 64))  # decode calls' own, independent of the context buckets


@pytest.mark.parametrize(
    "changes, setting",
    [
        (dict(prefill_buckets=()), "prefill_buckets"),
        (dict(decode_batch_buckets=()), "decode_batch_buckets"),
        (dict(context_buckets=()), "context_buckets"),
        (dict(prefill_buckets=(32, 8)), "prefill_buckets"),
        (dict(decode_batch_buckets=(1, 4, 2)), "decode_batch_buckets"),
        (dict(context_buckets=(64, 16)), "context_buckets"),
        (dict(prefill_buckets=(8, 8, 32)), "prefill_buckets"),
        (dict(decode_batch_buckets=(1, 1, 4)), "VLLM_NEURON_DECODE_BATCH_BUCKETS"),
        (dict(context_buckets=(16, 64, 64)), "VLLM_NEURON_CONTEXT_BUCKETS"),
        (dict(prefill_buckets=(0, 32)), "prefill_buckets"),
        (dict(decode_batch_buckets=(-1, 4)), "decode_batch_buckets"),
        (dict(context_buckets=(0, 64)), "context_buckets"),
        (dict(prefill_buckets=(8, 64)), "--max-num-batched-tokens"),
        (dict(decode_batch_buckets=(1, 8)), "--max-num-seqs"),
        (dict(context_buckets=(16, 56)), "--max-model-len"),
        (dict(context_buckets=(16, 64, 256)), "--max-model-len"),
        (dict(page_tokens=12), "decode_page_tokens(8) = 128"),
        (dict(prefill_tokens_while_decoding=8, mixed_batch_buckets=(3,)), "mixed_batch_buckets"),
        (
            dict(prefill_tokens_while_decoding=8, mixed_batch_buckets=(4,)),
            "no room for the prefilling request",
        ),
        (dict(decode_context_buckets=(64, 16)), "decode_context_buckets"),
        (dict(decode_context_buckets=(0, 64)), "VLLM_NEURON_DECODE_CONTEXT_BUCKETS"),
        (dict(decode_context_buckets=(12, 64)), "decode_context_buckets"),
        (dict(decode_context_buckets=(16, 56)), "--max-model-len"),
        (dict(decode_context_buckets=(64, 72)), "shorten decode_context_buckets"),
        (dict(decode_context_buckets=(16, 256)), "--max-model-len"),
        (dict(context_buckets=(16, 256), decode_context_buckets=(64,)), "--max-model-len"),
    ],
    ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else None,
)
def test_validate_rejects_naming_the_setting(changes, setting):
    with pytest.raises(BucketError) as error:
        validate(**changes)
    assert setting in str(error.value)


def test_validate_rejects_non_integers():
    for bad in [(True, 32), (8.0, 32)]:
        with pytest.raises(BucketError, match="prefill_buckets"):
            validate(prefill_buckets=bad)


def test_validate_context_below_max_model_len_names_the_bucket_to_add():
    with pytest.raises(BucketError, match=r"context bucket >= 64"):
        validate(context_buckets=(16, 56))


def test_validate_rejects_context_not_a_multiple_of_the_block_size():
    with pytest.raises(BucketError, match=r"\[12\].*block size 8"):
        validate(context_buckets=(12, 64))


def test_validate_misaligned_context_names_the_setting():
    with pytest.raises(BucketError) as error:
        validate(context_buckets=(12, 64))
    assert "context_buckets" in str(error.value) or "--block-size" in str(error.value)


def test_validated_buckets_always_have_prefill_shapes():
    buckets = BucketConfig(prefill_buckets=(32, 64), decode_batch_buckets=(1,), context_buckets=(32,))
    limits = dict(max_model_len=32, max_num_seqs=1, max_num_batched_tokens=64, block_size=16)
    try:
        validate_buckets(buckets, **limits)
    except BucketError as error:  # rejecting the unreachable bucket 64 is a fix too
        assert "prefill_buckets" in str(error)
    else:
        assert (32, 32) in buckets.prefill_shapes()
