"""Where KV lives: per-layer tensor shapes, allocation in device memory, the null block, slot mapping."""

from collections.abc import Callable

import numpy as np
import torch

# vLLM's block pool never hands out block 0 (its null block); padded rows write to and read from it.
NULL_BLOCK = 0


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """[2 * kv_heads, blocks, block_size, head_size]: the keys of each KV head, then the values of each (copy
    kv * kv_heads + head). Heads lead, so gathering a row's blocks yields each head's context as one
    contiguous [tokens, head_size] matrix that attention multiplies as it is. K/V and heads share one
    dimension so that no dimension is 1 (one KV head): XLA's layout assignment copies a cache with a
    dimension of 1, twice per call, where its in-place write's result is reshaped back (docs/lowering.md)."""
    return (2 * num_kv_heads, num_blocks, block_size, head_size)


def allocate(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
    zeros: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One contiguous, zeroed layer cache (zeros keep padded reads of the null block finite). zeros: the
    allocator of the compile backend, where it must own the memory it updates in place (`xla`)."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    if zeros is not None:
        return zeros(shape, dtype, device)
    return torch.zeros(shape, dtype=dtype, device=device)


def block_major(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, 2 * kv_heads, block_size, head_size]: a layer cache as the `[B, H, N, C]` view (blocks at dim
    0, H = 2 * kv_heads, C = head_size) that vLLM's KV connectors index by block and offset. The same storage,
    strided: no copy, and a write through it lands in the cache the compiled graphs read."""
    return cache.permute(1, 0, 2, 3)


def slot_mapping(block_row: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Flat cache slots of token positions, given the request's block ids (computed on the host)."""
    return block_row[positions // block_size] * block_size + positions % block_size


def page_table(cache: torch.Tensor) -> torch.Tensor:
    """A layer cache as a table of its pages' runs, [2 * kv_heads * blocks, block_size * head_size]: copy c
    of block b (its keys or values of one KV head) at row c * blocks + b. The same storage, contiguous."""
    copies, num_blocks, block_size, head_size = cache.shape
    return cache.view(copies * num_blocks, block_size * head_size)


def page_rows(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The rows of `page_table(cache)` that hold the pages of block_ids [n], page by page: [n * copies], so
    the rows taken in this order are the blocks' block-major pages ([n, 2 * kv_heads, block_size,
    head_size]), the layout vLLM's connectors and NIXL move."""
    copies, num_blocks = cache.shape[:2]
    copy_offsets = torch.arange(copies, device=block_ids.device).view(1, copies) * num_blocks
    return (block_ids.view(-1, 1) + copy_offsets).reshape(-1)
