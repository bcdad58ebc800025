"""worker.step.call_inputs: bucket-shaped, padded host inputs of decode and prefill calls."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kv_cache import ops
from kv_cache.layout import NULL_BLOCK, allocate
from kv_cache.ops import page_attention, table_attention, write_kv
from vllm_neuron.attention_backend import NeuronAttentionImpl
from vllm_neuron.buckets import PACKED_CHUNKS, ceil_div
from worker.step.call_inputs import (
    CallInputs,
    Chunk,
    HostInputs,
    StagingBuffers,
    decode_inputs,
    mixed_inputs,
    prefill_inputs,
    verify_inputs,
)

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def block_row(*blocks: int, width: int = 6) -> np.ndarray:
    """A request's block ids, zero past its allocation (as in the persistent batch's block table)."""
    row = np.zeros(width, dtype=np.int32)
    row[: len(blocks)] = blocks
    return row


def expected_slot(row: np.ndarray, position: int) -> int:
    return int(row[position // BLOCK_SIZE]) * BLOCK_SIZE + position % BLOCK_SIZE


def expected_table_row(row: np.ndarray, end: int, num_blocks: int) -> list[int]:
    """The blocks of a context of `end` positions, then the null block up to the context bucket."""
    ids = [int(b) for b in row[: ceil_div(end, BLOCK_SIZE)]]
    return ids + [0] * (num_blocks - len(ids))


def sent(host: HostInputs) -> SimpleNamespace:
    """A call's inputs as sent to the device, beside the host's figures (real rows, decode tokens)."""
    inputs = host.send(StagingBuffers(CPU))
    return SimpleNamespace(
        **vars(inputs), num_real_rows=host.num_real_rows, decode_token_index=host.decode_token_index
    )


def assert_int64_cpu(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        assert tensor.dtype == torch.int64 and tensor.device == CPU


DECODE_CHUNKS = [
    Chunk(np.array([11], dtype=np.int32), 0, block_row(5)),  # first token of block 5
    Chunk(np.array([22], dtype=np.int32), 9, block_row(8, 2, 7)),  # offset 1 of its third block
    Chunk(np.array([33], dtype=np.int32), 7, block_row(3, 12)),  # last slot of its second block
]


PAGE_TOKENS = 2 * BLOCK_SIZE


def tensors_of(meta) -> list[torch.Tensor]:
    parts = [meta, *(part for part in (meta.table, meta.paged) if part is not None)]
    return [value for part in parts for value in vars(part).values() if isinstance(value, torch.Tensor)]


@pytest.mark.parametrize("num_pages", [4, 9], ids=["exact", "padding-pages"])
@pytest.mark.parametrize("batch_bucket", [3, 8])
def test_decode_inputs(batch_bucket, num_pages):
    chunks = DECODE_CHUNKS

    inputs = sent(
        decode_inputs(
            chunks,
            batch_bucket=batch_bucket,
            num_pages=num_pages,
            page_tokens=PAGE_TOKENS,
            block_size=BLOCK_SIZE,
        )
    )
    meta, paged = inputs.metadata, inputs.metadata.paged

    assert inputs.input_ids.shape == (batch_bucket,)
    assert inputs.positions.shape == (batch_bucket,)
    assert paged.positions.shape == (batch_bucket,)
    assert meta.slot_mapping.shape == (batch_bucket,)
    assert meta.table is None
    assert paged.page_blocks.shape == (num_pages, 2)
    assert paged.page_rows.shape == paged.page_starts.shape == (num_pages,)
    assert_int64_cpu(inputs.input_ids, inputs.positions, inputs.logits_indices, *tensors_of(meta))
    assert inputs.num_real_rows == len(chunks)
    # Every row's logits are computed (static shape); the first num_real_rows are the requests, in order.
    assert inputs.logits_indices.tolist() == list(range(batch_bucket))
    assert torch.equal(paged.positions, inputs.positions)

    assert inputs.decode_token_index.tolist() == list(range(len(chunks)))
    for row, chunk in enumerate(chunks):
        assert inputs.input_ids[row] == chunk.token_ids[0]
        assert inputs.positions[row] == chunk.start
        assert meta.slot_mapping[row] == expected_slot(chunk.block_row, chunk.start)
    # Pages in row order, each row as many as its context (position + 1) needs, null-padded at the end.
    assert paged.page_rows[:4].tolist() == [0, 1, 1, 2]
    assert paged.page_starts[:4].tolist() == [0, 0, PAGE_TOKENS, 0]
    assert paged.page_blocks[:4].tolist() == [[5, 0], [8, 2], [7, 0], [3, 12]]
    # Padding pages read the null block and start past every position; padding rows own no page.
    assert not paged.page_blocks[4:].any() and not paged.page_rows[4:].any()
    assert (paged.page_starts[4:] > 2**20).all()
    padding = slice(len(chunks), None)
    assert not inputs.input_ids[padding].any()
    assert not inputs.positions[padding].any()
    assert ((meta.slot_mapping[padding] >= 0) & (meta.slot_mapping[padding] < BLOCK_SIZE)).all()


def test_a_lone_decode_row_attends_over_its_own_blocks():
    """Batch bucket 1 shares no pages: the row's first num_pages pages of blocks, as a block table."""
    chunk = DECODE_CHUNKS[1]  # position 9 of blocks 8, 2, 7
    inputs = sent(
        decode_inputs([chunk], batch_bucket=1, num_pages=3, page_tokens=PAGE_TOKENS, block_size=BLOCK_SIZE)
    )
    meta = inputs.metadata
    assert meta.paged is None and meta.table.block_table.tolist() == [[8, 2, 7, 0, 0, 0]]
    assert not meta.table.first_keys.any()
    assert inputs.input_ids.tolist() == [22] and meta.table.positions.tolist() == [[9]]
    assert meta.slot_mapping.tolist() == [expected_slot(chunk.block_row, 9)]
    assert inputs.logits_indices.tolist() == [0] and inputs.num_real_rows == 1
    assert inputs.decode_token_index.tolist() == [0]
    with pytest.raises(ValueError, match="do not fit a context bucket of 8"):
        sent(
            decode_inputs(
                [chunk], batch_bucket=1, num_pages=1, page_tokens=PAGE_TOKENS, block_size=BLOCK_SIZE
            )
        )


def test_decode_inputs_refuse_rows_beyond_the_pages():
    with pytest.raises(ValueError, match="need 4 KV pages, the call has 3"):
        sent(
            decode_inputs(
                DECODE_CHUNKS, batch_bucket=3, num_pages=3, page_tokens=PAGE_TOKENS, block_size=BLOCK_SIZE
            )
        )


def test_decode_inputs_does_not_alias_the_block_row():
    chunk = Chunk(np.array([1]), 2, block_row(4, 5))
    inputs = sent(
        decode_inputs(
            [chunk, chunk], batch_bucket=2, num_pages=2, page_tokens=PAGE_TOKENS, block_size=BLOCK_SIZE
        )
    )
    chunk.block_row[0] = 99
    assert inputs.metadata.paged.page_blocks[0].tolist() == [4, 5]


@pytest.mark.parametrize(
    "start, count, token_bucket, context_bucket",
    [
        (0, 5, 8, 8),  # whole prompt, padded tokens
        (0, 8, 8, 8),  # exact fit: no padding
        (6, 5, 8, 12),  # cached prefix, chunk crosses a block boundary
        (6, 5, 16, 32),  # context bucket wider than the request's block row
        (3, 1, 4, 4),  # a one-token chunk
    ],
)
def test_prefill_inputs(start, count, token_bucket, context_bucket):
    row = block_row(9, 4, 13, 2, width=5)
    tokens = np.arange(100, 100 + count, dtype=np.int32)
    num_blocks = context_bucket // BLOCK_SIZE

    inputs = sent(
        prefill_inputs(
            [Chunk(tokens, start, row)],
            token_bucket=token_bucket,
            context_bucket=context_bucket,
            block_size=BLOCK_SIZE,
        )
    )
    meta, table = inputs.metadata, inputs.metadata.table

    assert meta.paged is None
    assert inputs.input_ids.shape == (token_bucket,)
    assert inputs.positions.shape == (token_bucket,)
    assert table.positions.shape == (1, token_bucket)
    assert meta.slot_mapping.shape == (token_bucket,)
    assert table.block_table.shape == (1, num_blocks)
    assert_int64_cpu(inputs.input_ids, inputs.positions, inputs.logits_indices, *tensors_of(meta))
    assert inputs.num_real_rows == 1
    # The last real token; every prefill call keeps PACKED_CHUNKS rows, the padding ones at row 0.
    assert inputs.logits_indices.tolist() == [count - 1] + [0] * (PACKED_CHUNKS - 1)
    assert torch.equal(table.positions[0], inputs.positions) and not table.first_keys.any()

    positions = list(range(start, start + count))
    assert inputs.input_ids[:count].tolist() == tokens.tolist()
    assert inputs.positions[:count].tolist() == positions
    assert meta.slot_mapping[:count].tolist() == [expected_slot(row, p) for p in positions]
    assert table.block_table[0].tolist() == expected_table_row(row, start + count, num_blocks)
    assert not inputs.input_ids[count:].any()
    assert not inputs.positions[count:].any()
    assert ((meta.slot_mapping[count:] >= 0) & (meta.slot_mapping[count:] < BLOCK_SIZE)).all()


PACKED = [
    Chunk(np.arange(100, 105, dtype=np.int32), 0, block_row(9, 4)),  # a 5-token prompt: 2 blocks
    Chunk(np.arange(200, 203, dtype=np.int32), 6, block_row(3, 12, 5)),  # after a cached prefix: 3 blocks
    Chunk(np.arange(300, 302, dtype=np.int32), 0, block_row(7)),  # 1 block
]


def test_prefill_inputs_pack_chunks_each_over_its_own_segment():
    inputs = sent(prefill_inputs(PACKED, token_bucket=16, context_bucket=32, block_size=BLOCK_SIZE))
    meta, table = inputs.metadata, inputs.metadata.table
    assert inputs.input_ids[:10].tolist() == [*range(100, 105), *range(200, 203), 300, 301]
    assert inputs.positions[:10].tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 0, 1]  # rotary: their own positions
    # Context segments in whole blocks, in chunk order: [9, 4], [3, 12, 5], [7], then the null block.
    assert table.block_table[0].tolist() == [9, 4, 3, 12, 5, 7, 0, 0]
    assert table.first_keys[0, :10].tolist() == [0] * 5 + [8] * 3 + [20] * 2
    assert table.positions[0, :10].tolist() == [0, 1, 2, 3, 4, 14, 15, 16, 20, 21]
    slots = [
        expected_slot(chunk.block_row, p)
        for chunk in PACKED
        for p in range(chunk.start, chunk.start + len(chunk.token_ids))
    ]
    assert meta.slot_mapping[:10].tolist() == slots
    assert inputs.logits_indices.tolist() == [4, 7, 9] + [0] * (PACKED_CHUNKS - 3)
    assert inputs.num_real_rows == 3
    assert not inputs.input_ids[10:].any() and not table.first_keys[0, 10:].any()


@pytest.mark.parametrize(
    "token_bucket, context_bucket, message",
    [(8, 32, "beside 8 tokens"), (16, 20, "do not fit a context bucket of 20")],
)
def test_prefill_inputs_refuse_a_pack_beyond_the_buckets(token_bucket, context_bucket, message):
    with pytest.raises(ValueError, match=message):
        sent(
            prefill_inputs(
                PACKED, token_bucket=token_bucket, context_bucket=context_bucket, block_size=BLOCK_SIZE
            )
        )
    with pytest.raises(ValueError, match="keeps 8 logits rows"):
        sent(prefill_inputs(PACKED * 3, token_bucket=64, context_bucket=128, block_size=BLOCK_SIZE))


def test_packed_chunks_attend_as_each_alone():
    """Each packed chunk sees its own cached prefix and itself, causally, and nothing of the others:
    outputs and cache writes equal those of the chunks run one call each."""
    heads, kv_heads, head_size = 4, 2, 8
    impl = NeuronAttentionImpl(heads, head_size, head_size**-0.5, num_kv_heads=kv_heads)
    gen = torch.Generator().manual_seed(5)
    kv_cache = allocate(16, BLOCK_SIZE, kv_heads, head_size, torch.float32, CPU)
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen))  # the second chunk's prefix, and stale keys
    packed = sent(prefill_inputs(PACKED, token_bucket=16, context_bucket=32, block_size=BLOCK_SIZE))
    query = torch.randn(16, heads, head_size, generator=gen)
    key, value = torch.randn(2, 16, kv_heads, head_size, generator=gen)

    def attend(cache, inputs, rows):
        tokens = inputs.input_ids.shape[0]
        padded = [torch.zeros(tokens, *t.shape[1:]) for t in (query, key, value)]
        for tensor, source in zip(padded, (query, key, value), strict=True):
            tensor[: len(range(*rows.indices(16)))] = source[rows]
        output = torch.empty(tokens, heads, head_size)
        impl.forward(None, *padded, cache, inputs.metadata, output)
        return output[: len(range(*rows.indices(16)))]

    separate_cache, separate, first = kv_cache.clone(), [], 0
    for chunk in PACKED:
        count = len(chunk.token_ids)
        alone = sent(prefill_inputs([chunk], token_bucket=8, context_bucket=16, block_size=BLOCK_SIZE))
        separate.append(attend(separate_cache, alone, slice(first, first + count)))
        first += count
    together = attend(kv_cache, packed, slice(0, 10))
    torch.testing.assert_close(together, torch.cat(separate))
    torch.testing.assert_close(kv_cache, separate_cache)


def test_mixed_inputs_put_the_chunk_first_then_the_decode_rows():
    chunk = Chunk(np.arange(100, 105, dtype=np.int32), 6, block_row(9, 4, 13))
    inputs = sent(
        mixed_inputs(
            chunk,
            DECODE_CHUNKS,
            token_bucket=8,
            context_bucket=16,
            batch_bucket=4,
            num_pages=5,
            page_tokens=PAGE_TOKENS,
            block_size=BLOCK_SIZE,
        )
    )
    meta, table, paged = inputs.metadata, inputs.metadata.table, inputs.metadata.paged
    alone_chunk = sent(prefill_inputs([chunk], token_bucket=8, context_bucket=16, block_size=BLOCK_SIZE))
    alone_decode = sent(
        decode_inputs(
            DECODE_CHUNKS, batch_bucket=4, num_pages=5, page_tokens=PAGE_TOKENS, block_size=BLOCK_SIZE
        )
    )

    assert_int64_cpu(inputs.input_ids, inputs.positions, inputs.logits_indices, *tensors_of(meta))
    # Tokens, positions and slots: the chunk's 8 (padded), then the 4 decode rows, each as alone.
    for name in ("input_ids", "positions"):
        both = torch.cat([getattr(alone_chunk, name), getattr(alone_decode, name)])
        assert torch.equal(getattr(inputs, name), both)
    # Each decode row's token, where a step whose previous tokens are still on the device writes it.
    decode_tokens = inputs.input_ids[inputs.decode_token_index].tolist()
    assert decode_tokens == [chunk.token_ids[0] for chunk in DECODE_CHUNKS]
    assert alone_chunk.decode_token_index.size == 0
    both = torch.cat([alone_chunk.metadata.slot_mapping, alone_decode.metadata.slot_mapping])
    assert torch.equal(meta.slot_mapping, both)
    for part, alone in ((table, alone_chunk.metadata.table), (paged, alone_decode.metadata.paged)):
        assert part.masks == alone.masks == {}  # built by the first layer that attends
        for name, value in vars(part).items():
            if name != "masks":
                assert torch.equal(value, getattr(alone, name)), name
    # Logits: the chunk's last token, then every decode row; the real ones (chunk + 3 rows) come first.
    assert inputs.logits_indices.tolist() == [4, 8, 9, 10, 11]
    assert inputs.num_real_rows == 4


def test_padded_inputs_give_finite_attention():
    """The padding conventions hold up in the kernels: padded rows, queries and pages produce no NaN."""
    kv_cache = allocate(16, BLOCK_SIZE, 2, 8, torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    decode = sent(
        decode_inputs(
            DECODE_CHUNKS, batch_bucket=8, num_pages=9, page_tokens=PAGE_TOKENS, block_size=BLOCK_SIZE
        )
    )
    prefill = sent(
        prefill_inputs(
            [Chunk(np.arange(1, 6), 6, block_row(9, 4, 13))],
            token_bucket=8,
            context_bucket=16,
            block_size=BLOCK_SIZE,
        )
    )
    for inputs in (prefill, decode):
        meta = inputs.metadata
        tokens = meta.slot_mapping.shape[0]
        key, value = torch.randn(2, tokens, 2, 8, generator=gen)
        write_kv(kv_cache, key, value, meta.slot_mapping)
        if meta.table is not None:
            query = torch.randn(1, tokens, 4, 8, generator=gen)
            table = meta.table
            out = table_attention(query, kv_cache, table.block_table, table.positions, 8**-0.5)
        else:
            query = torch.randn(tokens, 4, 8, generator=gen)
            paged = meta.paged
            pages = (paged.page_blocks, paged.page_rows, paged.page_starts)
            out = page_attention(query, kv_cache, *pages, paged.positions, 8**-0.5)
        assert out.numel() == query.numel()
        assert torch.isfinite(out).all()


def test_a_mixed_call_attends_like_its_parts_alone():
    """The attention backend splits a mixed call's queries: the chunk over its block table, the decode rows
    over their pages; outputs and cache writes equal those of the two calls run separately."""
    heads, kv_heads, head_size = 4, 2, 8
    impl = NeuronAttentionImpl(heads, head_size, head_size**-0.5, num_kv_heads=kv_heads)
    gen = torch.Generator().manual_seed(3)
    kv_cache = allocate(16, BLOCK_SIZE, kv_heads, head_size, torch.float32, CPU)
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen))
    chunk = Chunk(np.arange(100, 105, dtype=np.int32), 6, block_row(9, 4, 13))
    parts = [
        sent(prefill_inputs([chunk], token_bucket=8, context_bucket=16, block_size=BLOCK_SIZE)),
        sent(
            decode_inputs(
                DECODE_CHUNKS, batch_bucket=4, num_pages=5, page_tokens=PAGE_TOKENS, block_size=BLOCK_SIZE
            )
        ),
    ]
    mixed = sent(
        mixed_inputs(
            chunk,
            DECODE_CHUNKS,
            token_bucket=8,
            context_bucket=16,
            batch_bucket=4,
            num_pages=5,
            page_tokens=PAGE_TOKENS,
            block_size=BLOCK_SIZE,
        )
    )
    tokens = mixed.input_ids.shape[0]
    # Shaped as vLLM's Attention layer hands them to the backend.
    query = torch.randn(tokens, heads, head_size, generator=gen)
    key, value = torch.randn(2, tokens, kv_heads, head_size, generator=gen)

    def attend(cache, inputs, rows):
        output = torch.empty(len(range(*rows.indices(tokens))), heads, head_size)
        impl.forward(None, query[rows], key[rows], value[rows], cache, inputs.metadata, output)
        return output

    separate_cache = kv_cache.clone()
    separate = torch.cat(
        [attend(separate_cache, parts[0], slice(0, 8)), attend(separate_cache, parts[1], slice(8, None))]
    )
    together = attend(kv_cache, mixed, slice(None))
    torch.testing.assert_close(together, separate)
    torch.testing.assert_close(kv_cache, separate_cache)
    # The decode rows of the mixed call see the cache, not zeros: real rows are non-zero.
    assert together[8:11].abs().sum((1, 2)).min() > 0


@pytest.mark.parametrize("window", [None, 5])
def test_a_verify_call_attends_like_each_row_prefilled_alone(window):
    """Speculative decoding's verify call: each row's last token and drafts (3 query slots a row, one row
    with fewer tokens, one batch-padding row) over shared pages. Every real query attends, and writes the
    cache, as the same tokens run as a prefill chunk; unused slots write only the null block."""
    heads, kv_heads, head_size = 4, 2, 8
    impl = NeuronAttentionImpl(
        heads, head_size, head_size**-0.5, num_kv_heads=kv_heads, sliding_window=window
    )
    gen = torch.Generator().manual_seed(5)
    kv_cache = allocate(16, BLOCK_SIZE, kv_heads, head_size, torch.float32, CPU)
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen))
    rows = [
        Chunk(np.array([11, 12, 13], dtype=np.int32), 0, block_row(5)),
        Chunk(np.array([22, 23, 24], dtype=np.int32), 9, block_row(8, 2, 7)),  # drafts cross a block
        Chunk(np.array([33], dtype=np.int32), 7, block_row(3, 12)),  # a row without drafts
    ]
    verify = sent(
        verify_inputs(
            rows, batch_bucket=4, queries=3, num_pages=6, page_tokens=PAGE_TOKENS, block_size=BLOCK_SIZE
        )
    )
    assert verify.input_ids.tolist() == [11, 12, 13, 22, 23, 24, 33, 0, 0, 0, 0, 0]
    assert verify.positions.tolist() == [0, 1, 2, 9, 10, 11, 7, 7, 7, 0, 0, 0]
    assert verify.decode_token_index.tolist() == [0, 3, 6]
    assert verify.logits_indices.tolist() == list(range(12))
    query = torch.randn(12, heads, head_size, generator=gen)
    key, value = torch.randn(2, 12, kv_heads, head_size, generator=gen)
    cache = kv_cache.clone()
    together = torch.empty(12, heads, head_size)
    impl.forward(None, query, key, value, cache, verify.metadata, together)
    alone_cache = kv_cache.clone()
    for index, chunk in enumerate(rows):
        count = len(chunk.token_ids)
        alone = sent(prefill_inputs([chunk], token_bucket=4, context_bucket=16, block_size=BLOCK_SIZE))
        picked = slice(3 * index, 3 * index + count)
        out = torch.empty(4, heads, head_size)
        impl.forward(
            None,
            torch.cat([query[picked], torch.zeros(4 - count, heads, head_size)]),
            torch.cat([key[picked], torch.zeros(4 - count, kv_heads, head_size)]),
            torch.cat([value[picked], torch.zeros(4 - count, kv_heads, head_size)]),
            alone_cache,
            alone.metadata,
            out,
        )
        torch.testing.assert_close(together[picked], out[:count])
    # The same cache, but for the null block (where unused slots and the prefill's padding write).
    torch.testing.assert_close(cache[:, NULL_BLOCK + 1 :], alone_cache[:, NULL_BLOCK + 1 :])


def test_the_layers_of_a_call_share_its_masks(monkeypatch):
    """Every layer gets the call's one metadata object: the first layer builds the chunk's causal mask and
    the pages' masks, the next layers reuse them, and attention equals masks built on the spot."""
    heads, kv_heads, head_size = 4, 2, 8
    impl = NeuronAttentionImpl(heads, head_size, head_size**-0.5, num_kv_heads=kv_heads)
    gen = torch.Generator().manual_seed(4)
    chunk = Chunk(np.arange(100, 105, dtype=np.int32), 6, block_row(9, 4, 13))
    mixed = sent(
        mixed_inputs(
            chunk,
            DECODE_CHUNKS,
            token_bucket=8,
            context_bucket=16,
            batch_bucket=4,
            num_pages=5,
            page_tokens=PAGE_TOKENS,
            block_size=BLOCK_SIZE,
        )
    )
    tokens = mixed.input_ids.shape[0]
    built = []
    for name in ("context_mask", "page_masks"):
        build = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *args, build=build, name=name: built.append(name) or build(*args)
        )

    for _ in range(3):  # three layers, each with its own cache and inputs
        kv_cache = allocate(16, BLOCK_SIZE, kv_heads, head_size, torch.float32, CPU)
        kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen))
        query = torch.randn(tokens, heads, head_size, generator=gen)
        key, value = torch.randn(2, tokens, kv_heads, head_size, generator=gen)
        output = torch.empty(tokens, heads, head_size)
        impl.forward(None, query, key, value, kv_cache, mixed.metadata, output)

    assert built == ["context_mask", "page_masks"]
    table, paged = mixed.metadata.table, mixed.metadata.paged
    on_the_spot = torch.cat(
        [
            table_attention(
                query[:8].view(1, 8, heads, head_size),
                kv_cache,
                table.block_table,
                table.positions,
                impl.scale,
            ).view(8, heads, head_size),
            page_attention(
                query[8:],
                kv_cache,
                paged.page_blocks,
                paged.page_rows,
                paged.page_starts,
                paged.positions,
                impl.scale,
            ),
        ]
    )
    torch.testing.assert_close(output, on_the_spot)


# ---- LoRA slots: each token's and logits row's adapter, aligned with input_ids, padding 0 (the base) ----


def with_slots(chunks: list[Chunk], *slots: int) -> list[Chunk]:
    return [dataclasses.replace(chunk, lora_slot=slot) for chunk, slot in zip(chunks, slots, strict=True)]


def lora_sent(host: HostInputs) -> CallInputs:
    inputs = host.send(StagingBuffers(CPU), lora=True)
    assert_int64_cpu(inputs.lora_slots, inputs.lora_rows)
    assert torch.equal(inputs.lora_rows, inputs.lora_slots[inputs.logits_indices])
    return inputs


def test_packed_prefill_chunks_each_carry_their_adapter():
    inputs = lora_sent(
        prefill_inputs(with_slots(PACKED, 2, 0, 1), token_bucket=16, context_bucket=32, block_size=BLOCK_SIZE)
    )
    assert inputs.lora_slots.tolist() == [2] * 5 + [0] * 3 + [1] * 2 + [0] * 6
    # The chunks' rows, then the padding rows, which repeat token 0's.
    assert inputs.lora_rows.tolist() == [2, 0, 1] + [2] * (PACKED_CHUNKS - 3)


def test_a_fresh_prefill_gives_its_tokens_the_adapter_and_the_padding_the_base():
    chunk = Chunk(np.arange(100, 105, dtype=np.int32), 0, block_row(9, 4), lora_slot=3)
    inputs = lora_sent(prefill_inputs([chunk], token_bucket=8, context_bucket=0, block_size=BLOCK_SIZE))
    assert inputs.lora_slots.tolist() == [3] * 5 + [0] * 3
    assert inputs.lora_rows[0] == 3


@pytest.mark.parametrize("batch_bucket", [1, 4])
def test_decode_rows_carry_their_adapter(batch_bucket):
    chunks = with_slots(DECODE_CHUNKS, 1, 0, 2)[:batch_bucket]
    inputs = lora_sent(
        decode_inputs(
            chunks, batch_bucket=batch_bucket, num_pages=5, page_tokens=PAGE_TOKENS, block_size=BLOCK_SIZE
        )
    )
    assert inputs.lora_slots.tolist() == [1, 0, 2, 0][:batch_bucket]
    assert inputs.lora_rows.tolist() == [1, 0, 2, 0][:batch_bucket]


def test_a_mixed_call_carries_the_chunks_adapter_then_the_decode_rows():
    chunk = Chunk(np.arange(100, 105, dtype=np.int32), 6, block_row(9, 4, 13), lora_slot=2)
    inputs = lora_sent(
        mixed_inputs(
            chunk,
            with_slots(DECODE_CHUNKS, 0, 3, 1),
            token_bucket=8,
            context_bucket=16,
            batch_bucket=4,
            num_pages=5,
            page_tokens=PAGE_TOKENS,
            block_size=BLOCK_SIZE,
        )
    )
    assert inputs.lora_slots.tolist() == [2] * 5 + [0] * 3 + [0, 3, 1, 0]
    assert inputs.lora_rows.tolist() == [2, 0, 3, 1, 0]


def test_every_query_of_a_verify_row_carries_its_adapter():
    rows = [
        Chunk(np.array([11, 12, 13], dtype=np.int32), 0, block_row(5), lora_slot=2),
        Chunk(np.array([33], dtype=np.int32), 7, block_row(3, 12), lora_slot=1),  # one token, 2 unused slots
    ]
    inputs = lora_sent(
        verify_inputs(
            rows, batch_bucket=3, queries=3, num_pages=4, page_tokens=PAGE_TOKENS, block_size=BLOCK_SIZE
        )
    )
    assert inputs.lora_slots.tolist() == [2, 2, 2, 1, 1, 1, 0, 0, 0]
    assert inputs.lora_rows.tolist() == inputs.lora_slots.tolist()


def test_without_lora_the_call_sends_no_slots():
    host = prefill_inputs(
        with_slots(PACKED, 2, 0, 1), token_bucket=16, context_bucket=32, block_size=BLOCK_SIZE
    )
    inputs = host.send(StagingBuffers(CPU))
    assert inputs.lora_slots is None and inputs.lora_rows is None
    # The same transfer otherwise: every other input as with the slots.
    with_lora = host.send(StagingBuffers(CPU), lora=True)
    for name in ("input_ids", "positions", "logits_indices", "sampling_rows", "token_feed", "token_keep"):
        assert torch.equal(getattr(inputs, name), getattr(with_lora, name)), name
