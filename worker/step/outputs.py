"""A step's calls' outputs, from the device to tokens and logprobs on the host: the graph's samples, whose
reads start right after the calls; rows whose top-p cut lay beyond the graph's candidates sampled again on
the host; and on a step with a request the graph cannot sample, vLLM's Sampler over the step's logits (the
rows the graph sampled keep its tokens)."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors

from vllm_neuron import sampling
from vllm_neuron.upstream.vllm_runner import Sampler, apply_grammar_bitmask
from worker.step.step_state import ToHost, final_rows

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from worker.step.step_state import RunningStep


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
