"""vLLM's sleep mode on the runner's tensors: the KV cache freed, and the weights moved to host memory (level
1) or discarded (level 2: the target's weights, to be loaded again), then brought back by wake_up. The
compiled graphs take the weights and the KV cache as inputs and guard on their shapes, strides, dtypes and
devices only, so the tensors wake_up brings back run them as they are: no recompile."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_neuron import device as neuron_device
from worker.kv.kv_caches import KVCaches

TAGS = ("weights", "kv_cache")


@dataclass
class _ReleasedTensor:
    """A weight or buffer while sleep mode has released it: its awake place and layout, and whether its data
    was kept (in host memory) or discarded (sleep level 2's weights)."""

    tensor: torch.Tensor
    device: torch.device
    size: torch.Size
    stride: tuple[int, ...]
    kept: bool


class SleepMode:
    def __init__(self, kv_caches: KVCaches) -> None:
        self.kv_caches = kv_caches
        self.sleeping: set[str] = set()  # "weights" and/or "kv_cache" while released
        self._released: list[_ReleasedTensor] = []

    def release_kv_cache(self) -> None:
        """Free the KV cache (its contents are lost: vLLM resets the prefix cache before it sleeps)."""
        if "kv_cache" not in self.sleeping:
            self.kv_caches.release()
            self.sleeping.add("kv_cache")

    def sleep(self, level: int, models: list[torch.nn.Module]) -> None:
        """Level 1: free the KV cache and move the weights and buffers of `models` to host memory. Level 2:
        the same, but the first model's parameters are discarded (reload_weights loads the target's; a draft
        model's weights are kept)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: the worker sleeps at level 1 or 2")
        self.release_kv_cache()
        if "weights" in self.sleeping:
            return
        parameters = {id(t): t for model in models for t in model.parameters()}
        buffers = [
            t
            for t in {id(t): t for model in models for t in model.buffers()}.values()
            if id(t) not in parameters
        ]
        discarded = {id(t) for t in models[0].parameters()} if level == 2 else set()
        self._released = []
        for tensor in [*parameters.values(), *buffers]:
            keep = id(tensor) not in discarded
            self._released.append(_ReleasedTensor(tensor, tensor.device, tensor.shape, tensor.stride(), keep))
        kept = [released.tensor for released in self._released if released.kept]
        hosts = iter(neuron_device.read_now([tensor.data for tensor in kept]))
        for released in self._released:
            tensor = released.tensor
            if released.kept:
                tensor.data = next(hosts)
            else:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        self.sleeping.add("weights")

    def wake_up(self, tags: list[str] | None, allocate_kv_cache: Callable[[], None]) -> None:
        """Bring back what sleep released: the weights to their devices (after level 2: zeroed, to be loaded
        again), and, by `allocate_kv_cache`, a new zeroed KV cache of as many blocks. `tags` (vLLM's):
        "weights", "kv_cache", or None for both."""
        wanted = set(tags) if tags is not None else set(TAGS)
        unknown = wanted - set(TAGS)
        if unknown:
            raise ValueError(f"unknown sleep-mode tags {sorted(unknown)}: use 'weights' and 'kv_cache'")
        if "weights" in wanted & self.sleeping:
            for released in self._released:
                tensor, device = released.tensor, released.device
                if released.kept:
                    tensor.data = tensor.data.to(device)
                else:  # level 2: zeros until the weights are loaded again
                    empty = torch.empty_strided(
                        released.size, released.stride, dtype=tensor.dtype, device=device
                    )
                    tensor.data = empty.zero_()
            self._released = []
            self.sleeping.discard("weights")
        if "kv_cache" in wanted & self.sleeping:
            allocate_kv_cache()
            self.sleeping.discard("kv_cache")
        neuron_device.synchronize()
