"""How an adapter reaches its slot: each slot of a stacked adapter weight written whole, from the host.

vLLM's LoRA layers write a slot in place on the device: `stacked[index] = 0` (reset_lora), then
`stacked[index, 0, :rows, :rank].copy_(weights)`. On TorchNeuron the first is an eager copy of an expanded
scalar, a kernel neuronx-cc compiles on first use, and the second, where the adapter's rank is below
max_lora_rank, is a write into a view with gaps: a compiled transpose, then the whole stacked tensor (every
slot) to the host and back, blocking (fake TorchNeuron's rules (k) and (l),
tests/fake_neuron/torch_neuronx/eager_ops.py, with their sources).
A slot itself, `stacked[index]`, is contiguous: a host tensor copied into it is one runtime write.

So vLLM's own set_lora and reset_lora (their tensor-parallel slicing and packed layers included) run on
stand-ins of the layers whose stacked weights are host images of one slot, zero-padded to the slot's full
shape, and each image goes to the device in one contiguous copy per stacked tensor. A layer the adapter
does not touch gets vLLM's reset_lora: its zero image is written the same way, so no fill kernel runs. The
device is never read."""

import copy

import torch

from vllm_neuron import device as neuron_device
from vllm_neuron.upstream.vllm_lora import STACKS


class SlotImages:
    """A host image of one slot of each stacked adapter weight of the wrapped layers (the slot bytes over
    max_loras, allocated once), and stand-ins of the layers that write into them."""

    def __init__(self, layers: dict[str, torch.nn.Module]) -> None:
        self._stand_ins: dict[str, torch.nn.Module] = {}
        self._slots: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device stacked weight, host image)
        for name, layer in layers.items():
            stand_in = copy.copy(layer)  # shares everything but the stacked weights set below
            for stack in STACKS:
                if stack not in vars(layer):
                    raise TypeError(f"{type(layer).__name__} has no {stack} attribute: its slots are unknown")
                held = getattr(layer, stack)
                stacked = held if isinstance(held, tuple) else (held,)
                images = [torch.zeros(t.shape[1:], dtype=t.dtype, device="cpu") for t in stacked]
                self._slots.extend(zip(stacked, images, strict=True))
                # Every slot index reads the one image (stride 0), so vLLM's code writes whichever it names.
                views = tuple(image.expand(t.shape) for image, t in zip(images, stacked, strict=True))
                vars(stand_in)[stack] = views if isinstance(held, tuple) else views[0]
            self._stand_ins[name] = stand_in

    def stand_ins(self) -> dict[str, torch.nn.Module]:
        """The stand-ins, their images zeroed: vLLM's set_lora writes only the adapter's rows and rank."""
        for _, image in self._slots:
            image.zero_()
        return self._stand_ins

    def write(self, index: int) -> None:
        """The images into vLLM's slot `index`, each through the device's host-to-device seam: a write that
        waits for no graph, after which the images may be rewritten at once."""
        for stacked, image in self._slots:
            neuron_device.copy_to_device(stacked[index], image)
