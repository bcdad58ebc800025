"""A call's host arrays in one transfer: packed into one byte buffer on the host, written into a device buffer
that lives as long as the worker, and handed to the graph as views of it (each a dense run of the buffer: no
copy, no kernel). TorchNeuron makes each host-to-device copy that creates a tensor an allocation and a runtime
transfer of its own, and a blocking one waits for every graph already submitted (copy_cpu_to_neuron,
csrc/utils/CopyUtils.cpp); a call has about ten arrays.

A device buffer serves every call of one layout (one bucket's arrays) sent from one thread. Threads have
buffers of their own: the device's one stream runs a thread's transfers and calls in the order that thread
submitted them, so a call always reads its own inputs, while another thread's transfer could land between a
call's and its run."""

import threading
from dataclasses import dataclass

import numpy as np
import torch

from vllm_neuron import device as neuron_device

# Every array starts at a multiple of this many bytes: the widest element (int64), so that each byte range
# may be viewed as its own dtype.
ALIGN = 8

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}

Layout = tuple[tuple[int, np.dtype, tuple[int, ...]], ...]  # each array's byte offset, dtype and shape


@dataclass
class Packed:
    """A call's arrays packed into one host buffer, their names, and where each lies in it."""

    buffer: np.ndarray  # uint8
    names: tuple[str, ...]
    layout: Layout


def pack(arrays: dict[str, np.ndarray]) -> Packed:
    """The arrays in one host buffer, each at an ALIGN-ed offset."""
    layout, total = [], 0
    for array in arrays.values():
        if array.dtype not in _TORCH_DTYPES:
            raise TypeError(f"a call input of dtype {array.dtype}: only {list(_TORCH_DTYPES)} are packed")
        layout.append((total, array.dtype, array.shape))
        total += -(-array.nbytes // ALIGN) * ALIGN
    buffer = np.zeros(total, dtype=np.uint8)
    for array, (offset, _, _) in zip(arrays.values(), layout, strict=True):
        buffer[offset : offset + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
    return Packed(buffer, tuple(arrays), tuple(layout))


class StagingBuffers:
    """The worker's device buffers for call inputs: one per layout and sending thread, made at its first call
    (warm-up runs every bucket) and written in place by each later one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, Layout | int], torch.Tensor] = {}
        self._lock = threading.Lock()  # the device thread and a background compile may add buffers at once

    def send(self, packed: Packed) -> dict[str, torch.Tensor]:
        """The packed arrays on the device, by name, in one transfer that does not wait for the device: each
        a view of this thread's buffer for the layout, with its dtype and shape."""
        staging = self.send_bytes(packed.buffer, packed.layout)
        return {
            name: staging[offset : offset + int(np.prod(shape)) * dtype.itemsize]
            .view(_TORCH_DTYPES[dtype])
            .view(shape)
            for name, (offset, dtype, shape) in zip(packed.names, packed.layout, strict=True)
        }

    def send_bytes(self, buffer: np.ndarray, layout: Layout | None = None) -> torch.Tensor:
        """A host byte buffer (any dtype, viewed as bytes) on the device, in one transfer that does not wait
        for the device, into this thread's buffer for `layout` (default: the buffer's size)."""
        key = (threading.current_thread().name, layout or buffer.nbytes)
        staging = self._buffers.get(key)
        if staging is None:
            with self._lock:
                staging = self._buffers.setdefault(
                    key, torch.empty(buffer.nbytes, dtype=torch.uint8, device=self.device)
                )
        neuron_device.copy_to_device(staging, torch.from_numpy(buffer.view(np.uint8)))
        return staging

    @property
    def nbytes(self) -> int:
        """Device bytes the buffers hold."""
        return sum(buffer.numel() for buffer in self._buffers.values())
