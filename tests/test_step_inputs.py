"""worker.step_inputs: bucket-shaped, padded host inputs of decode and prefill calls."""

import numpy as np
import pytest
import torch

from kv_cache.layout import allocate
from kv_cache.ops import paged_attention, write_kv
from worker.step_inputs import Chunk, decode_inputs, prefill_inputs

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def block_row(*blocks: int, width: int = 6) -> np.ndarray:
    """A request's block ids, zero past its allocation (as in the persistent batch's block table)."""
    row = np.zeros(width, dtype=np.int32)
    row[: len(blocks)] = blocks
    return row


def expected_slot(row: np.ndarray, position: int) -> int:
    return int(row[position // BLOCK_SIZE]) * BLOCK_SIZE + position % BLOCK_SIZE


def expected_table_row(row: np.ndarray, num_blocks: int) -> list[int]:
    ids = [int(b) for b in row[:num_blocks]]
    return ids + [0] * (num_blocks - len(ids))


def assert_int64_cpu(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        assert tensor.dtype == torch.int64 and tensor.device == CPU


DECODE_CHUNKS = [
    Chunk(np.array([11], dtype=np.int32), 0, block_row(5)),  # first token of block 5
    Chunk(np.array([22], dtype=np.int32), 9, block_row(8, 2, 7)),  # offset 1 of its third block
    Chunk(np.array([33], dtype=np.int32), 7, block_row(3, 12)),  # last slot of its second block
]


@pytest.mark.parametrize("context_bucket", [12, 16, 32], ids=["narrower-than-row", "row", "wider-than-row"])
@pytest.mark.parametrize("batch_bucket", [3, 8])
def test_decode_inputs(batch_bucket, context_bucket):
    chunks = DECODE_CHUNKS
    num_blocks = context_bucket // BLOCK_SIZE

    inputs = decode_inputs(chunks, batch_bucket, context_bucket, BLOCK_SIZE, CPU)
    meta = inputs.metadata

    assert inputs.input_ids.shape == (batch_bucket,)
    assert inputs.positions.shape == (batch_bucket,)
    assert meta.query_positions.shape == (batch_bucket, 1)
    assert meta.slot_mapping.shape == (batch_bucket,)
    assert meta.block_table.shape == (batch_bucket, num_blocks)
    assert_int64_cpu(inputs.input_ids, inputs.positions, inputs.logits_indices, *vars(meta).values())
    assert inputs.num_real_rows == len(chunks)
    # Every row's logits are computed (static shape); the first num_real_rows are the requests, in order.
    assert inputs.logits_indices.tolist() == list(range(batch_bucket))
    assert torch.equal(meta.query_positions[:, 0], inputs.positions)

    for row, chunk in enumerate(chunks):
        assert inputs.input_ids[row] == chunk.token_ids[0]
        assert inputs.positions[row] == chunk.start
        assert meta.slot_mapping[row] == expected_slot(chunk.block_row, chunk.start)
        assert meta.block_table[row].tolist() == expected_table_row(chunk.block_row, num_blocks)
    padding = slice(len(chunks), None)
    assert not inputs.input_ids[padding].any()
    assert not inputs.positions[padding].any()
    assert ((meta.slot_mapping[padding] >= 0) & (meta.slot_mapping[padding] < BLOCK_SIZE)).all()
    assert not meta.block_table[padding].any()


def test_decode_inputs_does_not_alias_the_block_row():
    chunk = Chunk(np.array([1]), 2, block_row(4, 5))
    inputs = decode_inputs([chunk], 2, 8, BLOCK_SIZE, CPU)
    chunk.block_row[0] = 99
    assert inputs.metadata.block_table[0].tolist() == [4, 5]


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

    inputs = prefill_inputs(Chunk(tokens, start, row), token_bucket, context_bucket, BLOCK_SIZE, CPU)
    meta = inputs.metadata

    assert inputs.input_ids.shape == (token_bucket,)
    assert inputs.positions.shape == (token_bucket,)
    assert meta.query_positions.shape == (1, token_bucket)
    assert meta.slot_mapping.shape == (token_bucket,)
    assert meta.block_table.shape == (1, num_blocks)
    assert_int64_cpu(inputs.input_ids, inputs.positions, inputs.logits_indices, *vars(meta).values())
    assert inputs.num_real_rows == 1
    assert inputs.logits_indices.tolist() == [count - 1]  # the last real token
    assert torch.equal(meta.query_positions[0], inputs.positions)

    positions = list(range(start, start + count))
    assert inputs.input_ids[:count].tolist() == tokens.tolist()
    assert inputs.positions[:count].tolist() == positions
    assert meta.slot_mapping[:count].tolist() == [expected_slot(row, p) for p in positions]
    assert meta.block_table[0].tolist() == expected_table_row(row, num_blocks)
    assert not inputs.input_ids[count:].any()
    assert not inputs.positions[count:].any()
    assert ((meta.slot_mapping[count:] >= 0) & (meta.slot_mapping[count:] < BLOCK_SIZE)).all()


def test_padded_inputs_give_finite_attention():
    """The padding conventions hold up in the kernels: padded rows and queries produce no NaN."""
    kv_cache = allocate(16, BLOCK_SIZE, 2, 8, torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    decode = decode_inputs(DECODE_CHUNKS, 8, 16, BLOCK_SIZE, CPU)
    prefill = prefill_inputs(Chunk(np.arange(1, 6), 6, block_row(9, 4, 13)), 8, 16, BLOCK_SIZE, CPU)
    for inputs in (prefill, decode):
        meta = inputs.metadata
        tokens, rows = meta.slot_mapping.shape[0], meta.query_positions.shape[0]
        key, value = torch.randn(2, tokens, 2, 8, generator=gen)
        write_kv(kv_cache, key, value, meta.slot_mapping)
        query = torch.randn(rows, tokens // rows, 4, 8, generator=gen)
        out = paged_attention(query, kv_cache, meta.block_table, meta.query_positions, 8**-0.5)
        assert out.shape == query.shape
        assert torch.isfinite(out).all()
