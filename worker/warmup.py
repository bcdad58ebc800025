"""Warm-up through the real path: synthetic scheduler steps that make execute_model compile every bucket.

Each step is what vLLM's scheduler could send: new requests with their block ids and already-computed
tokens (as after a prefix-cache hit), so the persistent batch, input padding, compiled model and sampler
all run exactly as when serving. Synthetic requests point every block at the null block, so they never
touch a real request's KV cache.
"""

from collections.abc import Iterator
from dataclasses import dataclass

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from kv_cache.layout import NULL_BLOCK
from vllm_neuron.buckets import BucketConfig, ceil_div, pick_bucket

# Sampler variants: greedy, and one request with every host-side sampling feature, so their first use
# while serving is not their first use at all.
SAMPLING_VARIANTS = (
    SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logprobs=2,
        seed=0,
        max_tokens=1,
        ignore_eos=True,
    ),
)


@dataclass(frozen=True)
class WarmupStep:
    phase: str  # "prefill", "decode" or "mixed"
    shape: tuple[int, int]  # (tokens or batch, context)
    step: SchedulerOutput
    request_ids: list[str]


def _request(req_id: str, prompt_len: int, computed: int, block_size: int, variant: int) -> NewRequestData:
    num_blocks = ceil_div(prompt_len, block_size)
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=[0] * prompt_len,
        mm_features=[],
        sampling_params=SAMPLING_VARIANTS[variant % len(SAMPLING_VARIANTS)].clone(),
        pooling_params=None,
        block_ids=([NULL_BLOCK] * num_blocks,),
        num_computed_tokens=computed,
        lora_request=None,
    )


def _step(requests: list[NewRequestData], scheduled: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=requests,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def warmup_steps(buckets: BucketConfig, *, max_model_len: int, block_size: int) -> Iterator[WarmupStep]:
    """One step per graph shape: each prefill (tokens, context), each decode (batch, context) and each mixed
    (batch, context)."""
    for index, (tokens, context) in enumerate(buckets.prefill_shapes()):
        # A chunk of n tokens ending at the context bucket (or at max_model_len, inside the same bucket).
        total = min(context, max_model_len)
        count = min(tokens, total)
        assert pick_bucket(buckets.prefill_tokens, count) == tokens
        assert pick_bucket(buckets.context_tokens, total) == context
        req_id = f"warmup-prefill-{index}"
        request = _request(req_id, total, total - count, block_size, index)
        yield WarmupStep("prefill", (tokens, context), _step([request], {req_id: count}), [req_id])
    for index, (batch, context) in enumerate(buckets.decode_shapes()):
        # `batch` requests each with one token left to compute, at the end of the context bucket.
        total = min(context, max_model_len)
        assert buckets.pick_decode_context(batch, [total] * batch) == context
        ids = [f"warmup-decode-{index}-{row}" for row in range(batch)]
        requests = [_request(req_id, total, total - 1, block_size, row) for row, req_id in enumerate(ids)]
        yield WarmupStep("decode", (batch, context), _step(requests, dict.fromkeys(ids, 1)), ids)
    for index, (batch, context) in enumerate(buckets.mixed_shapes()):
        # The decode rows above, and a chunk of mixed_tokens tokens (or the whole context if shorter).
        total = min(context, max_model_len)
        ids = [f"warmup-mixed-{index}-{row}" for row in range(batch)]
        requests = [_request(req_id, total, total - 1, block_size, row) for row, req_id in enumerate(ids)]
        count = min(buckets.mixed_tokens, max_model_len)
        assert buckets.has_mixed(batch, count)
        chunk_id = f"warmup-mixed-{index}-chunk"
        requests.append(_request(chunk_id, max_model_len, max_model_len - count, block_size, index))
        scheduled = {**dict.fromkeys(ids, 1), chunk_id: count}
        yield WarmupStep("mixed", (batch, context), _step(requests, scheduled), [*ids, chunk_id])


def finish_step(request_ids: list[str]) -> SchedulerOutput:
    """The step that retires synthetic requests, leaving the persistent batch empty."""
    step = SchedulerOutput.make_empty()
    step.finished_req_ids = set(request_ids)
    return step
