"""The runner's LoRA side (--enable-lora): vLLM's adapter manager wraps the model's layers before it is
compiled, each step's adapters are activated into vLLM's fixed slots (each slot written whole from the host,
worker/lora/images.py), and each batch row gets its slot, which the call inputs carry per token
(worker/step/call_inputs.py) and the punica wrapper reads (vllm_neuron/lora/punica.py).
docs/research/issue-39-lora.md."""

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from vllm_neuron import metrics
from vllm_neuron.upstream.vllm_lora import (
    STACKS,
    CheckedLoRAManager,
    LoRAMapping,
    LoRAModel,
    split_stack,
    supports_lora,
)
from worker.lora.images import SlotImages

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.worker.gpu_input_batch import InputBatch

# One fixed mapping: the wrapper ignores it (the slots are call inputs), so vLLM calls update_metadata only
# when the slot layout changes.
_MAPPING = LoRAMapping((0,), (0,), is_prefill=True)


def refuse_unservable(adapter: LoRAModel, servable: set[str]) -> None:
    """An adapter module outside the wrapped ones would be skipped, the adapter served wrong: refuse it."""
    missing = sorted(set(adapter.loras) - servable)
    if missing:
        raise ValueError(
            f"LoRA adapter {adapter.id} targets modules the adapter slots do not hold: {', '.join(missing)} "
            "(widen --lora-target-modules, or serve an adapter without them)"
        )


class LoRASlots:
    """vLLM's worker-side LRU adapter manager over `max_loras` device slots, with the plugin's slot numbering:
    0 the base model, k vLLM's slot k - 1."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        device: torch.device,
        submit: Callable[[Callable[[], object]], Future] | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self._submit = submit  # the device thread's, where a step's calls run on a thread of their own
        self.manager: CheckedLoRAManager | None = None
        self.images: SlotImages | None = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model with its layers replaced by vLLM's LoRA layers (before it is compiled)."""
        if not supports_lora(model):
            raise ValueError(f"{type(model).__name__} does not support LoRA")
        self.manager = CheckedLoRAManager(
            self.vllm_config, self.device, model.embedding_modules, check=refuse_unservable
        )
        wrapped = self.manager.create_lora_manager(model, self.vllm_config)
        self.images = SlotImages(self.manager.wrapped_modules())  # worker/lora/images.py
        self.manager.write_slots_through(self.images)
        return wrapped

    def warm_up(self) -> None:
        """Write vLLM's slot 0 (free: no adapter is loaded yet) with zero images through the path a load
        takes, so that the first load is not the first write of its kind."""
        self._write(lambda: self.images.write(0))

    def activate(self, batch: "InputBatch") -> list[int]:
        """Each batch row's slot, its adapter activated first."""
        requests = set(batch.lora_id_to_lora_request.values())
        writes = any(request.load_inplace for request in requests)  # a reload of an active adapter
        if writes or not {request.lora_int_id for request in requests} <= set(self.manager.slot_ids()):
            self._write(lambda: self.manager.set_active_adapters(requests, _MAPPING))
        else:
            self.manager.set_active_adapters(requests, _MAPPING)  # LRU order and metadata only: no write
        slot_of = {lora_id: index + 1 for index, lora_id in enumerate(self.manager.slot_ids()) if lora_id}
        return [slot_of.get(int(lora_id), 0) for lora_id in batch.request_lora_mapping[: batch.num_reqs]]

    def _write(self, writes: Callable[[], object]) -> object:
        # Slot writes go after the calls already submitted to the device thread: they may read a slot that
        # is about to be taken.
        result = self._submit(writes).result() if self._submit is not None else writes()
        metrics.LORA_ADAPTERS_LOADED.set(sum(lora_id is not None for lora_id in self.manager.slot_ids()))
        return result

    def slot_bytes(self) -> int:
        """Device bytes of the stacked adapter weights: plain attributes of the LoRA layers, neither
        parameters nor buffers, so the weights' count misses them."""
        return sum(whole + split for whole, split in self.bytes_by_module().values())

    def bytes_by_module(self) -> dict[str, tuple[int, int]]:
        """Each wrapped module's slot bytes on this rank: those every rank holds whole, and those tensor
        parallelism splits across the ranks (split_stack)."""
        found = {}
        for name, layer in self.manager.wrapped_modules().items():
            whole = split = 0
            for stack in STACKS:
                stacked = getattr(layer, stack)
                size = sum(
                    t.numel() * t.element_size()
                    for t in (stacked if isinstance(stacked, tuple) else (stacked,))
                )
                if stack == split_stack(layer):
                    split += size
                else:
                    whole += size
            found[name] = (whole, split)
        return found

    def info(self) -> dict[str, object]:
        """The slots' configuration, the adapter id in each (None: free) and their bytes."""
        lora = self.vllm_config.lora_config
        return {
            "max_loras": lora.max_loras,
            "max_lora_rank": lora.max_lora_rank,
            "slots": list(self.manager.slot_ids()),
            "slot_bytes": self.slot_bytes(),
        }

    def add(self, request: "LoRARequest") -> bool:
        return self._write(lambda: self.manager.add_adapter(request))

    def remove(self, lora_id: int) -> bool:
        return self._write(lambda: self.manager.remove_adapter(lora_id))

    def pin(self, lora_id: int) -> bool:
        return self._write(lambda: self.manager.pin_adapter(lora_id))  # activates it where it is not

    def list(self) -> set[int]:
        return self.manager.list_adapters()
