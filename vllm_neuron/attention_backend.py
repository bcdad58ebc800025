"""vLLM attention backend over kv_cache.ops, called through the kernel seam of kv_cache/kernels.py: what
vLLM's Attention layers call on the Neuron platform. Here, not in kv_cache, because it reads the plugin's
settings (envs, the compile route); kv_cache stays plain torch below it."""

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
)

from kv_cache import fp8, kernels, ops
from vllm_neuron import envs
from vllm_neuron.config import on_torchneuron_route
from vllm_neuron.upstream.vllm_runner import kv_cache_scales


@dataclass
class TableQueries:
    """Rows of consecutive queries (prefill chunks, or a lone decode row), each row over its own block table.

    positions:   [rows, queries_per_row] each query's own position in its row's context window: its absolute
                 position, plus the offset of its request's segment where a row packs several requests
    first_keys:  [rows, queries_per_row] the first context position each query may see: where its request's
                 segment starts (0 unless packed)
    block_table: [rows, context_blocks] block ids of each row's context window: the segments of its requests,
                 each in whole blocks
    masks:       their causal masks (kv_cache.ops.context_mask) by sliding window (None: none), each built by
                 the first layer with that window and reused by the others: every layer of a call gets this
                 same object, and building the mask in each layer cost a sixth of a prefill call over the
                 2048 context on CPU
    """

    positions: torch.Tensor
    first_keys: torch.Tensor
    block_table: torch.Tensor
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass
class PageQueries:
    """Decode rows over KV pages the rows share (kv_cache.ops.page_attention): one query each, or with
    speculative decoding (a verify call) a row's last token and its draft tokens.

    positions:   [rows] absolute position of each row's query, or [rows, queries] of each of its queries
    page_blocks: [pages, blocks_per_page] block ids of each KV page (padding: null block)
    page_rows:   [pages] the row each page belongs to
    page_starts: [pages] position of each page's first key
    masks:       what attention derives from the pages (kv_cache.ops.page_masks) by sliding window, built
                 by the first layer with that window and reused by the others, like TableQueries.masks
    """

    positions: torch.Tensor
    page_blocks: torch.Tensor
    page_rows: torch.Tensor
    page_starts: torch.Tensor
    masks: dict[int | None, ops.PageMasks] = field(default_factory=dict)


@dataclass
class NeuronAttentionMetadata:
    """Per-call attention inputs; all tensors, all of bucketed shape, so a compiled graph never specialises on
    a per-step Python value. A call's tokens are the table queries first, then the paged ones: a prefill call
    has only table queries, a decode call only paged ones (or one table row for a batch of one), and a mixed
    call a prefill chunk followed by decode rows.

    slot_mapping: [tokens] cache slot each new key/value is written to
    """

    slot_mapping: torch.Tensor
    table: TableQueries | None = None
    paged: PageQueries | None = None
    # A fresh prefill call: one request's first chunk at positions 0 .. tokens - 1 (padding after it), which
    # attends over its own keys only (kv_cache.ops.causal_attention), no table and no cache read.
    fresh_prefill: bool = False

    def without_masks(self) -> "NeuronAttentionMetadata":
        """The same inputs, no masks built yet: for a second model on the call (a draft model), whose graph
        then builds them itself wherever it runs, as the first model's does."""
        table = replace(self.table, masks={}) if self.table is not None else None
        paged = replace(self.paged, masks={}) if self.paged is not None else None
        return replace(self, table=table, paged=paged)


def drop_masks(attn_metadata: dict[str, NeuronAttentionMetadata]) -> None:
    """Forget the masks a call's layers built and shared, at the end of the traced forward: left on the
    call's metadata (an input of the graph), dynamo would return each as an output of the graph, which
    TorchNeuron allocates for every call and the call's inputs keep until its step ends (a prefill chunk's
    mask is [1, rows, query heads per KV head x queries, context])."""
    for metadata in attn_metadata.values():
        for queries in (metadata.table, metadata.paged):
            if queries is not None:
                queries.masks.clear()


class NeuronAttentionMetadataBuilder(AttentionMetadataBuilder[NeuronAttentionMetadata]):
    """Required by vLLM's interface; the Neuron model runner builds padded metadata itself."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False) -> NeuronAttentionMetadata:
        raise NotImplementedError(
            "NeuronAttentionBackend metadata is built by worker.step.model_runner for bucketed shapes"
        )


class NeuronAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *fp8.FP8_KV_CACHE_DTYPES]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["NeuronAttentionImpl"]:
        return NeuronAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[NeuronAttentionMetadataBuilder]:
        return NeuronAttentionMetadataBuilder


class NeuronAttentionImpl(AttentionImpl[NeuronAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "attention sinks": sinks is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            f"kv_cache_dtype {kv_cache_dtype} (use auto, or fp8 / fp8_e4m3 for an FP8 cache)": kv_cache_dtype
            not in NeuronAttentionBackend.supported_kv_cache_dtypes,
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
        }
        refused = [name for name, present in unsupported.items() if present]
        if refused:
            raise NotImplementedError(f"Neuron attention does not support {', '.join(refused)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        # Chosen per engine: an FP8 cache's quantize/dequantize ops are traced only where it is one.
        self.fp8 = kv_cache_dtype in fp8.FP8_KV_CACHE_DTYPES
        self.sliding_window = sliding_window
        self.soft_cap = logits_soft_cap or None
        self.kernels = kernels.select(
            envs.VLLM_NEURON_ATTENTION_KERNELS, on_torchneuron_route(get_current_vllm_config_or_none())
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: NeuronAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)
        k_scale = v_scale = None
        if self.fp8:
            # The layer's scales are graph inputs (buffers), so a checkpoint's values change no graph.
            k_scale, v_scale = kv_cache_scales(layer)
            key_bits, value_bits = fp8.quantize(key, k_scale), fp8.quantize(value, v_scale)
            self.kernels.write_kv(kv_cache, key_bits, value_bits, attn_metadata.slot_mapping)
            # A fresh chunk attends over what the cache holds, as it would read it back on any other path.
            key = fp8.dequantize(key_bits, k_scale, query.dtype)
            value = fp8.dequantize(value_bits, v_scale, query.dtype)
        else:
            self.kernels.write_kv(kv_cache, key, value, attn_metadata.slot_mapping)
        if attn_metadata.fresh_prefill:
            # Not a kernel-seam op: TorchNeuron binds this attention to its flash kernel itself.
            out = ops.causal_attention(
                query,
                key,
                value,
                self.scale,
                self.sliding_window,
                self.soft_cap,
            )
            output.view(-1, self.num_heads, self.head_size).copy_(out)
            return output
        parts: list[torch.Tensor] = []
        first_paged = 0
        if (table := attn_metadata.table) is not None:
            rows, queries_per_row = table.positions.shape
            first_paged = rows * queries_per_row
            window = self.sliding_window
            if window not in table.masks:
                context = table.block_table.shape[1] * kv_cache.shape[2]
                group = self.num_heads // self.num_kv_heads
                table.masks[window] = ops.context_mask(
                    table.positions, context, group, query.dtype, table.first_keys, window
                )
            out = self.kernels.table_attention(
                query[:first_paged].view(rows, queries_per_row, self.num_heads, self.head_size),
                kv_cache,
                table.block_table,
                table.positions,
                self.scale,
                table.masks[window],
                self.soft_cap,
                k_scale,
                v_scale,
            )
            parts.append(out.view(first_paged, self.num_heads, self.head_size))
        if (paged := attn_metadata.paged) is not None:
            window = self.sliding_window
            if window not in paged.masks:
                page_tokens = paged.page_blocks.shape[1] * kv_cache.shape[2]
                paged.masks[window] = ops.page_masks(
                    paged.page_rows, paged.page_starts, paged.positions, page_tokens, window
                )
            masks = paged.masks[window]
            parts.append(
                self.kernels.page_attention(
                    query[first_paged:],
                    kv_cache,
                    paged.page_blocks,
                    paged.page_rows,
                    paged.page_starts,
                    paged.positions,
                    self.scale,
                    masks.hidden,
                    masks.owner,
                    masks.ownership,
                    self.soft_cap,
                    k_scale,
                    v_scale,
                )
            )
        # vLLM hands an uninitialised buffer (torch.empty). The table and paged rows are all its rows, written
        # in one copy, so the lowered graph never reads it (torch-mlir lowers such a read to a tensor.empty,
        # which is not StableHLO).
        output.view(-1, self.num_heads, self.head_size).copy_(
            torch.cat(parts) if len(parts) > 1 else parts[0]
        )
        return output
