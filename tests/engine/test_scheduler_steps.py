"""Scripted arrivals and a cancellation, and the calls the runner makes at each step
(tests/scripted_steps.py): a regression in how steps become bucketed calls shows up as a readable diff."""

import pytest
from vllm.inputs import TokensPrompt

from tests.conftest import model_runner
from tests.helpers import greedy, random_prompt
from tests.scripted_steps import ARRIVALS, CANCELLED, EXPECTED
from vllm_neuron.calls import Call

pytestmark = pytest.mark.slow


def test_scripted_steps_become_the_expected_calls(llm):
    engine, runner = llm.llm_engine, model_runner(llm)
    graphs = runner.recorder.num_graphs
    observed = []
    for step in range(len(EXPECTED)):
        for req_id, prompt_len, max_tokens in ARRIVALS.get(step, []):
            prompt = random_prompt(prompt_len, seed=9000 + prompt_len)  # unseen: no prefix-cache hits
            engine.add_request(f"steps-{req_id}", TokensPrompt(prompt_token_ids=prompt), greedy(max_tokens))
        engine.abort_request([f"steps-{req_id}" for req_id in CANCELLED.get(step, [])])
        runner.step_calls = []
        engine.step()
        observed.append(runner.step_calls)
    assert observed == EXPECTED
    assert not engine.has_unfinished_requests()
    assert runner.recorder.num_graphs == graphs


def test_a_short_chunk_beside_a_batch_without_mixed_calls_runs_once_on_its_own(llm):
    """Three requests decoding are more than half of max_num_seqs: no cap, and their batch bucket (4) has no
    mixed calls, so a short prompt arriving then runs as its own call, and the decode rows exactly once."""
    engine, runner = llm.llm_engine, model_runner(llm)
    for index in range(3):
        prompt = random_prompt(5, seed=9100 + index)
        engine.add_request(f"busy-{index}", TokensPrompt(prompt_token_ids=prompt), greedy(6))
    runner.step_calls = []
    engine.step()  # their prompts, packed in one call: 3 chunks of one 32-token block each
    assert runner.step_calls == [Call.prefill(tokens=15, token_bucket=32, chunk_context=128, chunks=3)]
    engine.add_request("short", TokensPrompt(prompt_token_ids=random_prompt(10, seed=9200)), greedy(2))
    runner.step_calls = []
    engine.step()
    assert runner.step_calls == [
        Call.decode(rows=3, batch=4, decode_context=128),
        Call.prefill(tokens=10, token_bucket=32, chunk_context=128),
    ]
    while engine.has_unfinished_requests():
        engine.step()
