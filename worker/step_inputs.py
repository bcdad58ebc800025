"""Padded inputs of one compiled call, built on the host: the only place that turns rows into bucket shapes.

Padding conventions: token id 0, position 0, slot 0 (inside the null block), block id 0 (the null block).
A padded prefill query at position 0 attends to one finite key, a padded decode row to no page (zeros), so no
row produces NaN; their logits are dropped. A padding decode page starts past every position: no key of it
is visible.
"""

from dataclasses import dataclass

import numpy as np
import torch

from kv_cache.backend import NeuronAttentionMetadata
from kv_cache.layout import NULL_BLOCK, slot_mapping

# First position of a padding decode page: past any context (and within int32, for device index types).
PADDING_PAGE_START = 2**30


@dataclass
class Chunk:
    """Consecutive tokens of one request to run in one call: tokens at positions start .. start+len-1."""

    token_ids: np.ndarray
    start: int
    block_row: np.ndarray  # the request's block ids (zeros past its allocation)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    logits_indices: torch.Tensor  # [rows whose logits we keep]
    metadata: NeuronAttentionMetadata
    num_real_rows: int  # logits rows that belong to real requests


def _context_blocks(block_row: np.ndarray, num_blocks: int) -> np.ndarray:
    """The first num_blocks block ids of a row, zero-padded when the context bucket is wider than the row."""
    out = np.full(num_blocks, NULL_BLOCK, dtype=np.int64)
    width = min(num_blocks, block_row.shape[0])
    out[:width] = block_row[:width]
    return out


def decode_inputs(
    chunks: list[Chunk],
    batch_bucket: int,
    num_pages: int,
    page_tokens: int,
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """One token per request: rows = batch bucket, one query per row, over `num_pages` KV pages of
    `page_tokens` positions that the rows share, each row as many as its context needs (in row order).

    A batch bucket of one shares nothing: its row attends over its own first num_pages pages of blocks as a
    block table, through the fused kernel the prefill path uses (fewer, larger ops for the same work)."""
    blocks_per_page = page_tokens // block_size
    if batch_bucket == 1:
        (chunk,) = chunks
        block_table = _context_blocks(chunk.block_row, num_pages * blocks_per_page).reshape(1, -1)
        if chunk.start >= num_pages * page_tokens:
            raise ValueError(f"a decode row at position {chunk.start} needs more than {num_pages} KV pages")
        return _to_device(
            np.array([chunk.token_ids[0]], dtype=np.int64),
            np.array([chunk.start], dtype=np.int64),
            np.zeros(1, dtype=np.int64),
            np.array([[chunk.start]], dtype=np.int64),
            slot_mapping(block_table[0], np.array([chunk.start]), block_size),
            1,
            device,
            block_table=block_table,
        )
    input_ids = np.zeros(batch_bucket, dtype=np.int64)
    positions = np.zeros(batch_bucket, dtype=np.int64)
    slots = np.full(batch_bucket, NULL_BLOCK * block_size, dtype=np.int64)
    page_blocks = np.full((num_pages, blocks_per_page), NULL_BLOCK, dtype=np.int64)
    page_rows = np.zeros(num_pages, dtype=np.int64)
    page_starts = np.full(num_pages, PADDING_PAGE_START, dtype=np.int64)
    used = 0
    for row, chunk in enumerate(chunks):
        input_ids[row] = chunk.token_ids[0]
        positions[row] = chunk.start
        row_pages = -(-(chunk.start + 1) // page_tokens)
        blocks = _context_blocks(chunk.block_row, row_pages * blocks_per_page)
        slots[row] = slot_mapping(blocks, positions[row : row + 1], block_size)[0]
        page_blocks[used : used + row_pages] = blocks.reshape(row_pages, blocks_per_page)
        page_rows[used : used + row_pages] = row
        page_starts[used : used + row_pages] = np.arange(row_pages) * page_tokens
        used += row_pages
    if used > num_pages:
        raise ValueError(f"decode rows need {used} KV pages, the call has {num_pages}")
    return _to_device(
        input_ids,
        positions,
        np.arange(batch_bucket, dtype=np.int64),
        positions.reshape(batch_bucket, 1),
        slots,
        len(chunks),
        device,
        page_blocks=page_blocks,
        page_rows=page_rows,
        page_starts=page_starts,
    )


def prefill_inputs(
    chunk: Chunk, token_bucket: int, context_bucket: int, block_size: int, device: torch.device
) -> StepInputs:
    """One request's chunk: one row of token_bucket queries; keeps only the last real token's logits."""
    num_blocks = context_bucket // block_size
    count = len(chunk.token_ids)
    input_ids = np.zeros(token_bucket, dtype=np.int64)
    input_ids[:count] = chunk.token_ids
    positions = np.zeros(token_bucket, dtype=np.int64)
    positions[:count] = np.arange(chunk.start, chunk.start + count)
    block_table = _context_blocks(chunk.block_row, num_blocks).reshape(1, num_blocks)
    slots = np.full(token_bucket, NULL_BLOCK * block_size, dtype=np.int64)
    slots[:count] = slot_mapping(block_table[0], positions[:count], block_size)
    return _to_device(
        input_ids,
        positions,
        np.array([count - 1], dtype=np.int64),
        positions.reshape(1, token_bucket),
        slots,
        1,
        device,
        block_table=block_table,
    )


def _to_device(
    input_ids: np.ndarray,
    positions: np.ndarray,
    logits_indices: np.ndarray,
    query_positions: np.ndarray,
    slots: np.ndarray,
    num_real_rows: int,
    device: torch.device,
    **attention_tables: np.ndarray,
) -> StepInputs:
    def put(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    return StepInputs(
        input_ids=put(input_ids),
        positions=put(positions),
        logits_indices=put(logits_indices),
        metadata=NeuronAttentionMetadata(
            query_positions=put(query_positions),
            slot_mapping=put(slots),
            **{name: put(table) for name, table in attention_tables.items()},
        ),
        num_real_rows=num_real_rows,
    )
