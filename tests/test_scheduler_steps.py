"""Scripted arrivals and a cancellation, and the calls the runner makes at each step: a regression in how
steps become bucketed calls shows up as a readable diff of this table.

Engine: max_num_batched_tokens 96, max_num_seqs 4; buckets prefill [32, 64], decode [1, 2, 4],
context [128, 256], prefill share 64 (tests/conftest.py). vLLM's scheduler serves running requests first,
then waiting ones, within the 96-token budget. Under light load (at most 2 of 4 requests decoding, and a
prompt waiting beside them, not a queue) our scheduler holds prefill to 64 tokens a step
(vllm_neuron/scheduler.py), and a chunk of at most 64 tokens rides in the call of 1 or 2 decode rows (a
mixed call, vllm_neuron/buckets.py), attending over the largest context bucket. The other prefill chunks of
a step are packed into calls that fit the largest prefill and context buckets."""

import pytest
from vllm.inputs import TokensPrompt

from tests.conftest import model_runner
from tests.test_engine import greedy, random_prompt

pytestmark = pytest.mark.slow

ARRIVALS = {  # step -> [(request id, prompt tokens, max tokens)]
    0: [("a", 40, 30), ("b", 100, 4)],
    2: [("c", 5, 3)],
    4: [("d", 150, 2)],
}
CANCELLED = {6: ["a"]}

EXPECTED = [
    # step 0: nothing decodes yet: a's whole prompt and the first 56 tokens of b fill the 96-token budget
    [
        "prefill of 40 tokens at 0: tokens 64 x context 128",
        "prefill of 56 tokens at 0: tokens 64 x context 128",
    ],
    # step 1: a decodes while b's prefill finishes, in one call
    ["decode of 1 requests: batch 1 x context 128, with prefill of 44 tokens at 56: tokens 64 x context 256"],
    # step 2: c arrives and prefills beside two decodes
    ["decode of 2 requests: batch 2 x context 128, with prefill of 5 tokens at 0: tokens 64 x context 256"],
    # step 3: three decodes pad to the batch bucket of 4
    ["decode of 3 requests: batch 4 x context 128"],
    # step 4: d arrives while three of four requests decode (more than half: no cap): its first 93 tokens
    # (96 minus 3 decodes) run as sub-chunks of 64 and 29, apart from the decode rows (batch 4 has no mixed
    # calls: steps that full are not capped); b and c finish
    [
        "decode of 3 requests: batch 4 x context 128",
        "prefill of 64 tokens at 0: tokens 64 x context 128",
        "prefill of 29 tokens at 64: tokens 32 x context 128",
    ],
    # step 5: light load (a decodes, d prefills): d's prefill may take 64 tokens, and its last 57 need the
    # 256 context bucket
    ["decode of 1 requests: batch 1 x context 128, with prefill of 57 tokens at 93: tokens 64 x context 256"],
    # step 6: a was cancelled; d decodes alone and finishes
    ["decode of 1 requests: batch 1 x context 256"],
    # step 7: nothing left
    [],
]


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
    assert runner.step_calls == ["prefill of 3 requests, 15 tokens: tokens 32 x context 128"]
    engine.add_request("short", TokensPrompt(prompt_token_ids=random_prompt(10, seed=9200)), greedy(2))
    runner.step_calls = []
    engine.step()
    assert runner.step_calls == [
        "decode of 3 requests: batch 4 x context 128",
        "prefill of 10 tokens at 0: tokens 32 x context 128",
    ]
    while engine.has_unfinished_requests():
        engine.step()
