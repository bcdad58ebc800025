"""Speculative decoding with a draft model (vLLM's `draft_model` method): a small model with the target's
tokenizer proposes each row's next tokens greedily; the target verifies them in its verify calls
(worker/spec_decode/speculation.py says how they are accepted).

The draft's attention layers sit in vLLM's KV cache groups beside the target's (vLLM registers them in the
same forward context), so they share each request's block table. Its graphs have the target's shapes:
- every call of the target runs the draft on the same inputs too (prefill, mixed, decode and verify), so
  the draft's cache holds every position the target's holds, rolled back the same way: a rejected draft's
  entry is written again before it is read;
- after the step, k decode calls of the draft alone, from each row's newest token, give its k drafts.
So each bucket shape compiles one graph for the target and one for the draft, both at warm-up.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.forward_context import ForwardContext
from vllm.v1.outputs import DraftTokenIds

from vllm_neuron import device as neuron_device
from vllm_neuron.attention_backend import drop_masks
from vllm_neuron.calls import Call, plan_step
from vllm_neuron.sampling import greedy_tokens
from vllm_neuron.upstream import vllm_runner
from vllm_neuron.upstream.vllm_runner import override_forward_context
from worker.step.call_inputs import CallInputs, Chunk
from worker.step.persistent_batch import CallPlanner, PersistentBatch
from worker.step.step_state import RunningStep

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def load_draft_model(vllm_config: "VllmConfig") -> torch.nn.Module:
    """The draft model, loaded the way vLLM's own DraftModelProposer loads it (its draft config, layer
    prefix "draft_model"), without the proposer's GPU buffers and kernels, which the plugin does not use."""
    return vllm_runner.load_draft_model(vllm_config)


class DraftForward(torch.nn.Module):
    """What gets compiled for the draft: its forward on a call's inputs (writing its KV cache) and the
    greedy token of each logits row."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        forward_context: ForwardContext,
    ) -> torch.Tensor:
        with override_forward_context(forward_context):
            hidden = self.model(input_ids=input_ids, positions=positions)
            logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        drop_masks(forward_context.attn_metadata)
        return greedy_tokens(logits)


def propose(
    step: RunningStep,
    sampled_ids: list[list[int]],
    batch: PersistentBatch,
    speculating: list[bool],
    planner: CallPlanner,
    run_draft: Callable[[Call, CallInputs], torch.Tensor],
) -> DraftTokenIds:
    """The draft model's greedy drafts for the step's rows that sampled a token and may speculate: decode
    calls of the draft alone (`run_draft`), the first from each row's newest token, each next from the draft
    before, up to the scheduler's number of drafts and the model's length. The scheduler reserved KV slots
    for them (vLLM's lookahead tokens); the draft's cache already holds every earlier position."""
    input_batch = batch.input_batch
    assert input_batch.req_ids == step.req_ids, "the batch changed between a step and its drafts"
    wanted = step.scheduler_output.num_spec_tokens_to_schedule
    max_model_len = batch.max_model_len
    drafts: list[list[int]] = [[] for _ in step.req_ids]
    newest: dict[int, int] = {}  # batch row -> its newest token's position
    for row in range(len(step.req_ids)):
        position = int(input_batch.num_tokens_no_spec[row]) - 1
        if sampled_ids[row] and speculating[row] and position < max_model_len - 1:
            newest[row] = position
    ready = planner.readiness.usable
    for index in range(wanted):
        rows = [row for row, position in newest.items() if position + index < max_model_len - 1]
        chunks = [
            Chunk(
                np.array([drafts[row][-1] if index else input_batch.token_ids_cpu[row, newest[row]]]),
                newest[row] + index,
                batch.block_table[row],
            )
            for row in rows
        ]
        contexts = [chunk.start + 1 for chunk in chunks]
        for plan in plan_step(contexts, [], planner.buckets, planner.block_size, ready):
            inputs = planner.inputs(plan.call, [], [chunks[j] for j in plan.decode_rows])
            tokens = neuron_device.to_host(run_draft(plan.call, inputs)[: len(plan.decode_rows)])
            for j, token in zip(plan.decode_rows, tokens.tolist(), strict=True):
                drafts[rows[j]].append(token)
    return DraftTokenIds(list(step.req_ids), drafts)
