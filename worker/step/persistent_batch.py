"""The persistent batch: vLLM's InputBatch kept in step with the scheduler's output, on the host.

Follows the protocol of vLLM's GPU runner (finished requests leave, unscheduled ones are parked, new and
resumed ones join, sampled tokens are appended here because the scheduler does not send them back), without
pipeline parallelism, which the platform refuses. With speculative decoding the batch holds the tokens the
runner accepted only (`num_tokens_no_spec`): a step's draft tokens come with the scheduler's output and are
verified by the runner (worker/step/model_runner.py, worker/spec_decode/speculation.py), and `append_sampled`
appends each request's accepted drafts and the token after them. With async scheduling the scheduler's token
counts include the tokens still being sampled; a step's tokens are appended when its output is made, which
with the calls on a thread of their own is after the next step updated the batch (its decode rows whose token
is not here yet take it from the previous step's outputs, worker/step/model_runner.py). Each request's
sampling row (worker/step/sampling_rows.py) is worked out once, when it joins; each step draws its uniforms
(`sampling_rows`).

A step's compiled calls are planned from the batch's rows here too (`CallPlanner`): `calls.plan_step` splits
the step's decode rows and prefill chunks into bucketed calls, and each call's padded inputs and sampling rows
are built and packed for one transfer. A decode row whose token the previous step is still sampling takes it
through the token slots (worker/step/step_state.py)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.sampling_params import SamplingType

from vllm_neuron import sampling
from vllm_neuron.buckets import BucketConfig, ceil_div
from vllm_neuron.calls import Call, plan_step
from vllm_neuron.config import NeuronConfig
from vllm_neuron.upstream import vllm_runner
from worker.compiles.readiness import Readiness
from worker.spec_decode import speculation
from worker.spec_decode.head_inputs import HiddenSlots, null_arrays
from worker.step import call_inputs, sampling_rows
from worker.step.call_inputs import CallInputs, Chunk, HostInputs, StagingBuffers
from worker.step.sampling_rows import RowSampling
from worker.step.step_state import Fills, PlannedCall, keep_slots, uniforms

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import CachedRequestState


class PersistentBatch:
    def __init__(self, vllm_config: "VllmConfig", block_size: int) -> None:
        model_config = vllm_config.model_config
        self.max_model_len = model_config.max_model_len
        self.block_size = block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.sampling: dict[str, RowSampling] = {}
        self.vocab_size = model_config.get_vocab_size()
        self.host_only = sampling_rows.host_only(model_config)  # every row takes vLLM's host sampler
        self.logprobs_mode = model_config.logprobs_mode
        # vLLM's InputBatch (its GPU runner's; the members used: vllm_runner.INPUT_BATCH_MEMBERS).
        self.input_batch = vllm_runner.host_input_batch(
            vllm_config,
            NeuronConfig.of(vllm_config).max_num_seqs,
            block_size,
            ceil_div(self.max_model_len, block_size),
        )

    @property
    def block_table(self):
        """[max_num_reqs, max_blocks_per_req] block ids, zero (the null block) where none is allocated."""
        return self.input_batch.block_table[0].block_table.np

    def update(self, scheduler_output: "SchedulerOutput") -> None:
        input_batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.sampling.pop(req_id, None)
            input_batch.remove_request(req_id)

        # Requests not scheduled this step (preempted, or waiting their turn) leave the batch but keep their
        # state; resumed ones leave too so they re-enter below with their new block ids.
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in input_batch.req_id_to_index.keys() - (scheduled - cached.resumed_req_ids):
            input_batch.remove_request(req_id)

        to_add: list[CachedRequestState] = []
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(params.seed)
            state = vllm_runner.new_request_state(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                prompt_embeds=new.prompt_embeds,
                prompt_is_token_ids=new.prompt_is_token_ids,
                mm_features=new.mm_features,
                sampling_params=params,
                pooling_params=new.pooling_params,
                generator=generator,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
                lora_request=new.lora_request,
            )
            self.requests[new.req_id] = state
            self.sampling[new.req_id] = sampling_rows.describe(params, self.vocab_size, self.logprobs_mode)
            to_add.append(state)

        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            num_output_tokens = cached.num_output_tokens[i]
            index = input_batch.req_id_to_index.get(req_id)
            if num_output_tokens < len(state.output_token_ids):
                # The scheduler dropped tokens (e.g. a failed KV load): align with it.
                del state.output_token_ids[num_output_tokens:]
                if index is not None:
                    prompt = input_batch.num_prompt_tokens[index]
                    input_batch.num_tokens_no_spec[index] = prompt + num_output_tokens
            if req_id in cached.resumed_req_ids:
                state.block_ids = new_block_ids
            elif new_block_ids is not None:
                for ids, added in zip(state.block_ids, new_block_ids, strict=True):
                    ids.extend(added)
            if index is None:
                to_add.append(state)
                continue
            input_batch.num_computed_tokens_cpu[index] = state.num_computed_tokens
            if new_block_ids is not None:
                input_batch.block_table.append_row(new_block_ids, index)

        for state in to_add:
            input_batch.add_request(state)
        input_batch.condense()
        input_batch.refresh_metadata()

    def append_sampled(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """Record each request's new tokens; the scheduler does not send them back. By request id: with the
        calls on a thread of their own, the next step updates the batch before this step's output is made
        (rows move, requests leave)."""
        input_batch = self.input_batch
        for req_id, tokens in zip(req_ids, sampled, strict=True):
            state = self.requests.get(req_id)
            if not tokens or state is None:  # nothing sampled, or finished since
                continue
            index = input_batch.req_id_to_index.get(req_id)
            if index is not None:
                start = input_batch.num_tokens_no_spec[index]
                end = start + len(tokens)
                input_batch.token_ids_cpu[index, start:end] = tokens
                input_batch.is_token_ids[index, start:end] = True
                input_batch.num_tokens_no_spec[index] = end
            state.output_token_ids.extend(tokens)  # a request out of the batch re-enters with them

    def sampling_rows(self, discarded_rows: list[int]) -> np.ndarray:
        """[rows, sampling.PARAMS] float32: each batch row's sampling row with its uniform draw, from its own
        generator (a seeded request) or the global one. A row the host samples, or whose sample is discarded
        (a partial prefill), draws nothing: a seeded request's generator advances once per token the graph
        samples for it."""
        input_batch = self.input_batch
        requests = [self.sampling[req_id] for req_id in input_batch.req_ids]
        rows = np.zeros((len(requests), sampling.PARAMS), dtype=np.float32)
        if not requests:
            return rows
        rows[:, : sampling.UNIFORM] = [request.values for request in requests]
        rows[:, sampling.UNIFORM] = 0.5
        skip = set(discarded_rows)
        drawing = [
            index
            for index, request in enumerate(requests)
            if not (self.host_only or request.host_reason or index in skip)
        ]
        unseeded = [index for index in drawing if index not in input_batch.generators]
        if unseeded:
            rows[unseeded, sampling.UNIFORM] = uniforms(True, len(unseeded))
        for index in drawing:
            if index in input_batch.generators:
                rows[index, sampling.UNIFORM] = uniforms(input_batch.generators[index], 1)[0]
        return rows


Rows = list[tuple[int, Chunk]]  # (batch row, its chunk of tokens)


@dataclass
class StepRows:
    """What a step runs, by batch row: the planner's one argument."""

    decode: Rows  # one token each, or a verify row's last token and its drafts
    prefill: Rows
    sampling_rows: np.ndarray  # [batch rows, sampling.PARAMS]: each row's sampling row
    fills: Fills  # decode rows whose token the previous step is still sampling
    drafts: dict[int, list[int]]  # decode rows to verify -> their draft tokens
    # A verify row's source of uniform draws when its drafts are accepted by their probability (None: by
    # equality).
    random_draws: Callable[[int], torch.Generator | bool | None]
    slot_base: int  # where the step's tokens go in the token slots
    req_ids: list[str] = field(default_factory=list)  # the batch's requests, by row


class CallPlanner:
    def __init__(
        self,
        buckets: BucketConfig,
        block_size: int,
        device: torch.device,
        readiness: Readiness,
        lora: bool = False,
    ) -> None:
        self.buckets = buckets
        self.block_size = block_size
        self.device = device
        self.readiness = readiness  # the graphs a step may use
        self.lora = lora  # send each call's LoRA slots (--enable-lora)
        self.staging = StagingBuffers(device)  # where each call's inputs land (worker/step/call_inputs.py)
        # An EAGLE3 head's hidden slots: each call then carries the head's arrays too.
        self.head: HiddenSlots | None = None

    def plan(self, step: StepRows) -> list[PlannedCall]:
        """The step's calls, each sampling the rows of its requests (a sub-chunk's row is sampled again by
        the next: the last part of a chunk gives its token; a verify call samples every query of its rows;
        decode rows with drafts run in verify calls). A call is packed once planned, or with fills from the
        host, on the device thread once they are in; the thread that runs it sends it."""
        decode, prefill, drafts = step.decode, step.prefill, step.drafts
        contexts = [chunk.start + len(chunk.token_ids) for _, chunk in decode]
        chunks = [(chunk.start, len(chunk.token_ids)) for _, chunk in prefill]
        ready = self.readiness.usable  # None: every graph (replaced, never mutated: read once, unlocked)
        plans = plan_step(contexts, chunks, self.buckets, self.block_size, ready, verify=bool(drafts))
        if ready is not None and self.readiness.serving:  # the demand goes to the background compiles
            ideal = plan_step(contexts, chunks, self.buckets, self.block_size, None, verify=bool(drafts))
            self.readiness.report_demand(plans, ideal)
        planned = []
        for plan in plans:
            parts = []
            for index, start, length in plan.parts:
                chunk = prefill[index][1]
                offset = start - chunk.start
                tokens = chunk.token_ids[offset : offset + length]
                parts.append(Chunk(tokens, start, chunk.block_row, chunk.lora_slot))
            rows = [decode[index][1] for index in plan.decode_rows]
            host = self.host_inputs(plan.call, parts, rows)
            # Logits rows come in call order: the prefill parts' first, then the decode rows'; padding rows
            # are greedy.
            decode_rows = [decode[index][0] for index in plan.decode_rows]
            batch_rows = [prefill[index][0] for index, _, _ in plan.parts] + decode_rows
            sampling_rows = np.zeros((host.rows, sampling.PARAMS), dtype=np.float32)
            # A verify row's queries each sample with the row's parameters; a random row's also leave out
            # their draft and get draws of their own (speculation.set_drafts).
            queries = plan.call.queries
            sampling_rows[: host.num_real_rows * queries] = np.repeat(
                step.sampling_rows[batch_rows], queries, axis=0
            )
            for index, row in enumerate(batch_rows if queries > 1 else ()):
                source = step.random_draws(row) if row in drafts else None
                if source is not None:
                    speculation.set_drafts(
                        sampling_rows[index * queries : (index + 1) * queries], drafts[row], source
                    )
            feed, host_fills = step.fills.feed(decode_rows, host.decode_token_index, len(host.input_ids))
            keep = keep_slots(step.slot_base, batch_rows, host.rows, queries)
            item = PlannedCall(plan.call, host, sampling_rows, feed, keep, batch_rows, host_fills, self.lora)
            if self.head is not None:
                req_ids = [step.req_ids[row] for row in batch_rows]
                item.extra = self.head.call_arrays(host, parts + rows, req_ids, queries, step.req_ids)
            if not host_fills:
                item.pack()
            planned.append(item)
        return planned

    def inputs(self, call: Call, parts: list[Chunk], rows: list[Chunk]) -> CallInputs:
        """A call's inputs on the device, greedy, its tokens all its own (warm-up's synthetic calls, the
        draft model's calls)."""
        host = self.host_inputs(call, parts, rows)
        if self.head is None:
            return host.send(self.staging, lora=self.lora)
        extra = null_arrays(host, self.block_size)
        return host.send(self.staging, host.pack(lora=self.lora, extra=extra))

    def host_inputs(self, call: Call, parts: list[Chunk], rows: list[Chunk]) -> HostInputs:
        """A call's inputs, padded to its buckets, on the host."""
        if call.phase == "prefill":
            return call_inputs.prefill_inputs(
                parts,
                token_bucket=call.token_bucket,
                context_bucket=call.chunk_context,
                block_size=self.block_size,
            )
        pages = self.buckets.decode_pages(call.batch, call.decode_context)
        if call.phase == "verify":
            return call_inputs.verify_inputs(
                rows,
                batch_bucket=call.batch,
                queries=call.queries,
                num_pages=pages,
                page_tokens=self.buckets.page_tokens,
                block_size=self.block_size,
            )
        if call.phase == "decode":
            return call_inputs.decode_inputs(
                rows,
                batch_bucket=call.batch,
                num_pages=pages,
                page_tokens=self.buckets.page_tokens,
                block_size=self.block_size,
            )
        (chunk,) = parts
        return call_inputs.mixed_inputs(
            chunk,
            rows,
            token_bucket=call.token_bucket,
            context_bucket=call.chunk_context,
            batch_bucket=call.batch,
            num_pages=pages,
            page_tokens=self.buckets.page_tokens,
            block_size=self.block_size,
        )
