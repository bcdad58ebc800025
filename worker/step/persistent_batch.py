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
sampling row (worker/step/sampling_rows.py) is worked out once, when it joins."""

from typing import TYPE_CHECKING

import torch
from vllm.sampling_params import SamplingType

from vllm_neuron.buckets import ceil_div
from vllm_neuron.config import NeuronConfig
from vllm_neuron.upstream import vllm_runner
from worker.step import sampling_rows
from worker.step.sampling_rows import RowSampling

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
