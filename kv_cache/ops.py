"""Paged KV writes and paged attention in plain torch that traces with fullgraph=True and static shapes.

No vLLM imports: these are the kernels' references; kv_cache/kernels.py makes them the neuron_kv custom ops
that NKI kernels can stand behind.

Layout (see kv_cache/layout.py): one tensor per layer, [2 * num_kv_heads, num_blocks, block_size, head_size],
the keys of each KV head then the values of each. Block 0 is vLLM's null block: padded rows write there and
read from it.

table_attention: queries come as [rows, queries_per_row, num_heads, head_size] (a prefill chunk is one row of
chunk tokens). Each row has a block table over its context window and each query its absolute position; a
query attends to every key position <= its own. The chunk's own keys are written to the cache before
attention, so one gather reads the cached prefix and the chunk alike.

page_attention: one query per row, over pages of KV blocks that the rows share (each row as many as its
context needs), so a decode step reads about the rows' real contexts instead of rows x the longest one.

causal_attention: a fresh prefill chunk over its own keys, no cache read (the flash-kernel form).

An FP8 cache (kv_cache/fp8.py) is uint8: the attentions take the layer's k_scale/v_scale and dequantize
right after the gather; the write takes rows its caller quantized.

All take a layer's sliding window (a query sees the `window` latest positions, its own included, as HF and
flash-attention count it) in their masks, and its logit soft-cap (scores -> cap * tanh(scores / cap) before
the mask, Gemma 2's rule).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kv_cache import fp8

# Score of a masked key: finite, so a page with no visible key gives weights of 0 after rescaling, not NaN.
_MASKED = -1e30


def _flat_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Row indices, in the cache seen as a flat [2 * kv_heads * slots, head_size] table, of `slots` [n]: the
    key rows then the value rows of each KV head, [2 * kv_heads * n]."""
    copies, num_blocks, block_size, _ = kv_cache.shape
    copy_offsets = torch.arange(copies, device=slots.device).view(-1, 1) * (num_blocks * block_size)
    return (copy_offsets + slots.view(1, -1)).reshape(-1)


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [tokens, kv_heads, head_size] at flat slots (block * block_size + offset).

    One row write along dim 0 of the cache seen as a flat table, so the traced graph updates the cache with a
    single scatter of the step's new rows: the output a Neuron compile aliases to the cache parameter, with
    no select_scatter or copy of a whole cache (docs/lowering.md)."""
    head_size = kv_cache.shape[-1]
    rows = torch.stack((key, value)).transpose(1, 2).reshape(-1, head_size)  # [2 * kv_heads * tokens, d]
    kv_cache.view(-1, head_size).index_copy_(0, _flat_rows(kv_cache, slot_mapping), rows)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the blocks in each row of block_ids [rows, blocks], each row's blocks contiguous:
    [kv_heads, rows, blocks * block_size, head_size]."""
    kv_heads = kv_cache.shape[0] // 2
    both = _gather(kv_cache, block_ids, 0, 2 * kv_heads)
    return both[:kv_heads], both[kv_heads:]


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, first: int, copies: int) -> torch.Tensor:
    """Copies first .. first + copies - 1 of the cache (K of each KV head, then V of each) at the blocks of
    each row of block_ids [rows, blocks]: [copies, rows, blocks * block_size, head_size]. One gather of whole
    blocks along dim 0 of a [2 * kv_heads * blocks, block] view (copy c of a block at c * num_blocks +
    block): several times faster on CPU than index_select along an inner dimension."""
    all_copies, num_blocks, block_size, head_size = kv_cache.shape
    rows, blocks = block_ids.shape
    copy_offsets = (torch.arange(copies, device=block_ids.device).view(-1, 1) + first) * num_blocks
    flat_ids = (copy_offsets + block_ids.reshape(1, -1)).reshape(-1)
    table = kv_cache.view(all_copies * num_blocks, block_size * head_size)
    return table.index_select(0, flat_ids).view(copies, rows, blocks * block_size, head_size)


def context_mask(
    query_positions: torch.Tensor,
    context: int,
    group: int,
    dtype: torch.dtype,
    first_keys: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The additive causal mask of queries at query_positions [rows, q] over context positions 0 ..
    context-1, laid out as attention_over_context folds the query heads of a KV head: [1, rows, group * q,
    context], 0 where a key is visible and -inf where it is not.

    first_keys [rows, q]: the first context position each query may see (none: 0). Chunks of several
    requests packed in one row each see only their own segment of the context: keys first .. position.
    window: a sliding window's length; a query then sees only keys after position - window."""
    rows, num_queries = query_positions.shape

    def per_query(values: torch.Tensor) -> torch.Tensor:
        folded = values.view(1, rows, 1, num_queries).expand(1, rows, group, num_queries)
        return folded.reshape(1, rows, group * num_queries, 1)

    key_positions = torch.arange(context, device=query_positions.device).view(1, 1, 1, context)
    visible = key_positions <= per_query(query_positions)
    if first_keys is not None:
        visible = visible & (key_positions >= per_query(first_keys))
    if window is not None:
        visible = visible & (key_positions > per_query(query_positions) - window)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def table_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query [rows, q, heads, head_size] over the paged context of each row.

    block_table: [rows, blocks] block ids; query_positions: [rows, q] absolute positions; mask: their
    context_mask, when the caller shares one across layers (built here otherwise, without a window);
    k_scale/v_scale: an FP8 cache's scales (None: the cache holds the query's dtype).
    Returns [rows, q, heads, head_size] in the query's dtype.
    """
    keys, values = fp8.dequantized(*gather_blocks(kv_cache, block_table), k_scale, v_scale, query.dtype)
    if mask is None:
        group = query.shape[2] // keys.shape[0]
        mask = context_mask(query_positions, keys.shape[2], group, query.dtype)
    return attention_over_context(query, keys, values, mask, scale, soft_cap)


def attention_over_context(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention over contiguous context keys/values [kv_heads, rows, context, d], with the
    additive mask of context_mask."""
    rows, num_queries, num_heads, head_size = query.shape
    kv_heads = keys.shape[0]
    group = num_heads // kv_heads
    # The query heads of one KV head fold into the query dimension, [kv_heads, rows, group * q, d], so
    # attention batches over (kv_heads, rows) with K/V exactly as gathered: only the small query is copied.
    q = query.view(rows, num_queries, kv_heads, group, head_size).permute(2, 0, 3, 1, 4)
    q = q.reshape(kv_heads, rows, group * num_queries, head_size)
    if soft_cap is None:
        # PyTorch's fused attention: on CPU it never materialises the [queries, context] scores (4-5x faster
        # for prefill chunks than matmul + softmax), and it accumulates in float32 whatever the model's dtype.
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    else:
        # The cap applies to the scores themselves, which fused attention never exposes.
        scores = _capped(torch.matmul(q, keys.transpose(-1, -2)).float() * scale, soft_cap)
        weights = torch.softmax(scores + mask, dim=-1)
        out = torch.matmul(weights.to(values.dtype), values)
    out = out.view(kv_heads, rows, group, num_queries, head_size)
    return out.permute(1, 3, 0, 2, 4).reshape(rows, num_queries, num_heads, head_size)


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of a fresh prefill chunk (one request's tokens from position 0, padding after them) over
    its own keys and values [tokens, kv_heads, head_size], read from the step's projections, not the cache.

    Without a window or soft-cap this is scaled_dot_product_attention with the causal flag and no mask: the
    call TorchNeuron hands its NKI flash kernel (decompositions.flash_kernel_takes), which never materialises
    the [tokens, tokens] scores. Its key heads are repeated to the query heads first, as TorchNeuron's
    kernel path does itself. A window or a soft-cap needs the masked form (attention_over_context).
    Returns [tokens, heads, head_size]."""
    tokens, num_heads, head_size = query.shape
    kv_heads = key.shape[1]
    if window is None and soft_cap is None:
        group = num_heads // kv_heads
        q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, d]
        k = key.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
        v = value.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.squeeze(0).transpose(0, 1)
    positions = torch.arange(tokens, device=query.device).view(1, tokens)
    mask = context_mask(positions, tokens, num_heads // kv_heads, query.dtype, window=window)
    keys = key.transpose(0, 1).unsqueeze(1)  # [kv_heads, 1, tokens, d]
    values = value.transpose(0, 1).unsqueeze(1)
    out = attention_over_context(
        query.view(1, tokens, num_heads, head_size), keys, values, mask, scale, soft_cap
    )
    return out.view(tokens, num_heads, head_size)


@dataclass
class PageMasks:
    """What page_attention derives from the pages alone, the same in every layer of a call.

    hidden:    [1, pages, page_tokens, queries, 1] keys of each page past its queries' positions
    owner:     [rows, pages] whether a page belongs to a row
    ownership: owner as float32, for the matmuls that add up each row's pages
    """

    hidden: torch.Tensor
    owner: torch.Tensor
    ownership: torch.Tensor


def page_masks(
    page_rows: torch.Tensor,
    page_starts: torch.Tensor,
    positions: torch.Tensor,
    page_tokens: int,
    window: int | None = None,
) -> PageMasks:
    """positions: [rows] or [rows, queries] (page_attention's); window: a sliding window's length, keys at or
    before position - window are hidden too."""
    positions = positions.reshape(positions.shape[0], -1)
    pages, (rows, queries) = page_rows.shape[0], positions.shape
    offsets = torch.arange(page_tokens, device=page_rows.device).view(1, page_tokens, 1)
    key_positions = page_starts.view(pages, 1, 1) + offsets
    page_positions = positions.index_select(0, page_rows).view(pages, 1, queries)
    hidden = key_positions > page_positions
    if window is not None:
        hidden = hidden | (key_positions <= page_positions - window)
    owner = page_rows.view(1, pages) == torch.arange(rows, device=page_rows.device).view(rows, 1)
    return PageMasks(hidden.view(1, pages, page_tokens, queries, 1), owner, owner.to(torch.float32))


def page_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    page_blocks: torch.Tensor,
    page_rows: torch.Tensor,
    page_starts: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    masks: PageMasks | None = None,
    soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of consecutive queries over KV pages shared by the rows: one query per row (decode, positions
    [rows]) or several (a verify row of speculative decoding, positions [rows, queries]: the row's last token
    and its draft tokens). query [rows * queries, heads, head_size], row by row.

    page_blocks [pages, blocks_per_page]: the blocks of each page; page_rows [pages]: the row it belongs to;
    page_starts [pages]: the position of its first key; masks: their page_masks, when the caller shares one
    across layers (built here otherwise); k_scale/v_scale: an FP8 cache's scales. A row's pages cover its
    context, so the work follows the rows' real contexts rather than padding every row to the longest.
    Padding pages start past every position (nothing visible) and belong to row 0; a row without pages
    (batch padding) returns zeros. Each query sees its row's keys up to its own position: a verify row's
    queries share its pages, read once.

    Each page gives a partial softmax (its max, its sum, its weighted values); the rows combine their pages
    by rescaling to the row's max, as split-K ("flash decoding") kernels do. The keys and the values are
    each gathered once (and dequantized, from an FP8 cache) and each read once by one matmul: scores are
    keys @ queries, [tokens, queries], so no page-sized transpose or slice is copied (docs/lowering.md).
    Returns [rows * queries, heads, head_size].
    """
    rows = positions.shape[0]
    queries = positions.numel() // rows
    num_heads, head_size = query.shape[1], query.shape[2]
    # Keys and values each a gather of its own, so that each matmul reads its operand as gathered (one
    # gather of both is sliced by a copy): [kv_heads, pages, page_tokens, d].
    kv_heads = kv_cache.shape[0] // 2
    keys, values = fp8.dequantized(
        _gather(kv_cache, page_blocks, 0, kv_heads),
        _gather(kv_cache, page_blocks, kv_heads, kv_heads),
        k_scale,
        v_scale,
        query.dtype,
    )
    pages, page_tokens = keys.shape[1], keys.shape[2]
    group = num_heads // kv_heads
    heads = queries * group
    if masks is None:
        masks = page_masks(page_rows, page_starts, positions, page_tokens)
    # Each page takes its row's queries, every query head of every KV head: [kv_heads, pages, d, queries *
    # group] (a row's queries fold into the query heads, as attention_over_context folds them).
    q = query.view(rows, queries, kv_heads, group, head_size).permute(0, 2, 4, 1, 3)
    q = q.reshape(rows, kv_heads, head_size, heads).index_select(0, page_rows).transpose(0, 1)
    # Scores in the model's dtype, like the model's own eager attention; softmax statistics in float32.
    scores = torch.matmul(keys, q).float() * scale  # [kv_heads, pages, tokens, q * group]
    if soft_cap is not None:
        scores = _capped(scores, soft_cap)
    scores = scores.view(kv_heads, pages, page_tokens, queries, group).masked_fill(masks.hidden, _MASKED)
    scores = scores.view(kv_heads, pages, page_tokens, heads)
    page_max = scores.amax(2)  # [kv_heads, pages, q * group]
    weights = torch.exp(scores - page_max.unsqueeze(2))
    page_sum = weights.sum(2)
    # [q * group, tokens] @ [tokens, d]: only the weights, a head_size-th of the values' size, are transposed.
    page_out = torch.matmul(weights.transpose(2, 3).to(values.dtype), values).float()
    # Combine each row's pages through a [rows, pages] ownership matrix: matmuls and a masked max, no
    # scatter, so it traces and tiles the same way on every backend.
    row_max = torch.where(
        masks.owner.view(1, rows, pages, 1), page_max.view(kv_heads, 1, pages, heads), _MASKED
    ).amax(2)  # [kv_heads, rows, q * group]
    rescale = torch.exp(page_max - row_max.index_select(1, page_rows))  # [kv_heads, pages, q * group]
    total = torch.matmul(masks.ownership, (page_out * rescale.unsqueeze(-1)).reshape(kv_heads, pages, -1))
    norm = torch.matmul(masks.ownership, page_sum * rescale).clamp_min(torch.finfo(torch.float32).tiny)
    out = total.view(kv_heads, rows, heads, head_size) / norm.view(kv_heads, rows, heads, 1)
    out = out.to(query.dtype).view(kv_heads, rows, queries, group, head_size)
    return out.permute(1, 2, 0, 3, 4).reshape(rows * queries, num_heads, head_size)


def _capped(scores: torch.Tensor, soft_cap: float) -> torch.Tensor:
    return torch.tanh(scores / soft_cap) * soft_cap


def reference_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Naive per-query causal attention over one sequence's contiguous K/V, for tests.

    query [q, heads, d]; keys/values [seq_len, kv_heads, d]; query_positions [q]; a query sees the `window`
    latest keys (all without one), its scores capped to +-soft_cap by tanh.
    """
    num_heads, kv_heads = query.shape[1], keys.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(query, dtype=torch.float32)
    for i, position in enumerate(query_positions.tolist()):
        first = 0 if window is None else max(0, position + 1 - window)
        for head in range(num_heads):
            k = keys[first : position + 1, head // group].double()
            v = values[first : position + 1, head // group].double()
            scores = (k @ query[i, head].double()) * scale
            if soft_cap is not None:
                scores = torch.tanh(scores / soft_cap) * soft_cap
            weights = torch.softmax(scores, dim=0)
            out[i, head] = (weights @ v).float()
    return out.to(query.dtype)
