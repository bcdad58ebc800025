"""Continuous batching decisions the runner must serve on static shapes: prefix-cache hits and long prompts
arriving while other requests decode."""

import pytest
from vllm.inputs import TokensPrompt

from tests.conftest import MAX_MODEL_LEN, model_runner
from tests.helpers import greedy, hf_greedy, random_prompt

pytestmark = pytest.mark.slow


def test_prefix_cache_hit_computes_only_new_tokens(llm, hf_model):
    runner = model_runner(llm)
    prefix = random_prompt(150, seed=71)
    first, second = prefix + random_prompt(10, seed=72), prefix + random_prompt(12, seed=73)

    before = runner.stats.real_tokens["prefill"]
    out_first = llm.generate(TokensPrompt(prompt_token_ids=first), greedy(8), use_tqdm=False)[0]
    computed_first = runner.stats.real_tokens["prefill"] - before
    before = runner.stats.real_tokens["prefill"]
    out_second = llm.generate(TokensPrompt(prompt_token_ids=second), greedy(8), use_tqdm=False)[0]
    computed_second = runner.stats.real_tokens["prefill"] - before

    assert computed_first == len(first)
    cached = out_second.num_cached_tokens
    assert cached == 128  # the prefix's whole blocks (block size 32)
    assert computed_second == len(second) - cached
    assert list(out_first.outputs[0].token_ids) == hf_greedy(hf_model, first, 8)
    assert list(out_second.outputs[0].token_ids) == hf_greedy(hf_model, second, 8)


def test_running_streams_keep_decoding_while_a_long_prompt_prefills(llm, hf_model):
    """Each step of the long prefill gives every running stream its next token and carries at most
    prefill_tokens_while_decoding prefill tokens (64 in the test engine), since two
    streams decoding in a batch of four and one prompt waiting is light load. Each such step is one call:
    the decode rows and the chunk together, and every output still equals HF."""
    engine, runner = llm.llm_engine, model_runner(llm)
    cap = runner.buckets.prefill_tokens_while_decoding
    assert cap == 64
    streams = {"s1": random_prompt(12, seed=81), "s2": random_prompt(30, seed=82)}
    for req_id, prompt in streams.items():
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), greedy(40))
    tokens = {req_id: 0 for req_id in streams}
    for _ in range(3):  # both streams are decoding
        for output in engine.step():
            tokens[output.request_id] = len(output.outputs[0].token_ids)
    long_prompt = random_prompt(MAX_MODEL_LEN - 8, seed=83)
    engine.add_request("long", TokensPrompt(prompt_token_ids=long_prompt), greedy(4))
    prefill_steps = 0
    outputs: dict[str, list[int]] = {}
    while "long" not in outputs or len(outputs) < 3:
        before, prefilled = dict(tokens), runner.stats.real_tokens["prefill"]
        long_waiting = "long" not in tokens or tokens["long"] == 0
        for output in engine.step():
            tokens[output.request_id] = len(output.outputs[0].token_ids)
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        if long_waiting and tokens.get("long", 0) == 0:
            prefill_steps += 1
            # Every step of the long prefill also gave each unfinished stream its next token.
            assert all(tokens[s] == before[s] + 1 for s in streams if s not in outputs), (before, tokens)
            assert runner.stats.real_tokens["prefill"] - prefilled <= cap
            # ... in one mixed call: the chunk rides with the decode rows (one pass over the weights).
            (call,) = runner.step_calls
            assert (call.phase, call.rows, call.batch) == ("mixed", 2, 2)
    assert prefill_steps >= 248 // cap  # the 248-token prompt took several capped steps
    for req_id, prompt in streams.items():
        assert outputs[req_id] == hf_greedy(hf_model, prompt, 40)
    assert outputs["long"] == hf_greedy(hf_model, long_prompt, 4)
