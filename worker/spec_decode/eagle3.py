"""Speculative decoding with an EAGLE3 head (vLLM's `eagle3` method): vLLM's own head (Eagle3LlamaForCausalLM,
one decoder layer over the token's embedding and the target's hidden state) proposes each row's next tokens
from the target's hidden states, in two compiled calls a step:
- the target's call (worker/step/forward.py) returns the hidden states entering the head's aux layers, runs
  the head's first pass over them (its cache entries before the call's last tokens,
  worker/spec_decode/head_inputs.py), and keeps each logits row's combined hidden state on the device;
- after the step's tokens are accepted, one propose call per decode shape runs the head's K passes, unrolled:
  the first from each row's newest token and the target's hidden state before it, each next from the draft
  before and the head's own state (vLLM's chain, llm_base_proposer.py), each writing the head's cache entry
  of its position. The drafts are the head's greedy tokens, accepted as a draft model's are
  (worker/spec_decode/speculation.py: exactly vLLM's rejection sampling of greedy drafts).
The head's attention layers sit in the target's KV blocks, as vLLM places them; a verify call's first pass
writes over the entries the propose call wrote for drafts, from the target's hidden states.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from vllm.forward_context import ForwardContext
from vllm.model_executor.layers.attention import Attention
from vllm.v1.outputs import DraftTokenIds

from vllm_neuron import device as neuron_device
from vllm_neuron.attention_backend import NeuronAttentionMetadata, PageQueries, TableQueries, drop_masks
from vllm_neuron.calls import Call, plan_step
from vllm_neuron.sampling import greedy_tokens
from vllm_neuron.upstream.vllm_runner import override_forward_context
from worker.step.call_inputs import HEAD, CallInputs, Chunk, pack
from worker.step.persistent_batch import CallPlanner, PersistentBatch
from worker.step.step_state import RunningStep


def layer_names(head: torch.nn.Module) -> list[str]:
    """The head's attention layers (vLLM names them after the target's: `model.layers.{n}`)."""
    return [module.layer_name for module in head.modules() if isinstance(module, Attention)]


def head_metadata(inputs: CallInputs) -> NeuronAttentionMetadata:
    """The head's first pass's attention inputs: the call's, with each query one position back and each
    entry written at the slot of its own position (head_inputs.py)."""
    metadata, extra = inputs.metadata, inputs.extra
    table = paged = None
    if metadata.table is not None:
        table = TableQueries(
            extra[HEAD + "table.positions"], metadata.table.first_keys, metadata.table.block_table
        )
    if metadata.paged is not None:
        paged = PageQueries(
            extra[HEAD + "paged.positions"],
            metadata.paged.page_blocks,
            metadata.paged.page_rows,
            metadata.paged.page_starts,
        )
    return NeuronAttentionMetadata(extra[HEAD + "slot_mapping"], table, paged, metadata.fresh_prefill)


def first_pass(
    head: torch.nn.Module,
    input_ids: torch.Tensor,
    aux: list[torch.Tensor],
    logits_indices: torch.Tensor,
    hidden_slots: torch.Tensor,
    extra: dict[str, torch.Tensor],
) -> None:
    """In the target's traced call: the head's cache entries of the call's tokens, each from the token and
    the combined hidden state before it (the call's own, or the request's kept one), then each logits row's
    combined hidden state kept in the hidden slots. The caller has set the head's layers' metadata."""
    combined = head.combine_hidden_states(torch.cat(aux, dim=-1))
    before = torch.cat([hidden_slots, combined]).index_select(0, extra[HEAD + "hidden"])
    head(input_ids=input_ids, positions=extra[HEAD + "positions"], hidden_states=before)
    hidden_slots.index_copy_(0, extra[HEAD + "keep"], combined.index_select(0, logits_indices))


class ProposeForward(torch.nn.Module):
    """What gets compiled for the drafts: the head's passes over one decode shape's rows, unrolled, each
    pass's greedy token the next pass's input and its pre-norm state the next pass's hidden state."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden_index: torch.Tensor,
        hidden_slots: torch.Tensor,
        positions: list[torch.Tensor],
        contexts: list[ForwardContext],
    ) -> torch.Tensor:
        tokens, hidden = token_ids, hidden_slots.index_select(0, hidden_index)
        drafts = []
        for pass_positions, context in zip(positions, contexts, strict=True):
            with override_forward_context(context):
                last, hidden = self.head(input_ids=tokens, positions=pass_positions, hidden_states=hidden)
                logits = self.head.compute_logits(last)
            drop_masks(context.attn_metadata)
            tokens = greedy_tokens(logits).to(token_ids.dtype)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)


@dataclass
class ProposeInputs:
    """One propose call's inputs on the device: each row's newest token and the row of its hidden state
    before it, and each pass's positions and attention metadata (decode inputs, pass j one position on)."""

    token_ids: torch.Tensor
    hidden_index: torch.Tensor
    passes: list[CallInputs]


def propose_inputs(
    planner: CallPlanner, call: Call, rows: list[Chunk], hidden_index: list[int], passes: int, last: int
) -> ProposeInputs:
    """`rows`: each row's newest token at its position; the passes run at that position - 1 onwards (the first
    pass writes the head's entry before the newest token), none past position `last` (max_model_len - 1:
    a row near the end repeats it, and the scheduler drops the drafts past the end). Sent in one transfer."""
    hosts = [
        planner.host_inputs(
            call, [], [Chunk(r.token_ids, min(r.start - 1 + j, last), r.block_row) for r in rows]
        )
        for j in range(passes)
    ]
    token_ids = np.zeros(call.batch, dtype=np.int64)
    token_ids[: len(rows)] = [int(row.token_ids[0]) for row in rows]
    index = np.zeros(call.batch, dtype=np.int64)
    index[: len(hidden_index)] = hidden_index
    arrays = {"token_ids": token_ids, "hidden_index": index}
    for j, host in enumerate(hosts):
        arrays |= {f"{j}/{name}": array for name, array in host.arrays().items()}
    sent = planner.staging.send(pack(arrays))
    passes_in = []
    for j, host in enumerate(hosts):
        prefix = f"{j}/"
        part = {name.removeprefix(prefix): sent[name] for name in sent if name.startswith(prefix)}
        passes_in.append(host.inputs_from(part))
    return ProposeInputs(sent["token_ids"], sent["hidden_index"], passes_in)


def propose(
    step: RunningStep,
    sampled_ids: list[list[int]],
    batch: PersistentBatch,
    speculating: list[bool],
    planner: CallPlanner,
    hidden_index: Callable[[str, int], int | None],
    run_propose: Callable[[Call, ProposeInputs], torch.Tensor],
    passes: int,
) -> DraftTokenIds:
    """The head's drafts for the step's rows that sampled a token and may speculate: one propose call per
    decode shape the rows need (their newest position + the passes), each row's drafts as many as the
    scheduler wants (it drops those past max_model_len, as after vLLM's proposer)."""
    input_batch = batch.input_batch
    assert input_batch.req_ids == step.req_ids, "the batch changed between a step and its drafts"
    wanted = step.scheduler_output.num_spec_tokens_to_schedule
    max_model_len = batch.max_model_len
    drafts: list[list[int]] = [[] for _ in step.req_ids]
    rows, kept = [], []
    for row, req_id in enumerate(step.req_ids):
        newest = int(input_batch.num_tokens_no_spec[row]) - 1
        index = hidden_index(req_id, newest - 1)
        if sampled_ids[row] and speculating[row] and newest + 1 < max_model_len and index is not None:
            token = input_batch.token_ids_cpu[row, newest : newest + 1].copy()
            rows.append((row, Chunk(token, newest, batch.block_table[row])))
            kept.append(index)
    if not rows or not wanted:
        return DraftTokenIds(list(step.req_ids), drafts)
    contexts = [min(chunk.start + passes - 1, max_model_len) for _, chunk in rows]
    for plan in plan_step(contexts, [], planner.buckets, planner.block_size, planner.readiness.usable):
        chunks = [rows[j][1] for j in plan.decode_rows]
        index = [kept[j] for j in plan.decode_rows]
        inputs = propose_inputs(planner, plan.call, chunks, index, passes, max_model_len - 1)
        tokens = neuron_device.to_host(run_propose(plan.call, inputs)[: len(chunks)])
        for j, row_tokens in zip(plan.decode_rows, tokens.tolist(), strict=True):
            drafts[rows[j][0]] = row_tokens[:wanted]
    return DraftTokenIds(list(step.req_ids), drafts)
