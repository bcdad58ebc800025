"""kv_cache.ops against contiguous-KV references: paged writes, decode and prefill attention, GQA, tracing;
decode and prefill over a cache in the model's dtype and over an FP8 one (kv_cache/fp8.py)."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kv_cache import fp8
from kv_cache.layout import NULL_BLOCK, allocate, kv_cache_shape
from kv_cache.ops import (
    causal_attention,
    context_mask,
    page_attention,
    page_masks,
    reference_attention,
    table_attention,
    write_kv,
)
from vllm_neuron.buckets import ceil_div

HEAD_SIZE = 8
SCALE = HEAD_SIZE**-0.5
HEADS = [(4, 4), (4, 2), (4, 1), (8, 2)]  # (num_heads, num_kv_heads): GQA ratios 1, 2, 4
BLOCK_SIZES = [4, 16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = list(TOLERANCE)
K_SCALE, V_SCALE = 0.05, 0.02  # randn / scale stays well inside the cache's +-448 x scale, and is not 1.0


@dataclass
class Sequence:
    keys: torch.Tensor  # [length, kv_heads, head_size], contiguous
    values: torch.Tensor
    blocks: torch.Tensor  # [ceil(length / block_size)] distinct non-null block ids, in sequence order

    @property
    def length(self) -> int:
        return self.keys.shape[0]


@dataclass(frozen=True)
class KvDtype:
    """How a cache holds K/V: in the model's dtype (no scales), or FP8 (`--kv-cache-dtype fp8`): a uint8
    cache of e4m3 bits by a layer's key and value scales, written as the attention backend writes it
    (fp8.quantize, then write_kv) and read back dequantized by the attentions, which take the scales."""

    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.k_scale is None else torch.uint8

    def stored(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as the cache holds them."""
        if self.k_scale is None or self.v_scale is None:
            return keys, values
        return fp8.quantize(keys, self.k_scale), fp8.quantize(values, self.v_scale)

    def write(self, kv_cache, key, value, slots) -> None:
        write_kv(kv_cache, *self.stored(key, value), slots)

    def read_back(self, seq: Sequence) -> Sequence:
        """The sequence as attention reads it from the cache: the K/V the reference attends over."""
        stored = self.stored(seq.keys, seq.values)
        keys, values = fp8.dequantized(*stored, self.k_scale, self.v_scale, seq.keys.dtype)
        return Sequence(keys, values, seq.blocks)


MODEL_KV = KvDtype()
FP8_KV = KvDtype(torch.tensor(K_SCALE), torch.tensor(V_SCALE))
KV_DTYPES = {"model": MODEL_KV, "fp8": FP8_KV}


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def make_sequences(gen, lengths, kv_heads, block_size, num_blocks, dtype) -> list[Sequence]:
    """Random K/V per sequence, each on a random, shuffled set of distinct blocks from 1..num_blocks-1."""
    pool = torch.randperm(num_blocks - 1, generator=gen) + 1
    sequences, used = [], 0
    for length in lengths:
        count = ceil_div(length, block_size)
        blocks = pool[used : used + count]
        used += count
        keys = randn(gen, length, kv_heads, HEAD_SIZE, dtype=dtype)
        values = randn(gen, length, kv_heads, HEAD_SIZE, dtype=dtype)
        sequences.append(Sequence(keys, values, blocks))
    assert used <= num_blocks - 1, "pool too small for these lengths"
    return sequences


def slots_of(blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return blocks[positions // block_size] * block_size + positions % block_size


def write_sequence(
    kv_cache, seq: Sequence, block_size: int, start: int = 0, stop: int | None = None, kv=MODEL_KV
):
    positions = torch.arange(start, seq.length if stop is None else stop)
    kv.write(
        kv_cache, seq.keys[positions], seq.values[positions], slots_of(seq.blocks, positions, block_size)
    )


def padded_table(blocks: torch.Tensor, width: int) -> torch.Tensor:
    row = torch.full((width,), NULL_BLOCK, dtype=torch.int64)
    row[: blocks.numel()] = blocks
    return row


def sdpa_attention(query, keys, values, positions, scale):
    """Independent check of reference_attention: SDPA in float64 with K/V repeated per head, explicit mask."""
    group = query.shape[1] // keys.shape[1]
    q = query.double().transpose(0, 1)  # [heads, q, d]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.arange(keys.shape[0]).view(1, -1) <= positions.view(-1, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(query.dtype)


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def expected_attention(query, seq: Sequence, positions, dtype):
    """reference_attention over the sequence's contiguous K/V, itself checked against SDPA."""
    keys, values = seq.keys[: int(positions.max()) + 1], seq.values[: int(positions.max()) + 1]
    expected = reference_attention(query, keys, values, positions, SCALE)
    assert_close(expected, sdpa_attention(query, keys, values, positions, SCALE), dtype)
    return expected


# ---- the reference itself --------------------------------------------------------------------------


@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_reference_matches_sdpa_and_is_causal(heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    length = 11
    query = randn(gen, length, heads, HEAD_SIZE, dtype=torch.float32)
    keys = randn(gen, length, kv_heads, HEAD_SIZE, dtype=torch.float32)
    values = randn(gen, length, kv_heads, HEAD_SIZE, dtype=torch.float32)
    positions = torch.arange(length)

    expected = reference_attention(query, keys, values, positions, SCALE)
    assert_close(expected, sdpa_attention(query, keys, values, positions, SCALE), torch.float32)
    # Position 0 sees only key 0: the output is value 0 of its KV head.
    group = heads // kv_heads
    assert_close(expected[0], values[0].repeat_interleave(group, dim=0), torch.float32)
    # Keys after a query's position do not matter; keys at or before it do.
    changed = keys.clone()
    changed[6:] += 5.0
    altered = reference_attention(query, changed, values, positions, SCALE)
    assert_close(altered[:6], expected[:6], torch.float32)
    assert not torch.allclose(altered[6:], expected[6:])


# ---- write_kv --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_write_kv_writes_exactly_the_targeted_slots(block_size, dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, kv_heads = 6, 2
    kv_cache = randn(gen, *kv_cache_shape(num_blocks, block_size, kv_heads, HEAD_SIZE), dtype=dtype)
    before = kv_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:7]
    key = randn(gen, 7, kv_heads, HEAD_SIZE, dtype=dtype)
    value = randn(gen, 7, kv_heads, HEAD_SIZE, dtype=dtype)

    write_kv(kv_cache, key, value, slots)

    flat = kv_cache.view(2, kv_heads, num_blocks * block_size, HEAD_SIZE)
    assert torch.equal(flat[0][:, slots], key.transpose(0, 1))
    assert torch.equal(flat[1][:, slots], value.transpose(0, 1))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, :, untouched], before.view_as(flat)[:, :, untouched])
    # The slot formula is block * block_size + offset.
    block, offset = int(slots[0]) // block_size, int(slots[0]) % block_size
    assert torch.equal(kv_cache[:kv_heads, block, offset], key[0])
    assert torch.equal(kv_cache[kv_heads:, block, offset], value[0])


# ---- decode ----------------------------------------------------------------------------------------

BLOCKS_PER_PAGE = 2


@dataclass
class DecodeCase:
    kv_cache: torch.Tensor
    sequences: list[Sequence]
    query: torch.Tensor  # [rows, heads, d]: one query per row, rows past the sequences are batch padding
    positions: torch.Tensor  # [rows]
    page_blocks: torch.Tensor  # [pages, BLOCKS_PER_PAGE]
    page_rows: torch.Tensor  # [pages]
    page_starts: torch.Tensor  # [pages]
    kv: KvDtype = MODEL_KV

    def attend(self, **changes) -> torch.Tensor:
        fields = {name: getattr(self, name) for name in ("page_blocks", "page_rows", "page_starts")}
        fields |= {"positions": self.positions, "k_scale": self.kv.k_scale, "v_scale": self.kv.v_scale}
        fields |= changes
        return page_attention(
            self.query,
            self.kv_cache,
            fields["page_blocks"],
            fields["page_rows"],
            fields["page_starts"],
            fields["positions"],
            SCALE,
            k_scale=fields["k_scale"],
            v_scale=fields["v_scale"],
        )


def decode_pages(sequences, block_size, num_padding_pages, gen):
    """Each sequence's blocks cut into pages of BLOCKS_PER_PAGE (the last one null-padded), pages of all rows
    shuffled together (a row combines its pages in any order), then padding pages that start past every
    position."""
    page_tokens = BLOCKS_PER_PAGE * block_size
    blocks, rows, starts = [], [], []
    for row, seq in enumerate(sequences):
        for first in range(0, seq.blocks.numel(), BLOCKS_PER_PAGE):
            blocks.append(padded_table(seq.blocks[first : first + BLOCKS_PER_PAGE], BLOCKS_PER_PAGE))
            rows.append(row)
            starts.append(first // BLOCKS_PER_PAGE * page_tokens)
    order = torch.randperm(len(rows), generator=gen).tolist()
    blocks = [blocks[i] for i in order] + [
        padded_table(torch.tensor([]), BLOCKS_PER_PAGE)
    ] * num_padding_pages
    rows = [rows[i] for i in order] + [0] * num_padding_pages
    starts = [starts[i] for i in order] + [2**30] * num_padding_pages
    return torch.stack(blocks), torch.tensor(rows), torch.tensor(starts)


def decode_case(heads, kv_heads, block_size, dtype, seed=2, num_padded_rows=2, kv=MODEL_KV) -> DecodeCase:
    """A cache holding several sequences and a padded decode batch (query at seq_len - 1) over their pages;
    the case's sequences are as attention reads them back from the cache (kv)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6 * block_size, (5,), generator=gen).tolist()
    lengths[0] = 1  # a sequence of a single token
    lengths[1] = 3 * block_size  # exactly full blocks, an odd number of them: a half-empty last page
    lengths[2] = 4 * block_size + 1  # one position into a new page
    num_blocks = 1 + sum(ceil_div(n, block_size) for n in lengths) + 3
    kv_cache = allocate(
        num_blocks, block_size, kv_heads, HEAD_SIZE, kv.cache_dtype(dtype), torch.device("cpu")
    )
    sequences = make_sequences(gen, lengths, kv_heads, block_size, num_blocks, dtype)
    for seq in sequences:
        write_sequence(kv_cache, seq, block_size, kv=kv)
    sequences = [kv.read_back(seq) for seq in sequences]
    # Garbage in the null block: padding pages and a row's null-padded last page must not read it.
    garbage = torch.full((kv_heads, block_size, HEAD_SIZE), 7.0, dtype=dtype)
    kv_cache[:kv_heads, NULL_BLOCK], kv_cache[kv_heads:, NULL_BLOCK] = kv.stored(garbage, garbage)
    rows = len(sequences) + num_padded_rows
    query = randn(gen, rows, heads, HEAD_SIZE, dtype=dtype)
    positions = torch.zeros(rows, dtype=torch.int64)
    positions[: len(sequences)] = torch.tensor([seq.length - 1 for seq in sequences])
    pages = decode_pages(sequences, block_size, num_padding_pages=3, gen=gen)
    return DecodeCase(kv_cache, sequences, query, positions, *pages, kv)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_decode_matches_contiguous_reference(heads, kv_heads, block_size, dtype, kv_dtype):
    """Decode over the cache equals naive attention over each sequence's K/V as the cache holds them (FP8:
    the dequantized K/V, the scales passed); the output in the query's dtype whatever the cache's."""
    case = decode_case(heads, kv_heads, block_size, dtype, kv=KV_DTYPES[kv_dtype])

    out = case.attend()

    assert out.shape == case.query.shape and out.dtype == dtype
    for row, seq in enumerate(case.sequences):
        position = case.positions[row : row + 1]
        expected = expected_attention(case.query[row : row + 1], seq, position, dtype)
        assert_close(out[row], expected[0], dtype)
    # Batch padding rows own no page: zeros, not NaN.
    padded = out[len(case.sequences) :]
    assert torch.equal(padded, torch.zeros_like(padded))


def test_decode_pages_equal_the_block_table_path():
    """Decode over pages and table_attention over padded block tables (the prefill path) agree."""
    case = decode_case(8, 2, 4, torch.float32, num_padded_rows=0)
    width = max(seq.blocks.numel() for seq in case.sequences) + 1
    table = torch.stack([padded_table(seq.blocks, width) for seq in case.sequences])
    query, positions = case.query.unsqueeze(1), case.positions.view(-1, 1)
    expected = table_attention(query, case.kv_cache, table, positions, SCALE)
    torch.testing.assert_close(case.attend(), expected[:, 0])


def test_decode_depends_on_blocks_rows_and_position():
    """The inputs discriminate: a foreign block, a page given to another row, or a wrong position gives a
    different answer. (A decode query sees its whole context, so reordering its pages changes nothing.)"""
    case = decode_case(4, 2, 4, torch.float32)
    out = case.attend()
    row = 1
    page = int((case.page_rows == row).nonzero()[0])
    foreign = case.page_blocks.clone()
    foreign[page, 0] = case.sequences[2].blocks[0]
    assert not torch.allclose(case.attend(page_blocks=foreign)[row], out[row])
    moved = case.page_rows.clone()
    moved[page] = 3
    changed = case.attend(page_rows=moved)
    assert not torch.allclose(changed[row], out[row]) and not torch.allclose(changed[3], out[3])
    earlier = case.positions.clone()
    earlier[row] -= 1
    assert not torch.allclose(case.attend(positions=earlier)[row], out[row])


# ---- prefill ---------------------------------------------------------------------------------------


def prefill_case(
    heads,
    kv_heads,
    block_size,
    dtype,
    start,
    count,
    seed=3,
    token_bucket=None,
    width=None,
    num_blocks=None,
    kv=MODEL_KV,
):
    """One sequence's chunk (positions start..start+count-1) over its cached prefix, padded to a bucket.

    Other sequences share the cache so a wrong block read shows; padded slots write garbage to slot 0 of
    the null block, as the model runner does. The chunk's keys and values are the step's (write_then_attend
    stores them as kv holds them); the sequence returned is as attention reads it back from the cache.
    """
    gen = torch.Generator().manual_seed(seed)
    token_bucket = token_bucket or count + 3
    length = start + count
    others = torch.randint(1, 3 * block_size, (3,), generator=gen).tolist()
    lengths = [length, *others]
    width = width or ceil_div(length, block_size) + 2
    num_blocks = num_blocks or 1 + sum(ceil_div(n, block_size) for n in lengths) + 2
    kv_cache = allocate(
        num_blocks, block_size, kv_heads, HEAD_SIZE, kv.cache_dtype(dtype), torch.device("cpu")
    )
    seq, *rest = make_sequences(gen, lengths, kv_heads, block_size, num_blocks, dtype)
    for other in rest:
        write_sequence(kv_cache, other, block_size, kv=kv)
    write_sequence(kv_cache, seq, block_size, stop=start, kv=kv)  # the cached prefix

    positions = torch.zeros(token_bucket, dtype=torch.int64)
    positions[:count] = torch.arange(start, length)
    slots = torch.full((token_bucket,), NULL_BLOCK * block_size, dtype=torch.int64)
    slots[:count] = slots_of(seq.blocks, positions[:count], block_size)
    chunk_keys = randn(gen, token_bucket, kv_heads, HEAD_SIZE, dtype=dtype)
    chunk_values = randn(gen, token_bucket, kv_heads, HEAD_SIZE, dtype=dtype)
    chunk_keys[:count], chunk_values[:count] = seq.keys[start:], seq.values[start:]
    query = randn(gen, 1, token_bucket, heads, HEAD_SIZE, dtype=dtype)
    block_table = padded_table(seq.blocks, width).view(1, width)
    inputs = (kv_cache, chunk_keys, chunk_values, slots, query, block_table, positions.view(1, -1))
    return kv.read_back(seq), inputs


def write_then_attend(kv_cache, key, value, slots, query, block_table, positions, kv=MODEL_KV):
    """A prefill layer's cache work: store the step's keys and values, then attend over the block table."""
    kv.write(kv_cache, key, value, slots)
    return table_attention(
        query, kv_cache, block_table, positions, SCALE, k_scale=kv.k_scale, v_scale=kv.v_scale
    )


@pytest.mark.parametrize(
    "start, count", [(0, 7), (5, 6), (13, 9)], ids=["no-prefix", "prefix", "long-prefix"]
)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_prefill_chunk_matches_contiguous_reference(
    heads, kv_heads, block_size, dtype, kv_dtype, start, count
):
    """A chunk written and attended over its cached prefix equals naive attention over the sequence's K/V as
    the cache holds them (FP8: the dequantized K/V, the scales passed)."""
    kv = KV_DTYPES[kv_dtype]
    seq, inputs = prefill_case(heads, kv_heads, block_size, dtype, start, count, kv=kv)
    query, positions = inputs[4], inputs[6]

    out = write_then_attend(*inputs, kv=kv)

    assert out.shape == query.shape and out.dtype == dtype
    expected = expected_attention(query[0, :count], seq, positions[0, :count], dtype)
    assert_close(out[0, :count], expected, dtype)
    assert torch.isfinite(out[0, count:].float()).all()


def test_prefill_reads_the_chunk_written_in_the_same_call():
    """Without the chunk's own write, attention at the chunk positions would differ (keys are read back)."""
    seq, inputs = prefill_case(4, 2, 4, torch.float32, start=5, count=6)
    kv_cache, _, _, _, query, block_table, positions = inputs
    stale = table_attention(query, kv_cache.clone(), block_table, positions, SCALE)
    out = write_then_attend(*inputs)
    assert not torch.allclose(stale[0, :6], out[0, :6])


def test_prefill_depends_on_block_order():
    """Causal queries see a prefix of the context, so swapping two of the row's blocks changes them."""
    seq, inputs = prefill_case(4, 2, 4, torch.float32, start=0, count=12)
    kv_cache, key, value, slots, query, block_table, positions = inputs
    out = write_then_attend(*inputs)
    swapped = block_table.clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    altered = table_attention(query, kv_cache, swapped, positions, SCALE)
    assert not torch.allclose(altered[0, :8], out[0, :8])
    torch.testing.assert_close(altered[0, 8:12], out[0, 8:12])  # queries that see both blocks agree


# ---- an FP8 cache ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_an_fp8_cache_is_read_with_its_scales(path):
    """The "fp8" cases above can fail on the scales: attention over the raw e4m3 values (scales of 1), or
    with the key and value scales swapped, differs from attention with the layer's own."""
    ones = torch.tensor(1.0)
    wrong = [(ones, ones), (FP8_KV.v_scale, FP8_KV.k_scale)]
    if path == "decode":
        case = decode_case(4, 2, 4, torch.float32, kv=FP8_KV)
        kv_cache, rows = case.kv_cache, len(case.sequences)
        out = case.attend()[:rows]
        others = [case.attend(k_scale=k, v_scale=v)[:rows] for k, v in wrong]
    else:
        _, inputs = prefill_case(4, 2, 4, torch.float32, start=5, count=6, kv=FP8_KV)
        kv_cache, _, _, _, query, block_table, positions = inputs
        out = write_then_attend(*inputs, kv=FP8_KV)[0, :6]
        others = [
            table_attention(query, kv_cache, block_table, positions, SCALE, k_scale=k, v_scale=v)[0, :6]
            for k, v in wrong
        ]
    assert kv_cache.dtype == torch.uint8
    for other in others:
        assert not torch.allclose(other, out)


# ---- sliding window and soft-capping ---------------------------------------------------------------

WINDOW_AND_CAP = [(5, None), (None, 0.5), (9, 0.5)]  # window shorter than a block, a cap that binds, both


def test_reference_window_and_cap_change_the_answer():
    """The reference's window drops exactly the keys before position - window + 1, and the cap binds."""
    gen = torch.Generator().manual_seed(4)
    keys, values = randn(gen, 2, 12, 2, HEAD_SIZE, dtype=torch.float32)
    query = randn(gen, 1, 4, HEAD_SIZE, dtype=torch.float32)
    position = torch.tensor([11])
    windowed = reference_attention(query, keys, values, position, SCALE, window=5)
    torch.testing.assert_close(
        windowed, reference_attention(query, keys[7:], values[7:], position - 7, SCALE)
    )
    assert not torch.allclose(windowed, reference_attention(query, keys, values, position, SCALE))
    capped = reference_attention(query, keys, values, position, SCALE, soft_cap=0.5)
    assert not torch.allclose(capped, reference_attention(query, keys, values, position, SCALE))


@pytest.mark.parametrize("window, soft_cap", WINDOW_AND_CAP)
@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_decode_window_and_cap_match_reference(heads, kv_heads, window, soft_cap):
    case = decode_case(heads, kv_heads, 4, torch.float32)
    page_tokens = BLOCKS_PER_PAGE * 4
    masks = page_masks(case.page_rows, case.page_starts, case.positions, page_tokens, window)
    out = page_attention(
        case.query,
        case.kv_cache,
        case.page_blocks,
        case.page_rows,
        case.page_starts,
        case.positions,
        SCALE,
        masks,
        soft_cap,
    )
    for row, seq in enumerate(case.sequences):
        position = case.positions[row : row + 1]
        expected = reference_attention(
            case.query[row : row + 1], seq.keys, seq.values, position, SCALE, window, soft_cap
        )
        assert_close(out[row], expected[0], torch.float32)


@pytest.mark.parametrize("window, soft_cap", WINDOW_AND_CAP)
@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_prefill_window_and_cap_match_reference(heads, kv_heads, window, soft_cap):
    seq, inputs = prefill_case(heads, kv_heads, 4, torch.float32, start=13, count=9)
    kv_cache, key, value, slots, query, block_table, positions = inputs
    write_kv(kv_cache, key, value, slots)
    context = block_table.shape[1] * 4
    mask = context_mask(positions, context, heads // kv_heads, query.dtype, window=window)
    out = table_attention(query, kv_cache, block_table, positions, SCALE, mask, soft_cap)
    expected = reference_attention(
        query[0, :9], seq.keys, seq.values, positions[0, :9], SCALE, window, soft_cap
    )
    assert_close(out[0, :9], expected, torch.float32)


# ---- fresh prefill: a chunk over its own keys -----------------------------------------------------


@pytest.mark.parametrize("window, soft_cap", [(None, None), *WINDOW_AND_CAP])
@pytest.mark.parametrize("heads, kv_heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_chunk_matches_reference_padding_after_it(heads, kv_heads, dtype, window, soft_cap):
    """A fresh prefill call's attention: its real tokens first, padding after them that no real query sees
    (the padding's keys are garbage here, large ones, and must not leak into the real rows)."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    tokens, real = 32, 23
    query = torch.randn(tokens, heads, HEAD_SIZE, generator=gen).to(dtype)
    key = torch.randn(tokens, kv_heads, HEAD_SIZE, generator=gen).to(dtype)
    value = torch.randn(tokens, kv_heads, HEAD_SIZE, generator=gen).to(dtype)
    key[real:] *= 100
    value[real:] *= 100
    out = causal_attention(query, key, value, SCALE, window, soft_cap)
    assert out.shape == query.shape and out.dtype == dtype
    expected = reference_attention(
        query[:real], key[:real], value[:real], torch.arange(real), SCALE, window, soft_cap
    )
    assert_close(out[:real], expected, dtype)


def test_fresh_chunk_equals_the_table_path_over_the_cache():
    """The fresh form and the masked form over the same chunk written to the cache give the same rows."""
    seq, inputs = prefill_case(4, 2, 4, torch.float32, start=0, count=16)
    kv_cache, key, value, slots, query, block_table, positions = inputs
    write_kv(kv_cache, key, value, slots)
    table = table_attention(query, kv_cache, block_table, positions, SCALE)
    fresh = causal_attention(query[0], key, value, SCALE)
    assert_close(fresh[:16], table[0, :16], torch.float32)


# ---- tracing ---------------------------------------------------------------------------------------


def clone_inputs(inputs):
    return tuple(t.clone() for t in inputs)


def write_then_decode(kv_cache, key, value, slots, query, blocks, rows, starts, positions):
    write_kv(kv_cache, key, value, slots)
    return page_attention(query, kv_cache, blocks, rows, starts, positions, SCALE)


@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_compiled_fullgraph_matches_eager(case):
    if case == "decode":
        decode = decode_case(8, 2, 4, torch.float32)
        rows = decode.query.shape[0]
        key = torch.randn(rows, 2, HEAD_SIZE)
        value = torch.randn(rows, 2, HEAD_SIZE)
        slots = torch.arange(rows) + 4  # somewhere in block 1
        pages = (decode.page_blocks, decode.page_rows, decode.page_starts)
        inputs = (decode.kv_cache, key, value, slots, decode.query, *pages, decode.positions)
        function = write_then_decode
    else:
        _, inputs = prefill_case(8, 2, 4, torch.float32, start=5, count=6)
        function = write_then_attend

    eager_inputs = clone_inputs(inputs)
    expected = function(*eager_inputs)
    compiled = torch.compile(function, backend="eager", fullgraph=True, dynamic=False)
    out = compiled(*inputs)

    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(inputs[0], eager_inputs[0])  # the cache write happened in the graph too


def test_new_values_same_shapes_do_not_recompile():
    graphs = 0

    def backend(gm, example_inputs):
        nonlocal graphs
        graphs += 1
        return gm.forward

    compiled = torch.compile(write_then_attend, backend=backend, fullgraph=True, dynamic=False)
    # Same shapes, different block tables, positions, slots and values (different seed and prefix length).
    for seed, start in [(3, 5), (4, 9), (5, 1)]:
        _, inputs = prefill_case(
            8, 2, 4, torch.float32, start, count=6, seed=seed, token_bucket=8, width=6, num_blocks=20
        )
        eager_inputs = clone_inputs(inputs)
        torch.testing.assert_close(compiled(*inputs), write_then_attend(*eager_inputs))
        torch.testing.assert_close(inputs[0], eager_inputs[0])
    assert graphs == 1
