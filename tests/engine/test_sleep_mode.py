"""vLLM's sleep mode on the shared engine: level 1 frees the KV cache and keeps the weights in host memory,
level 2 discards both; wake_up brings them back (level 2's weights after reload_weights) and serving resumes
with the same tokens and no recompile. Every test leaves the engine awake."""

import gc
import weakref

import pytest
import torch
from vllm.inputs import TokensPrompt

from tests.conftest import model_runner
from tests.engine.test_engine import generate_ids, greedy, random_prompt

pytestmark = pytest.mark.slow

PROMPTS = [random_prompt(length, seed=900 + length) for length in (5, 40, 130)]


def sleeping(llm) -> bool:
    return llm.llm_engine.is_sleeping()


def attention_caches(llm) -> list[torch.Tensor]:
    runner = model_runner(llm)
    layers = runner.vllm_config.compilation_config.static_forward_context
    return [layers[name].kv_cache for name in runner.kv_cache.layers]


def test_level_1_frees_the_kv_cache_and_wakes_up_to_the_same_tokens_without_recompiling(llm):
    runner = model_runner(llm)
    before = generate_ids(llm, PROMPTS, greedy(12))
    graphs, shapes = runner.recorder.num_graphs, [tuple(c.shape) for c in runner.kv_cache.tensors]
    weights = {name: p.detach().clone() for name, p in runner.model.named_parameters()}
    freed = [weakref.ref(cache) for cache in runner.kv_cache.tensors]

    llm.sleep(level=1)
    try:
        assert sleeping(llm)
        assert runner.sleep_mode.sleeping == {"weights", "kv_cache"}
        assert runner.kv_cache.tensors == [] and all(c.numel() == 0 for c in attention_caches(llm))
        gc.collect()
        assert all(ref() is None for ref in freed)  # nothing else held the KV cache: its memory is free
        assert all(p.device.type == "cpu" for p in runner.model.parameters())
    finally:
        llm.wake_up()

    assert not sleeping(llm) and runner.sleep_mode.sleeping == set()
    assert [tuple(c.shape) for c in runner.kv_cache.tensors] == shapes
    caches = list(runner.kv_cache.tensors)
    assert [c for c in attention_caches(llm)] == caches  # the layers hold the new caches
    assert all(not c.any() for c in runner.kv_cache.tensors)
    assert all(torch.equal(p, weights[name]) for name, p in runner.model.named_parameters())
    assert generate_ids(llm, PROMPTS, greedy(12)) == before
    # The graphs took the new KV tensors as inputs (VLLM_NEURON_STRICT_SHAPES would raise on a recompile).
    assert runner.recorder.num_graphs == graphs and runner.recorder.unexpected == []


def test_a_request_added_while_asleep_waits_and_is_served_after_wake_up(llm):
    engine, runner = llm.llm_engine, model_runner(llm)
    [expected] = generate_ids(llm, PROMPTS[1:2], greedy(8))
    llm.sleep(level=1)
    try:
        engine.add_request("added-while-asleep", TokensPrompt(prompt_token_ids=PROMPTS[1]), greedy(8))
        for _ in range(3):
            assert engine.step() == []  # vLLM's scheduler is paused: the request waits
        assert runner.sleep_mode.sleeping == {"weights", "kv_cache"}
    finally:
        llm.wake_up()
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = list(output.outputs[0].token_ids)
    assert tokens == expected


def test_the_worker_refuses_a_step_while_asleep(llm):
    from worker.compiles import warmup

    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    runner = worker.model_runner
    [first, *_] = warmup.warmup_steps(
        runner.buckets, max_model_len=runner.model_config.max_model_len, block_size=runner.block_size
    )
    llm.sleep(level=1)
    try:
        with pytest.raises(RuntimeError, match="wake_up"):
            worker.execute_model(first.step)
    finally:
        llm.wake_up()


def test_wake_up_by_tag_resumes_serving_only_when_everything_is_back(llm):
    runner = model_runner(llm)
    expected = generate_ids(llm, PROMPTS[:1], greedy(6))
    llm.sleep(level=1)
    try:
        llm.wake_up(tags=["weights"])
        assert runner.sleep_mode.sleeping == {"kv_cache"} and sleeping(llm)
    finally:
        llm.wake_up(tags=["kv_cache"])
    assert not sleeping(llm)
    assert generate_ids(llm, PROMPTS[:1], greedy(6)) == expected


def test_release_kv_cache_memory_after_a_level_0_pause(llm):
    runner = model_runner(llm)
    expected = generate_ids(llm, PROMPTS[:2], greedy(6))
    llm.sleep(level=0)
    try:
        # Hand the finished requests to the worker and drain the step scheduled ahead of their end (async
        # scheduling), as the engine core's loop would.
        for _ in range(2):
            llm.llm_engine.step()
        llm.release_kv_cache_memory()
        assert runner.kv_cache.tensors == [] and runner.sleep_mode.sleeping == {"kv_cache"}
    finally:
        llm.wake_up(tags=["kv_cache"])
    assert generate_ids(llm, PROMPTS[:2], greedy(6)) == expected


def test_level_2_discards_the_weights_and_serves_again_once_they_are_reloaded(llm):
    runner = model_runner(llm)
    before = generate_ids(llm, PROMPTS, greedy(12))
    graphs = runner.recorder.num_graphs
    weights = {name: p.detach().clone() for name, p in runner.model.named_parameters()}

    llm.sleep(level=2)
    try:
        assert runner.sleep_mode.sleeping == {"weights", "kv_cache"}
        assert all(p.numel() == 0 for p in runner.model.parameters())  # discarded, in CPU mode too
        llm.wake_up(tags=["weights"])
        assert all(not p.any() for p in runner.model.parameters())  # back in place, not loaded yet
        llm.collective_rpc("reload_weights")
    finally:
        llm.wake_up(tags=["kv_cache"])

    assert not sleeping(llm)
    assert all(torch.equal(p, weights[name]) for name, p in runner.model.named_parameters())
    assert generate_ids(llm, PROMPTS, greedy(12)) == before
    assert runner.recorder.num_graphs == graphs and runner.recorder.unexpected == []
