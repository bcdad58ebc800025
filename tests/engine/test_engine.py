"""The plugin inside a real vLLM engine on the tiny model: greedy tokens equal HF transformers, batches of
mixed lengths, continuous batching, sampling parameters, and no compile after warm-up."""

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from tests.conftest import EXPECTED_GRAPHS, MAX_MODEL_LEN, model_runner
from tests.helpers import generate_ids, greedy, hf_greedy, random_prompt
from vllm_neuron.calls import Call

pytestmark = pytest.mark.slow


def test_platform_is_the_plugin_in_cpu_mode(llm):
    from vllm.platforms import current_platform

    from vllm_neuron.platform import NeuronPlatform

    assert isinstance(current_platform, NeuronPlatform)
    assert current_platform.device_type == "cpu"
    runner = model_runner(llm)
    assert type(runner).__module__ == "worker.step.model_runner"
    assert runner.recorder.num_graphs == EXPECTED_GRAPHS == runner.buckets.num_graphs


def test_one_prompt_matches_hf(llm, hf_model):
    prompt = random_prompt(12, seed=1)
    assert generate_ids(llm, [prompt], greedy(24)) == [hf_greedy(hf_model, prompt, 24)]


def test_batch_of_very_different_lengths_matches_hf(llm, hf_model):
    # 1 token; one decode bucket; a chunk split into sub-chunks (> 64); a prompt the scheduler chunks over
    # several steps (> 96 tokens) while other requests decode; one near max_model_len.
    lengths = [1, 7, 70, 150, MAX_MODEL_LEN - 20]
    prompts = [random_prompt(n, seed=n) for n in lengths]
    max_tokens = 16
    got = generate_ids(llm, prompts, greedy(max_tokens))
    expected = [hf_greedy(hf_model, p, max_tokens) for p in prompts]
    assert got == expected
    assert model_runner(llm).recorder.num_graphs == EXPECTED_GRAPHS


def test_requests_joining_mid_decode_match_hf(llm, hf_model):
    """Continuous batching: requests arrive while others are decoding, and leave at different steps."""
    engine = llm.llm_engine
    plan = {  # request id -> (arrival step, prompt, max tokens)
        "a": (0, random_prompt(20, seed=11), 30),
        "b": (3, random_prompt(5, seed=12), 8),
        "c": (3, random_prompt(110, seed=13), 12),
        "d": (9, random_prompt(40, seed=14), 20),
        "e": (15, random_prompt(3, seed=15), 5),
    }
    finished: dict[str, list[int]] = {}
    step = 0
    while len(finished) < len(plan):
        for req_id, (arrival, prompt, max_tokens) in plan.items():
            if arrival == step:
                engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), greedy(max_tokens))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        step += 1
        assert step < 200, "engine did not finish the scripted requests"
    for req_id, (_, prompt, max_tokens) in plan.items():
        assert finished[req_id] == hf_greedy(hf_model, prompt, max_tokens), req_id
    assert model_runner(llm).recorder.num_graphs == EXPECTED_GRAPHS


def test_a_long_row_shares_the_pages_of_short_ones_and_matches_hf(llm, hf_model):
    """A decode call attends over batch x pages(context) KV pages shared by its rows: a row of 150+ tokens
    (2 pages of 128) decodes beside two short ones (1 page each) in batch bucket 4 at context 128, below its
    own context, and every output still equals HF."""
    engine, runner = llm.llm_engine, model_runner(llm)
    prompts = {
        "long": random_prompt(150, seed=31),
        "s1": random_prompt(3, seed=32),
        "s2": random_prompt(9, seed=33),
    }
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), greedy(10))
    finished: dict[str, list[int]] = {}
    calls: list[Call] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        calls += runner.step_calls
        finished |= {out.request_id: list(out.outputs[0].token_ids) for out in outputs if out.finished}
    assert Call.decode(rows=3, batch=4, decode_context=128) in calls
    for req_id, prompt in prompts.items():
        assert finished[req_id] == hf_greedy(hf_model, prompt, 10), req_id


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm):
    prompt = random_prompt(30, seed=21)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = generate_ids(llm, [prompt], params)[0]
    again = generate_ids(llm, [prompt], params)[0]
    with_others = generate_ids(llm, [random_prompt(90, seed=22), prompt, random_prompt(4, seed=23)], params)[
        1
    ]
    assert alone == again == with_others
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    assert generate_ids(llm, [prompt], other_seed)[0] != alone


def test_sampling_parameters(llm):
    prompt = TokensPrompt(prompt_token_ids=random_prompt(16, seed=31))
    out = llm.generate(
        prompt,
        SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, logprobs=2, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert len(completion.token_ids) == 6
        assert len(completion.logprobs) == 6
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry and len(entry) >= 2

    penalized = SamplingParams(
        max_tokens=24, temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0
    )
    plain = greedy(24)
    assert generate_ids(llm, [prompt["prompt_token_ids"]], penalized) != generate_ids(
        llm, [prompt["prompt_token_ids"]], plain
    )

    text = llm.generate("The quick brown fox", SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False)
    full = text[0].outputs[0].text
    assert len(full) > 3
    stop = full[2:4]
    stopped = llm.generate(
        "The quick brown fox", SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text and full.startswith(stopped.text)
    assert model_runner(llm).recorder.num_graphs == EXPECTED_GRAPHS


def test_structured_output_and_logit_bias(llm):
    from vllm.sampling_params import StructuredOutputsParams

    choices = ["Paris", "Tokyo", "vLLM"]
    params = SamplingParams(
        max_tokens=16, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    outputs = llm.generate(["The capital of Japan is", "Hello, my name is"], params, use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outputs)

    prompt = random_prompt(10, seed=41)
    favoured = 123
    biased = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={favoured: 100.0}, ignore_eos=True)
    assert generate_ids(llm, [prompt], biased) == [[favoured] * 5]
    assert model_runner(llm).recorder.num_graphs == EXPECTED_GRAPHS
