"""Speculative decoding (n-gram prompt lookup, a draft model) on static shapes: verify calls and the draft's
graphs compiled at warm-up, exactly the greedy tokens of decoding without it, under chunked prefill,
mid-stream joins and preemption."""

import json

import numpy as np
import pytest
import torch
from openai import OpenAI

from server.check import plan_of
from server.info_endpoint import describe
from tests.conftest import ENGINE_KWARGS
from tests.engine.test_preemption import BLOCK_BYTES
from tests.engine.test_server import metric_values
from tests.fp8_reference import hf_with_weights, round_kv_through_fp8
from tests.helpers import engine_config, hf_greedy, random_prompt, run_engine
from tests.serving import MODEL_NAME, ServerProcess, http
from tests.tiny_model import build_tiny_llama
from vllm_neuron import sampling
from vllm_neuron.buckets import BucketConfig
from vllm_neuron.calls import plan_step
from vllm_neuron.compiler import hlo_text
from worker.spec_decode.speculation import accepted_sampled, accepted_tokens

DRAFTS = 3
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": DRAFTS,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 2,
}
SPEC_COUNTERS = [
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
]


def copy_friendly_prompt(length: int, seed: int) -> list[int]:
    """A short random phrase repeated: n-gram lookup finds what comes next in the prompt."""
    phrase = random_prompt(5 + seed % 7, seed=seed)
    return (phrase * (length // len(phrase) + 1))[:length]


@pytest.mark.slow
def test_ngram_speculation_gives_the_greedy_tokens_of_plain_decoding(tiny_model_dir, hf_model):
    # Prompts of many lengths (chunked past 96 tokens), more than max_num_seqs (requests join mid-stream),
    # and too little KV cache for all of them at once (preemption).
    prompts = [copy_friendly_prompt(8 + (29 * i) % 150, seed=700 + i) for i in range(12)]
    prompts += [random_prompt(5 + (41 * i) % 120, seed=800 + i) for i in range(12)]
    # Asked again later, this prompt's first 64 tokens are cached: it joins as a decode row, which vLLM's
    # scheduler pads with -1 placeholder drafts.
    cached = prompts[-1] = random_prompt(65, seed=900)
    engine = {
        **ENGINE_KWARGS,
        "max_num_seqs": 8,
        "kv_cache_memory_bytes": 24 * BLOCK_BYTES,  # 24 blocks: 8 requests want up to 48
        "disable_log_stats": False,
        "speculative_config": SPECULATIVE,
        # Few graphs, each path still taken: sub-chunks (prompts past 64 tokens), mixed calls (batch 2).
        "additional_config": {
            "prefill_buckets": [64],
            "decode_batch_buckets": [2, 8],
            "context_buckets": [256],
        },
    }
    seeded = {"temperature": 0.9, "top_p": 0.9, "seed": 11, "max_tokens": 16, "ignore_eos": True}
    # Random rows (temperature 1) whose distribution is a point mass (top_k 1) draw the greedy tokens through
    # speculative sampling: a draft is accepted with its probability (1 for the argmax, else 0), a rejected
    # one replaced by a token drawn without it (the argmax).
    near_greedy = {"temperature": 1.0, "top_k": 1, "max_tokens": 24, "ignore_eos": True}
    greedy = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    sampling = [{"prompt": cached, "params": greedy}]
    sampling += [{"prompt": prompts[0], "params": seeded}, {"prompt": prompts[0], "params": seeded}]
    sampling += [{"prompt": prompt, "params": near_greedy} for prompt in prompts[1:4]]
    result = run_engine(
        tiny_model_dir,
        engine,
        {"VLLM_NEURON_DEVICE": "cpu"},
        prompts=prompts,
        max_tokens=24,
        extra={"sampling": sampling, "metrics": SPEC_COUNTERS, "churn_bursts": 2},
    )
    assert result["async_scheduling"] is False  # vLLM runs n-gram proposals without it
    assert result["tokens"] == [hf_greedy(hf_model, p, 24) for p in prompts]
    assert result["preemptions"] > 0
    # prefill 1, decode 2, mixed (batch 2) 1, verify 2: all at warm-up, none after, through the churn of
    # cancelled and finished requests too
    [stats] = result["compile_stats"]
    assert (stats["graphs"], stats["unexpected_recompiles"]) == (1 + 2 + 1 + 2, 0)
    assert result["churn"]["blocks_freed"]
    # a seeded request, speculating, draws the same tokens again
    again, first, second, *near_greedy_tokens = result["sampled_tokens"]
    assert again == result["tokens"][-1]
    assert first == second
    assert near_greedy_tokens == [hf_greedy(hf_model, p, 24) for p in prompts[1:4]]
    metrics = result["metrics"]
    assert metrics["vllm:spec_decode_num_draft_tokens"] > 0
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens"] <= metrics["vllm:spec_decode_num_draft_tokens"]


def test_a_row_takes_its_matching_drafts_then_the_targets_token():
    targets = np.array([7, 8, 9, 10])
    assert accepted_tokens([7, 8, 9], targets) == [7, 8, 9, 10]  # all accepted, and the token after them
    assert accepted_tokens([7, 5, 9], targets) == [7, 8]  # the first mismatch ends it: the target's token
    assert accepted_tokens([1, 8, 9], targets) == [7]  # none accepted: the one token plain decoding gives
    assert accepted_tokens([7], targets[:2]) == [7, 8]


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.0), (0.8, 20, 0.9, 0.0), (1.3, 0, 0.95, 0.05)]
)
def test_a_random_rows_draft_accepted_by_its_probability_draws_from_the_targets_distribution(
    temperature, top_k, top_p, min_p
):
    """Speculative sampling with a point-mass draft: accept the draft with its probability, else take the
    graph's token drawn without it. Over many draws the tokens follow the target's distribution exactly
    (total variation within sampling noise), for the most likely token as draft and for an unlikely one."""
    vocab, draws = 48, 40_000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab, generator=gen) * 2

    def table(rows: int, drafts: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        params = torch.zeros(rows, sampling.PARAMS)
        params[:, : sampling.UNIFORM] = torch.tensor([temperature, top_k, top_p, min_p])
        params[:, sampling.UNIFORM] = uniform
        params[:, sampling.DRAFT] = drafts + 1
        return params

    # The target's distribution: each token's probability, as the graph reports it for a draft.
    exact = sampling.sample(logits.expand(vocab, vocab), table(vocab, torch.arange(vocab), 0.5)).draft_probs
    assert exact.sum().item() == pytest.approx(1.0, abs=1e-5)
    for draft in (int(exact.argmax()), int(exact.argsort()[-5])):
        rows = sampling.sample(
            logits.expand(draws, vocab),
            table(draws, torch.full((draws,), draft), torch.rand(draws, generator=gen)),
        )
        assert torch.allclose(rows.draft_probs, exact[draft])
        assert not (rows.token_ids == draft).any()
        source = torch.Generator().manual_seed(1)
        tokens = [
            accepted_sampled([draft], np.array([token, -1]), np.array([probability]), source)[0]
            for token, probability in zip(rows.token_ids.tolist(), rows.draft_probs.tolist(), strict=True)
        ]
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).float() / draws
        assert 0.5 * (counts - exact).abs().sum().item() < 0.02


def test_verify_calls_take_the_decode_shapes_and_no_chunk():
    buckets = BucketConfig(
        (32, 64),
        (1, 2, 4),
        (128, 256),
        page_tokens=128,
        prefill_tokens_while_decoding=64,
        mixed_batch_buckets=(1, 2),
    )
    spec = BucketConfig(**{**buckets.__dict__, "verify_tokens": 4})
    assert spec.num_graphs == buckets.num_graphs + len(buckets.decode_shapes())
    assert ("verify", 1, 256) in spec.minimal_graphs()
    # Two decode rows, one with drafts (its context is its last query's position + 1), and a short chunk.
    plans = plan_step([40, 131], [(0, 20)], spec, 32, verify=True)
    assert [plan.call.phase for plan in plans] == ["verify", "prefill"]
    verify = plans[0].call
    assert (verify.rows, verify.batch, verify.decode_context, verify.queries) == (2, 2, 256, 4)  # 1 + 2 pages
    # Without drafts the same step rides the chunk in a mixed call.
    assert [plan.call.phase for plan in plan_step([40, 129], [(0, 20)], spec, 32)] == ["mixed"]


def test_eagle_is_refused_at_start_up_naming_what_works(tiny_model_dir):
    speculative = {"method": "eagle", "model": str(tiny_model_dir), "num_speculative_tokens": 2}
    with pytest.raises(
        ValueError, match="method 'eagle' is not supported: use --speculative-config .*ngram.*draft_model"
    ):
        engine_config(tiny_model_dir, speculative_config=speculative)


@pytest.mark.parametrize(
    "option, refused",
    [
        ({"draft_sample_method": "probabilistic"}, "draft_sample_method 'probabilistic' is not supported"),
        ({"use_heterogeneous_vocab": True}, "another vocabulary .* use a draft model with the target's"),
    ],
)
def test_draft_model_options_the_plugin_does_not_run_are_refused(tiny_model_dir, option, refused):
    speculative = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=refused):
        engine_config(tiny_model_dir, speculative_config={**speculative, **option})


def test_a_draft_model_runs_without_async_scheduling_and_its_graphs_are_in_the_info(tiny_model_dir):
    speculative = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 2}
    config = engine_config(tiny_model_dir, speculative_config=speculative)
    assert config.scheduler_config.async_scheduling is False
    assert config.num_lookahead_tokens == 2  # the scheduler reserves KV slots for the draft's passes
    info = describe(config)
    described = info["speculative"]
    assert (described["method"], described["draft_model"]) == ("draft_model", str(tiny_model_dir))
    assert described["verify_tokens"] == 3
    assert described["draft_graphs"] == info["graphs"]  # one draft graph for each shape of the plan
    graphs = plan_of(config).graphs  # `vllm-neuron check` counts them in its compile estimate
    assert graphs["draft"] == sum(graphs.values()) - graphs["draft"] == info["graphs"]


def draft_model_engine(
    draft_dir, kv_blocks: int, draft_layers: int, decode_batches: list[int], fp8_cache: bool = False
) -> dict:
    # The draft's layers share the target's blocks: a block holds both models' keys and values, in float32
    # (4 bytes an element) or FP8 (1).
    block_bytes = BLOCK_BYTES * (2 + draft_layers) // 2 // (4 if fp8_cache else 1)
    return {
        **ENGINE_KWARGS,
        "max_num_seqs": 8,
        "kv_cache_memory_bytes": kv_blocks * block_bytes,
        "kv_cache_dtype": "fp8" if fp8_cache else "auto",
        "disable_log_stats": False,
        "speculative_config": {
            "method": "draft_model",
            "model": str(draft_dir),
            "num_speculative_tokens": DRAFTS,
        },
        "additional_config": {
            "prefill_buckets": [64],
            "decode_batch_buckets": decode_batches,
            "context_buckets": [256],
        },
    }


@pytest.mark.slow
def test_the_target_as_its_own_draft_model_has_every_draft_accepted(tiny_model_dir):
    """The draft model's cache follows the target's through chunked prefill, requests joining mid-stream and
    preemption (its entries recomputed with the target's), and its passes start from each row's newest
    token: with the target's own weights as the draft, the drafts are the target's greedy tokens. Over an
    FP8 cache (both models' layers quantized in the shared blocks, scales 1.0): the tokens are HF's with its
    keys and values rounded through FP8 the same way (tests/fp8_reference.py)."""
    # 8 requests at once want up to 48 KV blocks of 24; prompts past 64 tokens are chunked
    prompts = [random_prompt(5 + (37 * i) % 150, seed=950 + i) for i in range(10)]
    engine = draft_model_engine(
        tiny_model_dir, kv_blocks=24, draft_layers=2, decode_batches=[2, 8], fp8_cache=True
    )
    result = run_engine(
        tiny_model_dir,
        engine,
        {"VLLM_NEURON_DEVICE": "cpu"},
        prompts=prompts,
        max_tokens=24,
        extra={"metrics": SPEC_COUNTERS},
    )
    reference = round_kv_through_fp8(hf_with_weights(tiny_model_dir, {}), {0: (1.0, 1.0), 1: (1.0, 1.0)})
    assert result["tokens"] == [hf_greedy(reference, p, 24) for p in prompts]
    assert result["preemptions"] > 0
    assert result["compile_stats"][0]["kv_cache_dtype"] == "uint8"
    # prefill 1, decode 2, mixed 1, verify 2: each a graph of the target and one of the draft, at warm-up
    [stats] = result["compile_stats"]
    assert (stats["graphs"], stats["unexpected_recompiles"]) == (2 * 6, 0)
    metrics = result["metrics"]
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    # (float32: a verify call and the draft's decode call may round a near-tie apart)
    assert drafted > 0 and metrics["vllm:spec_decode_num_accepted_tokens"] >= 0.95 * drafted


@pytest.mark.slow
def test_a_draft_model_of_random_weights_still_gives_the_targets_greedy_tokens(
    tiny_model_dir, hf_model, tmp_path
):
    """Drafts that are nearly all wrong change nothing: greedy rows take the target's tokens, random ones
    (top-k 1: a point mass) the same, seeded ones the same tokens twice. The draft has one layer and one KV
    head: its cache layers differ in size from the target's in the same blocks."""
    draft_dir = build_tiny_llama(tmp_path / "draft", num_kv_heads=1, num_layers=1, seed=5)
    prompts = [copy_friendly_prompt(8 + (53 * i) % 150, seed=970 + i) for i in range(6)]
    seeded = {"temperature": 0.9, "top_p": 0.9, "seed": 11, "max_tokens": 16, "ignore_eos": True}
    near_greedy = {"temperature": 1.0, "top_k": 1, "max_tokens": 24, "ignore_eos": True}
    sampling = [{"prompt": prompts[0], "params": seeded}, {"prompt": prompts[0], "params": seeded}]
    sampling += [{"prompt": prompt, "params": near_greedy} for prompt in prompts[1:3]]
    result = run_engine(
        tiny_model_dir,
        draft_model_engine(draft_dir, kv_blocks=64, draft_layers=1, decode_batches=[8]),
        {"VLLM_NEURON_DEVICE": "cpu"},
        prompts=prompts,
        max_tokens=24,
        extra={"sampling": sampling, "metrics": SPEC_COUNTERS},
    )
    assert result["tokens"] == [hf_greedy(hf_model, p, 24) for p in prompts]
    first, second, *near_greedy_tokens = result["sampled_tokens"]
    assert first == second
    assert near_greedy_tokens == [hf_greedy(hf_model, p, 24) for p in prompts[1:3]]
    [stats] = result["compile_stats"]
    assert (stats["graphs"], stats["unexpected_recompiles"]) == (2 * 3, 0)  # prefill, decode, verify
    # Readiness counts the draft's graphs as the plan does (vllm_neuron/graph_plan.py).
    progress = result["compile_progress"]
    assert progress["graphs_total"] == progress["graphs_ready"] == stats["graphs"]
    metrics = result["metrics"]
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    assert drafted > 0 and metrics["vllm:spec_decode_num_accepted_tokens"] < 0.2 * drafted


@pytest.fixture(scope="module")
def speculating_server(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("speculating-server")
    # Three graphs (prefill, decode, verify), to start quickly.
    buckets = {"prefill_buckets": [64], "decode_batch_buckets": [4], "context_buckets": [256]}
    server = ServerProcess(
        tiny_model_dir,
        folder / "server.log",
        "--speculative-config",
        json.dumps(SPECULATIVE),
        "--additional-config",
        json.dumps(buckets),
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_a_speculating_server_answers_greedy_requests_as_hf_and_reports_its_acceptance(
    speculating_server, hf_model
):
    prompts = [copy_friendly_prompt(60, seed=3), random_prompt(30, seed=4)]
    client = OpenAI(base_url=speculating_server.base + "/v1", api_key="none", max_retries=0, timeout=120)
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        max_tokens=32,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [choice.token_ids for choice in completion.choices] == [
        hf_greedy(hf_model, p, 32) for p in prompts
    ]

    metrics = http("GET", speculating_server.base + "/metrics")[1].decode()
    drafts = sum(metric_values(metrics, "vllm:spec_decode_num_draft_tokens_total").values())
    accepted = sum(metric_values(metrics, "vllm:spec_decode_num_accepted_tokens_total").values())
    assert 0 < accepted <= drafts
    assert sum(metric_values(metrics, "vllm_neuron:unexpected_recompiles_total").values()) == 0
    info = json.loads(http("GET", speculating_server.base + "/v1/neuron/info")[1])
    speculative = info["speculative"]
    assert (speculative["method"], speculative["verify_tokens"], speculative["verify_graphs"]) == (
        "ngram",
        4,
        1,
    )
    assert speculative["acceptance_rate"] == pytest.approx(accepted / drafts)
    # The engine core's calls a step, read back from Prometheus's multiprocess files: n-gram proposes on the
    # host (no propose call); each step is at least one call.
    calls = sum(metric_values(metrics, "vllm_neuron:bucket_calls_total").values())
    steps = sum(metric_values(metrics, "vllm_neuron:sampled_steps_total").values())
    assert speculative["calls_per_step"] == pytest.approx(calls / steps) and calls >= steps > 0
    assert speculative["propose_calls_per_step"] == 0
    assert info["graphs"] == 3


@pytest.mark.slow
def test_verify_and_draft_graphs_lower_with_the_cache_written_in_place(tiny_model_dir, tmp_path):
    """Verify calls and a draft model's graphs go the way TorchNeuron lowers them (TorchNeuron's route to
    StableHLO; the other engines of this module lower theirs in float32), in bfloat16: each layer's KV cache
    aliased and scattered with the call's new rows only, a row's drafts included."""
    speculative = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": DRAFTS}
    engine = {
        **ENGINE_KWARGS,
        "dtype": "bfloat16",
        "speculative_config": speculative,
        "additional_config": {"prefill_buckets": [64], "decode_batch_buckets": [4], "context_buckets": [256]},
    }
    # Lowered, not run (`vllm-neuron check`'s backend): running bfloat16 graphs on the CPU is slow, and the
    # tokens are not what this test checks.
    env = {
        "VLLM_NEURON_DEVICE": "cpu",
        "VLLM_NEURON_DUMP_GRAPHS": str(tmp_path),
        "VLLM_NEURON_COMPILE_BACKEND": "lower-only",
    }
    prompts = [copy_friendly_prompt(40, seed=1), random_prompt(20, seed=2)]
    result = run_engine(tiny_model_dir, engine, env, prompts=prompts, max_tokens=16)
    [stats] = result["compile_stats"]
    # prefill, decode, verify: each the target's graph and the draft's
    assert (stats["graphs"], stats["unexpected_recompiles"]) == (6, 0)
    dumps = sorted(tmp_path.glob("*.stablehlo.mlir"))
    assert len(dumps) == 6
    for dump in dumps:
        writes = hlo_text.cache_writes(dump.read_text())
        assert len(writes) == 2, dump.name  # each model's two layers
        for write in writes:
            assert write.problems == [], (dump.name, write.problems)
            if "-verify-of-" in dump.name:
                (updates,) = write.scatters
                assert updates[0] <= 2 * 2 * 4 * (1 + DRAFTS)  # K and V, 2 KV heads, 4 rows of 1 + 3 queries
