"""A step's state between the moments of its story, shared by the step's modules: the planned calls, the
calls' outputs and the reads started behind them, and the step in flight until its output is made."""

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from vllm_neuron import device as neuron_device
from vllm_neuron.calls import Call
from worker.step.call_inputs import CallInputs, HostInputs
from worker.step.packed_inputs import Packed, StagingBuffers

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput


@dataclass
class RunningStep:
    """A step from execute_model until its output is made: its calls run (on the device thread with async
    scheduling), then sample_tokens or, with async scheduling, the engine or the next step asks for its
    output (the grammar bitmask arrives in between). Times are time.perf_counter()."""

    scheduler_output: "SchedulerOutput"
    planned: "list[PlannedCall]"
    partial_prefill_rows: list[int]
    # The batch as the step was prepared (the next step may update it before this one's output is made).
    req_ids: list[str]
    host_rows: list[bool]  # rows that need vLLM's host sampler: their logits come to the host
    num_logprobs: int | None  # the most logprobs a row asks for (None: no row asks)
    started: float  # execute_model
    schedule_seconds: float | None  # the engine's time since the previous step (None: it may have idled)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # batch row -> the draft tokens it verifies
    # Requests whose sampled token is final in the token slots -> its slot (worker/step/token_slots.py).
    final_slots: dict[str, int] = field(default_factory=dict)
    prepare_seconds: float = 0.0
    outputs: "list[CallOutputs] | Future" = field(default_factory=list)  # in call order: later rows win
    forward_seconds: float = 0.0
    device_started: float = 0.0
    device_ended: float = 0.0
    grammar_output: "GrammarOutput | None" = None
    result: ModelRunnerOutput | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    figures: "StepFigures | None" = None  # what /metrics and the step trace get, once the output is made
    tokens: np.ndarray | None = None  # each row's token, once the output is made
    tokens_ready: threading.Event = field(default_factory=threading.Event)  # set then (or on failure)
    # The step still running when this one was prepared, and its outputs: fills come from them.
    previous: "RunningStep | None" = None
    previous_outputs: "list[CallOutputs] | Future | None" = None
    kv_connector_output: KVConnectorOutput | None = None  # --kv-transfer-config: filled once its calls end

    @property
    def host_bound(self) -> bool:
        return any(self.host_rows)


@dataclass
class StepFigures:
    ended: float  # when the output was made
    sample_seconds: float
    host_seconds: float | None  # the device's idle time since the previous step's calls (None: not after one)
    to_host_bytes: int
    sampled_on_host: bool


@dataclass
class PlannedCall:
    """One compiled call of a step: its inputs, packed for one transfer on the device thread, and the
    batch rows of its first logits rows."""

    call: Call
    host: HostInputs
    sampling_rows: np.ndarray  # [logits rows, sampling.PARAMS], as sent
    token_feed: np.ndarray  # worker/step/token_slots.py
    token_keep: np.ndarray
    batch_rows: list[int]
    # Decode rows whose token is the previous step's sample that the graph may leave to the host: (index in
    # input_ids, request id), filled in on the device thread before the inputs are packed.
    fills: list[tuple[int, str]] = field(default_factory=list)
    lora: bool = False  # send the LoRA slots too (--enable-lora)
    packed: Packed | None = None  # None until packed

    def pack(self) -> None:
        self.packed = self.host.pack(self.sampling_rows, self.token_feed, self.token_keep, self.lora)

    def send(self, staging: StagingBuffers) -> CallInputs:
        """The call's inputs on the device, sent from the thread that runs it
        (worker/step/packed_inputs.py)."""
        return self.host.send(staging, self.packed)


@dataclass
class CallOutputs:
    """A compiled call's outputs (device tensors), for the batch rows its first rows are."""

    batch_rows: list[int]
    logits: torch.Tensor
    token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    draft_probs: torch.Tensor
    queries: int = 1  # logits rows a batch row has (a verify call's: its last token's, then its drafts')
    # Outputs whose batch rows are on their way to the host (start_reads), and the fence behind the reads.
    reads: dict[str, torch.Tensor] = field(default_factory=dict)
    fence: neuron_device.ReadFence | None = None

    def rows(self, name: str) -> torch.Tensor:
        """Output `name`'s rows of the batch rows (every query of each), on the device: a contiguous prefix,
        as a read to the host needs (TorchNeuron makes a strided device view contiguous first, with an eager
        kernel compiled per shape)."""
        return getattr(self, name)[: len(self.batch_rows) * self.queries]

    def host(self, name: str, to_host: "ToHost") -> torch.Tensor:
        """Output `name`'s rows on the host: the read the device thread started, once the device has passed
        its fence; else a read now, which waits for all the device has queued."""
        if name in self.reads:
            return to_host.arrived(self.reads[name], self.fence)
        return to_host(self.rows(name))

    def part(self, name: str, rows: slice, to_host: "ToHost") -> torch.Tensor:
        """Some of output `name`'s rows on the host (a top-p overflow's logits): from the started read where
        there is one, else read now."""
        if name in self.reads:
            return self.host(name, to_host)[rows]
        return to_host(getattr(self, name)[rows])

    def real(self, name: str, to_host: "ToHost") -> torch.Tensor:
        """The batch rows' output `name` on the host: of each row's first query (a verify row's last
        token)."""
        return self.host(name, to_host)[:: self.queries]

    def all_queries(self, name: str, to_host: "ToHost") -> torch.Tensor:
        """[batch rows, queries, ...]: every query's output `name` on the host (a verify call's)."""
        host = self.host(name, to_host)
        return host.view(len(self.batch_rows), self.queries, *host.shape[1:])


def start_reads(step: "RunningStep", outputs: list[CallOutputs]) -> None:
    """On the device thread, right after a step's calls: the outputs the step's output is made of start for
    the host (the tokens; logprobs where a row asks; logits where a row samples on the host; a verify call's
    draft probabilities), and a fence goes behind them. The engine thread then waits for the work before
    the fence only: a read it started itself would queue behind the next step's calls, which async
    scheduling has submitted by then, and wait for them too."""
    names = ["token_ids"]
    if step.num_logprobs is not None:
        names += ["logprob_token_ids", "logprobs", "ranks"]
    if step.host_bound:
        names.append("logits")
    try:
        for out in outputs:
            for name in [*names, "draft_probs"] if out.queries > 1 else names:
                out.reads[name] = neuron_device.start_read(out.rows(name))
        fence = neuron_device.ReadFence()
    except BaseException:
        neuron_device.synchronize()  # the reads queued so far must land before their host tensors go
        raise
    for out in outputs:
        out.fence = fence


class ToHost:
    """Device-to-host copies of one step, counted in bytes."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += tensor.numel() * tensor.element_size()
        return neuron_device.to_host(tensor)

    def arrived(self, host: torch.Tensor, fence: neuron_device.ReadFence) -> torch.Tensor:
        """A read started earlier, once the device has passed `fence`."""
        fence.wait()
        self.bytes += host.numel() * host.element_size()
        return host


def final_rows(outputs: list[CallOutputs]) -> dict[int, tuple[int, int]]:
    """Batch row -> (call, row in the call) of the call whose sample is the row's: the last one (a prompt's
    sub-chunks each sample its row; the last part gives its token)."""
    final = {}
    for call_index, out in enumerate(outputs):
        for j, row in enumerate(out.batch_rows):
            final[row] = (call_index, j * out.queries)  # a verify row's first query
    return final
