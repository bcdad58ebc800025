"""A step's state between the moments of its story: the planned calls, the calls' outputs and the reads
started behind them, the step in flight until its output is made, the token hand-off to the next step, and
the step's tokens on the host.

The token hand-off: a decode row whose token the previous step sampled takes it on the device (an index into
the token slots inside the next call's graph), not through the host: AWS's plugin feeds each sampled token to
the next step device to device too. The slots: [1 + 2 * max rows] int32. Slot 0 is the null slot: padding
rows write there and a token fed from it is never read (`token_feed` 0 means: the id in input_ids). A step
writes its rows' tokens into one half, at its base + batch row (later calls of the step overwrite earlier
ones: a prompt's last sub-chunk gives its token), and reads the previous step's half, so that a step whose
first call writes a row never overwrites a token a later call of the same step reads. The compiled graph
reads before it samples and writes after. A token in the slots may not be final: where a row's top-p cut may
lie beyond the graph's candidates the graph leaves NO_TOKEN (vllm_neuron/sampling.py) and the host samples
the row. Such a row's token is filled in on the host, on the device thread, once the previous step's calls
end (`fill_previous_tokens`).

The tokens on the host (`TokenCollector`): the graph's samples, whose reads start right after the calls;
rows whose top-p cut lay beyond the graph's candidates sampled again on the host; and on a step with a
request the graph cannot sample, vLLM's Sampler over the step's logits (the rows the graph sampled keep its
tokens)."""

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import KVConnectorOutput, LogprobsTensors, ModelRunnerOutput

from vllm_neuron import device as neuron_device
from vllm_neuron import sampling
from vllm_neuron.calls import Call
from vllm_neuron.upstream.vllm_runner import Sampler, apply_grammar_bitmask
from worker.step.call_inputs import CallInputs, HostInputs, Packed, StagingBuffers

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import InputBatch


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
    # Requests whose sampled token is final in the token slots -> its slot (below).
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
    token_feed: np.ndarray  # the token hand-off (below)
    token_keep: np.ndarray
    batch_rows: list[int]
    # Decode rows whose token is the previous step's sample that the graph may leave to the host: (index in
    # input_ids, request id), filled in on the device thread before the inputs are packed.
    fills: list[tuple[int, str]] = field(default_factory=list)
    lora: bool = False  # send the LoRA slots too (--enable-lora)
    packed: Packed | None = None  # None until packed
    extra: dict[str, np.ndarray] | None = None  # an EAGLE3 head's arrays (worker/spec_decode/head_inputs.py)

    def pack(self) -> None:
        self.packed = self.host.pack(
            self.sampling_rows, self.token_feed, self.token_keep, self.lora, self.extra
        )

    def send(self, staging: StagingBuffers) -> CallInputs:
        """The call's inputs on the device, sent from the thread that runs it
        (worker/step/call_inputs.py)."""
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


# ---- the token hand-off between steps ----------------------------------------------------------------


def token_slot_count(max_num_seqs: int) -> int:
    return 1 + 2 * max_num_seqs


def next_base(previous_base: int, max_num_seqs: int) -> int:
    """The half a step writes: the other one than the step before it."""
    return 1 + max_num_seqs if previous_base == 1 else 1


class Halves:
    """Which half of the slots the latest step wrote."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.base = 1

    def next(self) -> int:
        """The base of the half the next step writes."""
        self.base = next_base(self.base, self.max_num_seqs)
        return self.base


@dataclass
class Fills:
    """Decode rows (batch rows) whose token the previous step is still sampling: where each comes from."""

    from_slots: dict[int, int] = field(default_factory=dict)  # -> its slot
    from_host: dict[int, str] = field(default_factory=dict)  # -> its request id (fill_previous_tokens)

    def add(self, row: int, req_id: str, previous: "RunningStep | None") -> None:
        """A row from the slots where the previous step's token is final there, else from the host."""
        if previous is None:
            raise RuntimeError(f"request {req_id}: its next token is neither known nor being sampled")
        slot = previous.final_slots.get(req_id)
        if slot is None:
            self.from_host[row] = req_id
        else:
            self.from_slots[row] = slot

    def feed(
        self, decode_rows: list[int], token_index: np.ndarray, tokens: int
    ) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """A call's token feed ([tokens]: each token's slot, 0: its own id) for its decode rows (batch rows,
        whose tokens are at `token_index` in input_ids), and the (index in input_ids, request id) of the
        rows whose token the host fills in."""
        feed = np.zeros(tokens, dtype=np.int64)
        host_fills = []
        for row, index in zip(decode_rows, token_index.tolist(), strict=False):
            if row in self.from_slots:
                feed[index] = self.from_slots[row]
            elif row in self.from_host:
                host_fills.append((index, self.from_host[row]))
        return feed, host_fills


def keep_slots(base: int, batch_rows: list[int], rows: int, queries: int) -> np.ndarray:
    """[rows]: where each logits row's sampled token goes. A verify call's go nowhere: its rows' tokens are
    decided on the host (accepted drafts)."""
    slots = np.zeros(rows, dtype=np.int64)
    if queries == 1:
        slots[: len(batch_rows)] = base + np.asarray(batch_rows, dtype=np.int64)
    return slots


def final_slots(
    req_ids: list[str],
    may_overflow: list[bool],
    partial_rows: list[int],
    verify_rows: dict[int, list[int]],
    base: int,
) -> dict[str, int]:
    """Requests whose sample in the graph is their next token, -> its slot: not a partial prefill's (its
    sample is discarded), nor a verify row's (its token is the accepted drafts'), nor a row whose top-p cut
    may lie beyond the graph's candidates (`may_overflow`, each row's sampling.may_overflow: NO_TOKEN, the
    host samples it)."""
    skip = set(partial_rows) | set(verify_rows)
    return {
        req_id: base + row for row, req_id in enumerate(req_ids) if row not in skip and not may_overflow[row]
    }


def fill_previous_tokens(step: "RunningStep") -> None:
    """On the device thread, once the previous step's calls ended: its samples into this step's decode rows
    that take them from the host (rows the graph may have left to the host: NO_TOKEN waits for that step's
    output), then those calls' inputs are packed."""
    previous, outputs = step.previous, step.previous_outputs
    step.previous = step.previous_outputs = None  # no chain of steps kept alive
    waiting = [item for item in step.planned if item.fills]
    if not waiting:
        return
    if isinstance(outputs, Future):
        outputs = outputs.result()
    final = final_rows(outputs)
    row_of = {req_id: row for row, req_id in enumerate(previous.req_ids)}
    wanted = {row_of[req_id] for item in waiting for _, req_id in item.fills}
    tokens: dict[int, int] = {}
    for call_index in sorted({final[row][0] for row in wanted}):
        out = outputs[call_index]
        sampled = out.real("token_ids", ToHost()).tolist()
        tokens |= {row: sampled[j] for j, row in enumerate(out.batch_rows) if final[row][0] == call_index}
    if any(tokens[row] == sampling.NO_TOKEN for row in wanted):
        previous.tokens_ready.wait()
        if previous.tokens is None:
            raise RuntimeError("the previous step failed: its tokens are missing")
        tokens = {row: int(previous.tokens[row]) for row in wanted}
    for item in waiting:
        item.host.input_ids = item.host.input_ids.copy()
        for index, req_id in item.fills:
            item.host.input_ids[index] = tokens[row_of[req_id]]
        item.pack()


# ---- the step's tokens on the host -------------------------------------------------------------------


DeviceLogprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # token ids, logprobs, ranks per row


@dataclass
class StepTokens:
    tokens: np.ndarray  # each batch row's token
    logprobs: LogprobsTensors | None
    on_host: bool  # some row was sampled on the host (vLLM's sampler, or a top-p overflow)


class TokenCollector:
    def __init__(self, sampler: Sampler, vocab_size: int) -> None:
        self.sampler = sampler
        self.vocab_size = vocab_size

    def collect(self, step: "RunningStep", batch: "InputBatch", to_host: ToHost) -> StepTokens:
        """The step's tokens to the host, vLLM's sampler where a row needs it."""
        rows = len(step.req_ids)
        tokens = np.empty(rows, dtype=np.int64)
        for out in step.outputs:
            tokens[out.batch_rows] = out.real("token_ids", to_host).numpy()
        device_logprobs = _device_logprobs(step, to_host)
        discarded = set(step.partial_prefill_rows)
        overflowed = [
            row
            for row in range(rows)
            if tokens[row] == sampling.NO_TOKEN and row not in discarded and not step.host_rows[row]
        ]
        if overflowed:
            _complete_overflowed(step, overflowed, tokens, device_logprobs, to_host)
        on_host = step.host_bound or bool(overflowed)
        if not step.host_bound:
            if step.grammar_output is not None:
                raise RuntimeError("a grammar bitmask for a step the graph sampled: its rows take the host")
            logprobs = None if device_logprobs is None else LogprobsTensors(*device_logprobs)
            return StepTokens(tokens, logprobs, on_host)
        if batch.req_ids != step.req_ids:
            raise RuntimeError("a step for vLLM's host sampler outlived its batch")
        sampled, logprobs = self._sample_on_host(step, batch, to_host)
        device_rows = [row for row, host in enumerate(step.host_rows) if not host]
        sampled[device_rows] = tokens[device_rows]
        if logprobs is not None and device_logprobs is not None and step.num_logprobs >= 0:
            # The top logprobs are the same raw ones; the sampled token's come from the graph.
            ids, values, ranks = device_logprobs
            for host_values, graph_values in zip(logprobs[:2], (ids, values), strict=True):
                host_values[device_rows, 0] = graph_values[device_rows, 0].to(host_values.dtype)
            host_ranks = logprobs.selected_token_ranks
            host_ranks[device_rows] = ranks[device_rows].to(host_ranks.dtype)
        return StepTokens(sampled, logprobs, on_host)

    def _sample_on_host(
        self, step: "RunningStep", batch: "InputBatch", to_host: ToHost
    ) -> tuple[np.ndarray, LogprobsTensors | None]:
        """vLLM's Sampler over the step's logits, copied to the host; returns every row's token and logprobs
        (the rows the graph sampled keep its tokens: the caller puts them back)."""
        logits = torch.empty(batch.num_reqs, self.vocab_size, dtype=torch.float32)
        for out in step.outputs:
            logits[out.batch_rows] = out.real("logits", to_host).float()
        if step.grammar_output is not None:
            apply_grammar_bitmask(step.scheduler_output, step.grammar_output, batch, logits)
        # Generators of the rows whose tokens are not the host's must not advance here: a discarded sample
        # (a prompt chunked differently), or a token the graph sampled (drawn from the generator already).
        kept = set(step.partial_prefill_rows) | {row for row, host in enumerate(step.host_rows) if not host}
        saved_rng = {row: batch.generators[row].get_state() for row in kept if row in batch.generators}
        sampler_output = self.sampler(logits=logits, sampling_metadata=batch.sampling_metadata)
        for row, state in saved_rng.items():
            batch.generators[row].set_state(state)
        sampled = sampler_output.sampled_token_ids[:, 0].numpy().astype(np.int64)
        return sampled, sampler_output.logprobs_tensors


def _device_logprobs(step: "RunningStep", to_host: ToHost) -> DeviceLogprobs | None:
    """The graph's logprobs of each row (token ids, logprobs, ranks), as many as the batch asks for (the
    sampled token's and up to LOGPROBS_CAP top ones); None if no request asked."""
    if step.num_logprobs is None:
        return None
    columns = 1 + min(max(step.num_logprobs, 0), sampling.LOGPROBS_CAP)
    rows = len(step.req_ids)
    ids = torch.zeros(rows, columns, dtype=torch.int64)
    values = torch.zeros(rows, columns, dtype=torch.float32)
    ranks = torch.zeros(rows, dtype=torch.int64)
    for out in step.outputs:
        # Every column is copied, then cut on the host (a column slice of a device tensor is strided).
        ids[out.batch_rows] = out.real("logprob_token_ids", to_host)[:, :columns].long()
        values[out.batch_rows] = out.real("logprobs", to_host)[:, :columns]
        ranks[out.batch_rows] = out.real("ranks", to_host).long()
    return ids, values, ranks


def _complete_overflowed(
    step: "RunningStep",
    rows: list[int],
    tokens: np.ndarray,
    device_logprobs: DeviceLogprobs | None,
    to_host: ToHost,
) -> None:
    """Rows whose top-p cut lay beyond the graph's candidates (NO_TOKEN): the same sampler on the host, over
    the whole vocabulary, with each row's parameters and uniform draw (so a seeded request's generator
    advances once either way). Writes their tokens and logprobs in place."""
    final = final_rows(step.outputs)
    logits, sampling_rows = [], []
    for row in rows:
        call_index, j = final[row]
        logits.append(step.outputs[call_index].part("logits", slice(j, j + 1), to_host).float())
        sampling_rows.append(torch.from_numpy(step.planned[call_index].sampling_rows[j : j + 1]))
    logits = torch.cat(logits)
    done = sampling.sample(logits, torch.cat(sampling_rows), candidates=logits.shape[-1])
    tokens[rows] = done.token_ids.numpy()
    if device_logprobs is not None:
        ids, values, ranks = device_logprobs
        columns = ids.shape[1]
        ids[rows] = done.logprob_token_ids[:, :columns].long()
        values[rows] = done.logprobs[:, :columns]
        ranks[rows] = done.ranks.long()


def uniforms(source: torch.Generator | bool, count: int) -> np.ndarray:
    """`count` uniform draws in [0, 1) from a seeded request's generator, or (True) the global one: a
    sampling row's, a random verify row's drafts' (worker/spec_decode/speculation.py)."""
    generator = source if isinstance(source, torch.Generator) else None
    return torch.rand(count, generator=generator).numpy()
