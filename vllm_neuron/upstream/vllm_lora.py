"""vLLM 0.32's LoRA seam as the plugin reaches it: the wrapper base class the LoRA layers call, the forward
context its ops read the call's adapter slots from, the worker-side adapter manager (private attributes read
here only), and the model manager's activation, whose slot writes the plugin takes over
(worker/lora/images.py). tests/unit/test_lora_punica.py pins what the wrapper relies on (the abstract ops, the
layers' stacked weight shapes, the embedding layer reading `_embeddings_indices`); docs/maintaining.md says
what to do when one moves.
"""

from collections.abc import Callable
from typing import Protocol

import torch
from vllm.forward_context import get_forward_context
from vllm.lora.layers import ColumnParallelLinearWithLoRA, LoRAMapping, RowParallelLinearWithLoRA
from vllm.lora.lora_model import LoRAModel
from vllm.lora.model_manager import LRUCacheLoRAModelManager
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
from vllm.lora.request import LoRARequest
from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
from vllm.model_executor.models import supports_lora

# The attributes of vLLM's LoRA layers that hold the adapter slots, each a tensor or a tuple of tensors
# [max_loras, ...]: all that their set_lora and reset_lora write.
STACKS = ("lora_a_stacked", "lora_b_stacked")


class SlotWriter(Protocol):
    """Where a slot's adapter weights go instead of vLLM's in-place writes into the stacked tensors."""

    def stand_ins(self) -> dict[str, torch.nn.Module]:
        """The wrapped layers, by module name, as vLLM's set_lora and reset_lora should write them."""

    def write(self, index: int) -> None:
        """Write vLLM's slot `index` from what the stand-ins were given."""


class _SlotWritingModelManager(LRUCacheLoRAModelManager):
    """vLLM's LRU model manager whose activation runs vLLM's own set_lora and reset_lora (their slicing for
    tensor parallelism and packed layers included) on `slot_writer`'s stand-ins of the layers, then has the
    writer write the slot."""

    slot_writer: SlotWriter | None = None

    def activate_adapter(self, lora_id: int) -> bool:
        writer = self.slot_writer
        if writer is None:
            return super().activate_adapter(lora_id)
        layers, self.modules = self.modules, writer.stand_ins()
        try:
            activated = super().activate_adapter(lora_id)
        finally:
            self.modules = layers
        if activated:  # False: the adapter was in a slot already, nothing written
            writer.write(self.lora_index_to_id.index(lora_id))
        return activated


class CheckedLoRAManager(LRUCacheWorkerLoRAManager):
    """vLLM's LRU adapter manager whose every loaded adapter goes through `check(adapter, wrapped modules)`
    before it takes a slot: vLLM itself skips an adapter module it did not wrap, silently. Its slot writes go
    through a SlotWriter once `write_slots_through` names one."""

    _manager_cls = _SlotWritingModelManager

    def __init__(self, *args, check: Callable[[LoRAModel, set[str]], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._check = check

    def _load_adapter(self, lora_request: LoRARequest) -> LoRAModel:
        adapter = super()._load_adapter(lora_request)
        self._check(adapter, self._servable_modules())
        return adapter

    def _servable_modules(self) -> set[str]:
        # Wrapped modules, and the per-projection names of the packed ones (q_proj of qkv_proj).
        manager = self._adapter_manager
        packed = {name for key in manager.modules for name in manager.packed_modules.get(key, ())}
        return set(manager.modules) | packed

    def slot_ids(self) -> list[int | None]:
        """The adapter id in each of vLLM's slots (None: free)."""
        return self._adapter_manager.lora_index_to_id

    def wrapped_modules(self) -> dict[str, torch.nn.Module]:
        """The model's layers vLLM replaced by LoRA layers (BaseLayerWithLoRA), by module name."""
        return dict(self._adapter_manager.modules)

    def write_slots_through(self, writer: SlotWriter) -> None:
        """Each adapter activated from now on is written by `writer` (after create_lora_manager)."""
        self._adapter_manager.slot_writer = writer


def split_stack(layer: torch.nn.Module) -> str | None:
    """Which of a LoRA layer's stacked weights tensor parallelism splits across the ranks: B of a
    column-parallel layer (its output is split), A of a row-parallel one (its input is); None where each rank
    holds both whole (the embedding and logits layers, counted so)."""
    if isinstance(layer, ColumnParallelLinearWithLoRA):
        return "lora_b_stacked"
    if isinstance(layer, RowParallelLinearWithLoRA):
        return "lora_a_stacked"
    return None


__all__ = [
    "CheckedLoRAManager",
    "LoRAMapping",
    "LoRAModel",
    "LoRARequest",
    "PunicaWrapperBase",
    "STACKS",
    "SlotWriter",
    "get_forward_context",
    "split_stack",
    "supports_lora",
]
