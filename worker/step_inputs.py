"""Padded inputs of one compiled call, built on the host: the only place that turns rows into bucket shapes.

Padding conventions: token id 0, position 0, slot 0 (inside the null block), block id 0 (the null block).
A padded query at position 0 attends to one finite key, so no row produces NaN; its logits are dropped.
"""

from dataclasses import dataclass

import numpy as np
import torch

from kv_cache.backend import NeuronAttentionMetadata
from kv_cache.layout import NULL_BLOCK, slot_mapping


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
    chunks: list[Chunk], batch_bucket: int, context_bucket: int, block_size: int, device: torch.device
) -> StepInputs:
    """One token per request: rows = batch bucket, one query per row."""
    num_blocks = context_bucket // block_size
    input_ids = np.zeros(batch_bucket, dtype=np.int64)
    positions = np.zeros(batch_bucket, dtype=np.int64)
    slots = np.full(batch_bucket, NULL_BLOCK * block_size, dtype=np.int64)
    block_table = np.full((batch_bucket, num_blocks), NULL_BLOCK, dtype=np.int64)
    for row, chunk in enumerate(chunks):
        input_ids[row] = chunk.token_ids[0]
        positions[row] = chunk.start
        block_table[row] = _context_blocks(chunk.block_row, num_blocks)
        slots[row] = slot_mapping(block_table[row], positions[row : row + 1], block_size)[0]
    return _to_device(
        input_ids,
        positions,
        np.arange(batch_bucket, dtype=np.int64),
        block_table,
        positions.reshape(batch_bucket, 1),
        slots,
        len(chunks),
        device,
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
        block_table,
        positions.reshape(1, token_bucket),
        slots,
        1,
        device,
    )


def _to_device(
    input_ids: np.ndarray,
    positions: np.ndarray,
    logits_indices: np.ndarray,
    block_table: np.ndarray,
    query_positions: np.ndarray,
    slots: np.ndarray,
    num_real_rows: int,
    device: torch.device,
) -> StepInputs:
    def put(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    return StepInputs(
        input_ids=put(input_ids),
        positions=put(positions),
        logits_indices=put(logits_indices),
        metadata=NeuronAttentionMetadata(
            block_table=put(block_table), query_positions=put(query_positions), slot_mapping=put(slots)
        ),
        num_real_rows=num_real_rows,
    )
