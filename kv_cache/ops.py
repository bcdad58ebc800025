"""Paged KV writes and paged attention in plain torch that traces with fullgraph=True and static shapes.

No vLLM imports: these are the kernels, and NKI kernels can later sit behind the same signatures.

Layout (see kv_cache/layout.py): one tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_size],
index 0 holding keys and 1 values. Block 0 is vLLM's null block: padded rows write there and read from it.

Queries come as [rows, queries_per_row, num_heads, head_size]: a decode step is (batch, 1), a prefill chunk
is (1, chunk tokens). Each row has a block table over its context window and each query its absolute
position; a query attends to every key position <= its own. The chunk's own keys are written to the cache
before attention, so one gather reads the cached prefix and the chunk alike.
"""

import torch


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [tokens, kv_heads, head_size] at flat slots (block * block_size + offset)."""
    _, num_blocks, block_size, kv_heads, head_size = kv_cache.shape
    kv_cache[0].view(num_blocks * block_size, kv_heads, head_size).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(num_blocks * block_size, kv_heads, head_size).index_copy_(0, slot_mapping, value)


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each row's context window: [rows, blocks * block_size, kv_heads, head_size]."""
    _, _, block_size, kv_heads, head_size = kv_cache.shape
    rows, blocks = block_table.shape
    flat_ids = block_table.reshape(-1)
    keys = kv_cache[0].index_select(0, flat_ids).view(rows, blocks * block_size, kv_heads, head_size)
    values = kv_cache[1].index_select(0, flat_ids).view(rows, blocks * block_size, kv_heads, head_size)
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
    """Grouped-query causal attention over contiguous per-row context [rows, context, kv_heads, head_size]."""
    rows, num_queries, num_heads, head_size = query.shape
    context, kv_heads = keys.shape[1], keys.shape[2]
    group = num_heads // kv_heads
    # The query heads of one KV head fold into the query dimension, [rows, kv_heads, group * q, d], so the
    # matmuls batch over (rows, kv_heads) with K/V as they are: no copy of K/V per query head. The matmuls
    # run in the model's dtype (converting all of K/V to float32 would cost more than the attention); the
    # scores are softmaxed in float32.
    q = query.view(rows, num_queries, kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    q = q.reshape(rows, kv_heads, group * num_queries, head_size)
    k = keys.permute(0, 2, 3, 1)  # [rows, kv_heads, d, context]
    v = values.permute(0, 2, 1, 3)  # [rows, kv_heads, context, d]
    scores = torch.matmul(q, k).float().view(rows, kv_heads, group, num_queries, context) * scale
    key_positions = torch.arange(context, device=query.device)
    visible = key_positions.view(1, 1, 1, 1, context) <= query_positions.view(rows, 1, 1, num_queries, 1)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype).view(rows, kv_heads, group * num_queries, context)
    out = torch.matmul(probs, v).view(rows, kv_heads, group, num_queries, head_size)
    return out.permute(0, 3, 1, 2, 4).reshape(rows, num_queries, num_heads, head_size)


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
