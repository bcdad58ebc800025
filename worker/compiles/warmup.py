"""Warm-up through the real path: synthetic scheduler steps that make execute_model compile every bucket.

Each step is what vLLM's scheduler could send: new requests with their block ids and already-computed
tokens (as after a prefix-cache hit), so the persistent batch, input padding, compiled model and sampler
all run exactly as when serving. Synthetic requests point every block at the null block, so they never
touch a real request's KV cache.
"""

from collections.abc import Collection, Iterator
from dataclasses import dataclass

import numpy as np
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from kv_cache.layout import NULL_BLOCK
from vllm_neuron.buckets import BucketConfig, GraphKey, ceil_div, pick_bucket
from vllm_neuron.calls import Call
from worker.step.call_inputs import Chunk

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
    phase: str  # "prefill", "decode", "mixed" or "verify"
    shape: tuple[int, int]  # (tokens or batch, context)
    step: SchedulerOutput
    request_ids: list[str]


def _request(
    req_id: str, prompt_len: int, computed: int, block_size: int, variant: int, end: int | None = None
) -> NewRequestData:
    """A synthetic request; `end`: the position its blocks must reach past the prompt (a verify row's
    drafts)."""
    num_blocks = ceil_div(max(prompt_len, end or 0), block_size)
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


def _step(
    requests: list[NewRequestData],
    scheduled: dict[str, int],
    drafts: dict[str, list[int]] | None = None,
) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=requests,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens=drafts or {},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def warmup_steps(
    buckets: BucketConfig, *, max_model_len: int, block_size: int, graphs: Collection[GraphKey] | None = None
) -> Iterator[WarmupStep]:
    """One step per graph shape: each prefill (tokens, context), each fresh prefill (tokens, 0), each decode
    (batch, context) and each mixed (batch, context); only those of `graphs` if given."""
    wanted = set(buckets.graphs() if graphs is None else graphs)
    for index, (tokens, context) in enumerate(buckets.prefill_shapes()):
        if ("prefill", tokens, context) not in wanted:
            continue
        # A chunk of n tokens ending at the context bucket (or at max_model_len, inside the same bucket); one
        # token short where it would start its request with a fresh graph of its bucket, which would take it.
        total = min(context, max_model_len)
        count = min(tokens, total) - (total <= tokens and tokens in buckets.fresh_buckets)
        assert pick_bucket(buckets.prefill_buckets, count) == tokens
        assert pick_bucket(buckets.context_buckets, total) == context
        req_id = f"warmup-prefill-{index}"
        request = _request(req_id, total, total - count, block_size, index)
        yield WarmupStep("prefill", (tokens, context), _step([request], {req_id: count}), [req_id])
    for index, (tokens, context) in enumerate(buckets.fresh_shapes()):
        if ("prefill", tokens, context) not in wanted:
            continue
        # A request's first chunk, alone: its whole prompt.
        count = min(tokens, max_model_len)
        assert pick_bucket(buckets.prefill_buckets, count) == tokens
        req_id = f"warmup-fresh-{index}"
        request = _request(req_id, count, 0, block_size, index)
        yield WarmupStep("prefill", (tokens, context), _step([request], {req_id: count}), [req_id])
    for index, (batch, context) in enumerate(buckets.decode_shapes()):
        if ("decode", batch, context) not in wanted:
            continue
        # `batch` requests each with one token left to compute, at the end of the context bucket.
        total = min(context, max_model_len)
        assert buckets.pick_decode_context(batch, [total] * batch) == context
        ids = [f"warmup-decode-{index}-{row}" for row in range(batch)]
        requests = [_request(req_id, total, total - 1, block_size, row) for row, req_id in enumerate(ids)]
        yield WarmupStep("decode", (batch, context), _step(requests, dict.fromkeys(ids, 1)), ids)
    for index, (batch, context) in enumerate(buckets.mixed_shapes()):
        if ("mixed", batch, context) not in wanted:
            continue
        # The decode rows above, and a chunk of mixed_chunk_bucket tokens (or the whole context if shorter).
        total = min(context, max_model_len)
        ids = [f"warmup-mixed-{index}-{row}" for row in range(batch)]
        requests = [_request(req_id, total, total - 1, block_size, row) for row, req_id in enumerate(ids)]
        count = min(buckets.mixed_chunk_bucket, max_model_len)
        assert buckets.has_mixed(batch, count)
        chunk_id = f"warmup-mixed-{index}-chunk"
        requests.append(_request(chunk_id, max_model_len, max_model_len - count, block_size, index))
        scheduled = {**dict.fromkeys(ids, 1), chunk_id: count}
        yield WarmupStep("mixed", (batch, context), _step(requests, scheduled), [*ids, chunk_id])
    for index, (batch, context) in enumerate(buckets.verify_shapes()):
        if ("verify", batch, context) not in wanted:
            continue
        # `batch` decode rows, each its last token and verify_tokens - 1 drafts, the last at the context end.
        total = min(context, max_model_len)
        queries = buckets.verify_tokens
        ids = [f"warmup-verify-{index}-{row}" for row in range(batch)]
        requests = [
            _request(req_id, total - queries + 1, total - queries, block_size, row, end=total)
            for row, req_id in enumerate(ids)
        ]
        drafts = {req_id: [0] * (queries - 1) for req_id in ids}
        yield WarmupStep(
            "verify", (batch, context), _step(requests, dict.fromkeys(ids, queries), drafts), ids
        )


def finish_step(request_ids: list[str]) -> SchedulerOutput:
    """The step that retires synthetic requests, leaving the persistent batch empty."""
    step = SchedulerOutput.make_empty()
    step.finished_req_ids = set(request_ids)
    return step


def synthetic_call(
    graph: GraphKey, buckets: BucketConfig, *, max_model_len: int, blocks_per_request: int
) -> tuple[Call, list[Chunk], list[Chunk]]:
    """A call of a graph's shape on synthetic requests, as `warmup_steps` shapes them, to run the compiled
    model directly (staged readiness's background compiles, beside serving: no scheduler step, no persistent
    batch). Returns the call, its prefill chunks and its decode rows; every block is the null block."""
    phase, size, context = graph
    null_row = np.full(blocks_per_request, NULL_BLOCK, dtype=np.int32)

    def chunk(total: int, count: int) -> Chunk:
        return Chunk(np.zeros(count, dtype=np.int32), total - count, null_row)

    if phase == "prefill":
        total = min(context or size, max_model_len)  # a fresh graph (context 0): the whole prompt
        count = min(size, total)
        return Call.prefill(count, size, context), [chunk(total, count)], []
    if phase == "verify":
        queries = buckets.verify_tokens
        rows = [chunk(min(context, max_model_len), queries) for _ in range(size)]
        return Call.verify(size, size, context, queries), [], rows
    rows = [chunk(min(context, max_model_len), 1) for _ in range(size)]
    call = Call.decode(size, size, context)
    if phase == "decode":
        return call, [], rows
    count = min(buckets.mixed_chunk_bucket, max_model_len)
    mixed = call.with_chunk(
        count, max_model_len - count, buckets.mixed_chunk_bucket, buckets.context_buckets[-1]
    )
    return mixed, [chunk(max_model_len, count)], rows
