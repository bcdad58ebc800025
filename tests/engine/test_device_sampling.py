"""The compiled graph samples in the engine: greedy equals vLLM's host sampler token for token, seeded
requests are reproducible whatever shares their batch (host-path requests included), steps with a request
the graph cannot sample take the host sampler, and only token ids leave the device otherwise."""

import pytest
from prometheus_client import REGISTRY
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from tests.conftest import EXPECTED_GRAPHS, model_runner
from tests.helpers import random_prompt

# A zero bias changes no logit but is a feature the graph does not apply: the request takes the host sampler.
HOST_PATH = {"logit_bias": {0: 0.0}}


def sampled_steps(sampler: str) -> float:
    return REGISTRY.get_sample_value("vllm_neuron:sampled_steps_total", {"sampler": sampler}) or 0.0


def bytes_to_host() -> tuple[float, float]:
    """(bytes, steps) copied to the host so far."""
    name = "vllm_neuron:step_device_to_host_bytes"
    return REGISTRY.get_sample_value(f"{name}_sum") or 0.0, REGISTRY.get_sample_value(f"{name}_count") or 0.0


def generate(llm, prompts: list[list[int]], params: list[SamplingParams]):
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def test_greedy_and_logprobs_equal_the_host_samplers(llm):
    prompts = [random_prompt(n, seed=300 + n) for n in (4, 27, 75)]
    device = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True)
    host = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True, **HOST_PATH)
    host_steps = sampled_steps("host")
    on_device = generate(llm, prompts, [device] * 3)
    assert sampled_steps("host") == host_steps  # every step sampled in the graph
    on_host = generate(llm, prompts, [host] * 3)
    assert sampled_steps("host") > host_steps
    for graph, vllm_sampler in zip(on_device, on_host, strict=True):
        assert graph.token_ids == vllm_sampler.token_ids
        for graph_entry, host_entry in zip(graph.logprobs, vllm_sampler.logprobs, strict=True):
            assert graph_entry.keys() == host_entry.keys()
            for token, logprob in graph_entry.items():
                assert logprob.rank == host_entry[token].rank
                assert logprob.logprob == pytest.approx(host_entry[token].logprob, abs=1e-5)


def test_seeded_requests_do_not_depend_on_the_host_path_sharing_their_batch(llm):
    prompt = random_prompt(25, seed=310)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, min_p=0.01, seed=77, ignore_eos=True)
    penalised = SamplingParams(
        max_tokens=20, temperature=0.8, seed=78, repetition_penalty=1.3, top_k=10, ignore_eos=True
    )
    alone = generate(llm, [prompt], [seeded])[0].token_ids
    host_alone = generate(llm, [prompt], [penalised])[0].token_ids
    # Both in one batch: every step takes the host sampler for the penalised row, the graph's token for the
    # seeded one; each request gets what it gets alone.
    mixed = generate(llm, [prompt, random_prompt(60, seed=311), prompt], [seeded, seeded, penalised])
    assert mixed[0].token_ids == alone
    assert mixed[2].token_ids == host_alone
    assert alone != host_alone
    assert model_runner(llm).recorder.num_graphs == EXPECTED_GRAPHS


def test_only_token_ids_leave_the_device_on_steps_the_graph_samples(llm):
    prompts = [random_prompt(12, seed=320 + i) for i in range(4)]
    vocab = model_runner(llm).model_config.get_vocab_size()
    kinds = {
        "device": SamplingParams(max_tokens=10, temperature=1.0, top_k=40, top_p=0.9, ignore_eos=True),
        "host": SamplingParams(max_tokens=10, temperature=1.0, top_k=40, ignore_eos=True, **HOST_PATH),
    }
    per_step = {}
    for kind, params in kinds.items():
        before_bytes, before_steps = bytes_to_host()
        generate(llm, prompts, [params] * len(prompts))
        after_bytes, after_steps = bytes_to_host()
        per_step[kind] = (after_bytes - before_bytes) / (after_steps - before_steps)
    # An int32 token per row of each call, against every row's float32 logits.
    assert per_step["device"] <= 4 * len(prompts) * 2
    assert per_step["host"] >= 4 * vocab


def test_sampling_rows_leave_with_their_requests(llm):
    runner = model_runner(llm)
    for seed in (330, 331):  # the runner hears that a request finished at the next step
        generate(llm, [random_prompt(5, seed=seed)], [SamplingParams(max_tokens=3, **HOST_PATH)])
    assert not runner.host_sampler_only
    assert runner.batch.sampling.keys() == runner.batch.requests.keys()
    assert len(runner.batch.sampling) <= 1
