"""A call's host arrays in one transfer: packed into one byte buffer that crosses to the device at once, and
handed to the graph as views of it (each a dense run of the buffer: no copy, no kernel). TorchNeuron makes
each host-to-device copy an allocation and a runtime transfer of its own; a call has about ten arrays."""

import numpy as np
import torch

from vllm_neuron import device as neuron_device

# Every array starts at a multiple of this many bytes: the widest element (int64), so that each byte range
# may be viewed as its own dtype.
ALIGN = 8

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}


def send(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays on the device, in one transfer: each a view of one buffer, with its dtype and shape."""
    offsets, total = [], 0
    for array in arrays:
        if array.dtype not in _TORCH_DTYPES:
            raise TypeError(f"a call input of dtype {array.dtype}: only {list(_TORCH_DTYPES)} are packed")
        offsets.append(total)
        total += -(-array.nbytes // ALIGN) * ALIGN
    buffer = np.zeros(total, dtype=np.uint8)
    for array, offset in zip(arrays, offsets, strict=True):
        buffer[offset : offset + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
    on_device = neuron_device.to_device(buffer, device)
    return [
        on_device[offset : offset + array.nbytes].view(_TORCH_DTYPES[array.dtype]).view(array.shape)
        for array, offset in zip(arrays, offsets, strict=True)
    ]
