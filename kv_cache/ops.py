"""Paged KV writes and paged attention in plain torch that traces with fullgraph=True and static shapes.

No vLLM imports: these are the kernels, and NKI kernels can later sit behind the same signatures.

Layout (see kv_cache/layout.py): one tensor per layer, [2, num_kv_heads, num_blocks, block_size, head_size],
index 0 holding keys and 1 values. Block 0 is vLLM's null block: padded rows write there and read from it.

Queries come as [rows, queries_per_row, num_heads, head_size]: a decode step is (batch, 1), a prefill chunk
is (1, chunk tokens). Each row has a block table over its context window and each query its absolute
position; a query attends to every key position <= its own. The chunk's own keys are written to the cache
before attention, so one gather reads the cached prefix and the chunk alike.
"""

import torch
import torch.nn.functional as F


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [tokens, kv_heads, head_size] at flat slots (block * block_size + offset)."""
    _, kv_heads, num_blocks, block_size, head_size = kv_cache.shape
    slots = num_blocks * block_size
    kv_cache[0].view(kv_heads, slots, head_size).index_copy_(1, slot_mapping, key.transpose(0, 1))
    kv_cache[1].view(kv_heads, slots, head_size).index_copy_(1, slot_mapping, value.transpose(0, 1))


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each row's context window, contiguous: [kv_heads, rows, blocks * block_size, d]."""
    _, kv_heads, num_blocks, block_size, head_size = kv_cache.shape
    rows, blocks = block_table.shape
    # One gather of whole blocks along dim 0 of a [kv_heads * blocks, block] view (each head's copy of a
    # block at head * num_blocks + block): several times faster on CPU than index_select along dim 1.
    head_offsets = torch.arange(kv_heads, device=block_table.device).view(kv_heads, 1) * num_blocks
    flat_ids = (head_offsets + block_table.reshape(1, -1)).reshape(-1)
    shape = (kv_heads, rows, blocks * block_size, head_size)
    keys = kv_cache[0].view(kv_heads * num_blocks, -1).index_select(0, flat_ids).view(shape)
    values = kv_cache[1].view(kv_heads * num_blocks, -1).index_select(0, flat_ids).view(shape)
    return keys, values


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of query [rows, q, heads, head_size] over the paged context of each row.

    block_table: [rows, blocks] block ids; query_positions: [rows, q] absolute positions.
    Returns [rows, q, heads, head_size] in the query's dtype.
    """
    keys, values = gather_context(kv_cache, block_table)
    return attention_over_context(query, keys, values, query_positions, scale)


def attention_over_context(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Grouped-query causal attention over contiguous context keys/values [kv_heads, rows, context, d]."""
    rows, num_queries, num_heads, head_size = query.shape
    kv_heads, context = keys.shape[0], keys.shape[2]
    group = num_heads // kv_heads
    # The query heads of one KV head fold into the query dimension, [kv_heads, rows, group * q, d], so
    # attention batches over (kv_heads, rows) with K/V exactly as gathered: only the small query is copied.
    q = query.view(rows, num_queries, kv_heads, group, head_size).permute(2, 0, 3, 1, 4)
    q = q.reshape(kv_heads, rows, group * num_queries, head_size)
    positions = query_positions.view(1, rows, 1, num_queries).expand(1, rows, group, num_queries)
    key_positions = torch.arange(context, device=query.device)
    visible = key_positions.view(1, 1, 1, context) <= positions.reshape(1, rows, group * num_queries, 1)
    # PyTorch's fused attention: on CPU it never materialises the [queries, context] scores (4-5x faster for
    # prefill chunks than matmul + softmax), and it accumulates in float32 whatever the model's dtype.
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
    out = out.view(kv_heads, rows, group, num_queries, head_size)
    return out.permute(1, 3, 0, 2, 4).reshape(rows, num_queries, num_heads, head_size)


def reference_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Naive per-query causal attention over one sequence's contiguous K/V, for tests.

    query [q, heads, d]; keys/values [seq_len, kv_heads, d]; query_positions [q].
    """
    num_heads, kv_heads = query.shape[1], keys.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(query, dtype=torch.float32)
    for i, position in enumerate(query_positions.tolist()):
        for head in range(num_heads):
            k = keys[: position + 1, head // group].double()
            v = values[: position + 1, head // group].double()
            weights = torch.softmax((k @ query[i, head].double()) * scale, dim=0)
            out[i, head] = (weights @ v).float()
    return out.to(query.dtype)
