"""`torch.neuron` of the fake TorchNeuron: what vllm_neuron/device.py calls, answering as the Neuron runtime
would, and starting the (fake) runtime where the real calls start it."""

import os
from types import SimpleNamespace

import torch

import torch_neuronx
from torch_neuronx.streams import Event  # noqa: F401  (torch.neuron.Event, rule (m))


def is_available() -> bool:
    return torch_neuronx.device_count() > 0


def device_count() -> int:
    return torch_neuronx.device_count()


def set_device(device: torch.device | int) -> None:
    """Valid indices: every visible core, or in a process group only this process's own (its local rank)."""
    index = getattr(device, "index", device)
    own = torch_neuronx.runtime.facts.get("local_rank")
    valid = [own] if own is not None else list(range(device_count()))
    if index not in valid:
        raise ValueError(f"Device index {index} is out of range for this process (valid: {valid})")


def synchronize(device: torch.device | int | None = None) -> None:
    torch_neuronx.runtime.synchronize()


def empty_cache() -> None:
    return None


def manual_seed_all(seed: int) -> None:
    # Device generators live on the host: seeding does not start the runtime.
    return None


def get_device_properties(device: torch.device | int | None = None) -> SimpleNamespace:
    torch_neuronx.runtime.start("get_device_properties")
    torch_neuronx.runtime.check_memory_index("get_device_properties", getattr(device, "index", device))
    total = int(os.environ.get("FAKE_NEURON_TOTAL_MEMORY", 24 * 1024**3))
    return SimpleNamespace(name="NeuronCore-v3 (fake)", total_memory=total)


def memory_allocated(device: torch.device | int | None = None) -> int:
    torch_neuronx.runtime.start("memory_allocated")
    torch_neuronx.runtime.check_memory_index("memory_allocated", getattr(device, "index", device))
    return 0


def memory_reserved(device: torch.device | int | None = None) -> int:
    # TorchNeuron's allocator does not cache: reserved bytes are always 0.
    torch_neuronx.runtime.start("memory_reserved")
    return 0
