"""A step's calls' outputs, from the device to tokens and logprobs on the host: the graph's samples, whose
reads start right after the calls; rows whose top-p cut lay beyond the graph's candidates sampled again on
the host; and on a step with a request the graph cannot sample, vLLM's Sampler over the step's logits (the
rows the graph sampled keep its tokens)."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors

from vllm_neuron import device as neuron_device
from vllm_neuron import sampling
from vllm_neuron.upstream.vllm_runner import Sampler, apply_grammar_bitmask

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from worker.async_steps import RunningStep


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
    logits, params = [], []
    for row in rows:
        call_index, j = final[row]
        logits.append(step.outputs[call_index].part("logits", slice(j, j + 1), to_host).float())
        params.append(torch.from_numpy(step.planned[call_index].params[j : j + 1]))
    logits = torch.cat(logits)
    done = sampling.sample(logits, torch.cat(params), candidates=logits.shape[-1])
    tokens[rows] = done.token_ids.numpy()
    if device_logprobs is not None:
        ids, values, ranks = device_logprobs
        columns = ids.shape[1]
        ids[rows] = done.logprob_token_ids[:, :columns].long()
        values[rows] = done.logprobs[:, :columns]
        ranks[rows] = done.ranks.long()
