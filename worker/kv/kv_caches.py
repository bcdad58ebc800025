"""The paged KV cache's tensors on the device: the spec vLLM sizes them from, their allocation (zeroed, and
bound to vLLM's attention layers), and their release for sleep mode."""

from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING

import torch
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kv_cache import layout
from vllm_neuron.upstream.vllm_runner import bind_kv_cache

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def _full_attention(spec: KVCacheSpec) -> KVCacheSpec:
    """A sliding-window layer's cache is managed as full attention (blocks kept for every position), its
    window applied by the attention masks: one KV cache group, one block table per request, and no block
    swapped for the null block as it leaves the window. Costs KV memory past the window (vLLM does the same
    when its hybrid KV cache manager is off)."""
    if not isinstance(spec, SlidingWindowSpec):
        return spec
    shared = {f.name: getattr(spec, f.name) for f in fields(AttentionSpec)}
    return FullAttentionSpec(**shared, sliding_window=spec.sliding_window)


class KVCaches:
    """Every attention layer's cache, `[2 * kv_heads, blocks, block_size, head_size]` (kv_cache/layout.py)."""

    def __init__(self, vllm_config: "VllmConfig", device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.config: KVCacheConfig | None = None
        self.tensors: list[torch.Tensor] = []  # bound by vLLM's bind_kv_cache, in layer order
        self.layers: list[str] = []

    def spec(self) -> dict[str, KVCacheSpec]:
        layers = self.vllm_config.compilation_config.static_forward_context
        return {
            name: _full_attention(spec)
            for name, layer in layers.items()
            if isinstance(layer, Attention)
            and (spec := layer.get_kv_cache_spec(self.vllm_config)) is not None
        }

    def allocate(self, config: KVCacheConfig, zeros: Callable[..., torch.Tensor]) -> None:
        """Allocate every layer's cache with `zeros` (the compile recorder's: under xla, XLA's memory), and
        bind it to the attention layers."""
        self.config = config
        caches: dict[str, torch.Tensor] = {}
        for group in config.kv_cache_groups:
            for name in group.layer_names:
                spec = group.kv_cache_spec
                if isinstance(spec, UniformTypeKVCacheSpecs):  # a draft model's layers of another size
                    spec = spec.kv_cache_specs[name]
                assert isinstance(spec, AttentionSpec)
                caches[name] = layout.allocate(
                    config.num_blocks,
                    spec.block_size,
                    spec.num_kv_heads,
                    spec.head_size,
                    spec.dtype,
                    self.device,
                    zeros,
                )
        bind_kv_cache(caches, self.vllm_config.compilation_config.static_forward_context, self.tensors)
        self.layers = list(caches)  # every call gives each of them the same metadata

    def release(self) -> None:
        """Drop every layer's cache (this object and the attention layers hold its only references)."""
        layers = self.vllm_config.compilation_config.static_forward_context
        for name in self.layers:
            layers[name].kv_cache = torch.tensor([])  # what an attention layer holds before bind_kv_cache
        self.tensors.clear()

    def by_layer(self) -> dict[str, torch.Tensor]:
        """Each attention layer's cache, as bound to it."""
        layers = self.vllm_config.compilation_config.static_forward_context
        return {name: layers[name].kv_cache for name in self.layers}

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can hold (block 0 is vLLM's null block)."""
        return self.tensors[0].shape[1] - 1 if self.tensors else 0
