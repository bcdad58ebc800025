"""A churn workload after warm-up compiles nothing: random lengths up to max_model_len, cancellations
mid-stream, n > 1, mixed sampling parameters, prefix-sharing prompts, bursts that fill and drain the batch.
(The test session runs with VLLM_NEURON_STRICT_SHAPES=1, so a recompile would also raise.)"""

import random

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from tests.conftest import EXPECTED_GRAPHS, MAX_MODEL_LEN, model_runner

pytestmark = pytest.mark.slow


def sampling_variant(rng: random.Random, max_tokens: int) -> SamplingParams:
    variants = [
        dict(temperature=0.0),
        dict(temperature=0.9, top_p=0.8, seed=rng.randrange(1000)),
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3),
        dict(temperature=0.0, logprobs=3),
        dict(temperature=1.0, n=rng.choice([2, 3]), seed=rng.randrange(1000)),
        dict(temperature=1.1, top_p=0.5, min_p=0.1, logprobs=2),
        dict(temperature=0.8, top_k=400, logit_bias={7: 2.0}),  # host: top-k above the cap, a bias
    ]
    return SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.7, **rng.choice(variants))


def run_churn(engine, seed: int = 2026, bursts: int = 8) -> tuple[int, int, int]:
    """The churn workload on an LLMEngine; returns (requests, finished, cancelled). Also run under tensor
    parallelism by tests/generate_in_subprocess.py."""
    rng = random.Random(seed)
    shared_prefixes = [[rng.randrange(10, 400) for _ in range(n)] for n in (40, 100, 170)]
    live: dict[str, int] = {}  # request id -> step at which to cancel it (or -1)
    next_id, step, finished, cancelled = 0, 0, 0, 0
    for burst in range(bursts):
        for _ in range(rng.randint(3, 9)):  # a burst larger than max_num_seqs: requests queue, then drain
            if rng.random() < 0.35:
                prompt = rng.choice(shared_prefixes) + [
                    rng.randrange(10, 400) for _ in range(rng.randint(1, 30))
                ]
            else:
                prompt = [rng.randrange(10, 400) for _ in range(rng.randint(1, MAX_MODEL_LEN - 1))]
            max_tokens = rng.randint(1, min(40, MAX_MODEL_LEN - len(prompt)))
            req_id = f"churn-{next_id}"
            next_id += 1
            engine.add_request(
                req_id, TokensPrompt(prompt_token_ids=prompt), sampling_variant(rng, max_tokens)
            )
            live[req_id] = step + rng.randint(1, 6) if rng.random() < 0.2 else -1
        drain_until = step + (400 if burst == bursts - 1 else rng.randint(2, 15))
        while live and step < drain_until:
            for req_id, cancel_at in list(live.items()):
                if cancel_at == step:
                    engine.abort_request([req_id])
                    live.pop(req_id)
                    cancelled += 1
            for output in engine.step():
                if output.finished and output.request_id in live:
                    live.pop(output.request_id)
                    finished += 1
            step += 1
    assert not live, f"{len(live)} requests never finished"
    return next_id, finished, cancelled


def test_churn_adds_no_graph_and_frees_every_block(llm):
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    requests, finished, cancelled = run_churn(engine)
    assert finished + cancelled == requests and cancelled > 0
    runner = model_runner(llm)
    assert runner.recorder.unexpected == []
    assert runner.recorder.num_graphs == EXPECTED_GRAPHS
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before


def test_off_bucket_call_is_refused_in_strict_mode(llm):
    """The guard itself, on the real model: a shape outside every bucket is refused and compiles nothing."""
    import numpy as np

    from vllm_neuron.calls import Call
    from worker.step import call_inputs

    runner = model_runner(llm)
    chunk = call_inputs.Chunk(np.zeros(1, np.int64), 0, np.zeros(8, np.int64))
    odd_batch = 3  # decode buckets are 1, 2, 4
    pages, page_tokens = runner.buckets.decode_pages(odd_batch, 128), runner.buckets.page_tokens
    inputs = call_inputs.decode_inputs(
        [chunk],
        batch_bucket=odd_batch,
        num_pages=pages,
        page_tokens=page_tokens,
        block_size=runner.block_size,
    ).send(runner.planner.staging)
    with pytest.raises(Exception, match="decode of 1 requests: batch 3 x context 128.*decode_batch_buckets"):
        call = Call.decode(rows=1, batch=odd_batch, decode_context=128)
        runner.compiled.run(call, inputs)
    assert runner.recorder.num_graphs == EXPECTED_GRAPHS
