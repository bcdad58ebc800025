"""Rule (m) of the fake TorchNeuron: reads to the host queued on the device's stream, and the events that
wait for them.

TorchNeuron's copy_neuron_to_cpu submits a read on the current stream and, unless the copy is non-blocking,
synchronizes the stream (csrc/utils/CopyUtils.cpp): a blocking read waits until the stream is idle, work
another thread queued after the tensor's producer included. A non-blocking one returns a host tensor at once
(python_ops/cast_policy.py allocates it) that holds the data only once the stream has run the read; an
Event recorded after it (torch_neuronx/streams.py; csrc/c10/neuron/NeuronEvent.cpp: record queues a signal
unless the stream is idle, query and synchronize see it) says when. Here the device's work is done when its
call returns, so a started read takes its data at once, and the host tensor it returns is filled with a
value no output holds (NaN, the dtype's largest integer) until an event recorded after the read has been
waited on.
"""

import threading
from typing import Any

import torch


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    if like.dtype.is_floating_point:
        return torch.full_like(like, float("nan"))
    if like.dtype == torch.bool:
        return torch.ones_like(like)
    return torch.full_like(like, torch.iinfo(like.dtype).max)


class Stream:
    """The device's one stream as far as reads to the host go: started reads not yet behind an event."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._unfenced: list[tuple[torch.Tensor, torch.Tensor]] = []

    def start_read(self, source: torch.Tensor) -> torch.Tensor:
        """A non-blocking read of `source`: the host tensor it will fill."""
        host = _poisoned(source)
        with self.lock:
            self._unfenced.append((host, source.detach().clone()))
        return host

    def fence(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The reads an event recorded now follows."""
        with self.lock:
            reads, self._unfenced = self._unfenced, []
        return reads


stream = Stream()


class Event:
    """torch.neuron.Event as the plugin uses it (vllm_neuron/device.py's ReadFence): record on the current
    stream, then query (or synchronize) until done, which fills the reads started before the record. The
    fake's device is done at once: the first query answers True."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self._reads: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(self, stream_: Any = None) -> None:
        self._reads = stream.fence()

    def query(self) -> bool:
        import torch_neuronx

        torch_neuronx.runtime.count("event_waits")
        for host, data in self._reads:
            host.copy_(data)
        self._reads = []
        return True

    def synchronize(self) -> None:
        self.query()
