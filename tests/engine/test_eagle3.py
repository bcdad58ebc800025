"""Speculative decoding with an EAGLE3 head (worker/spec_decode/eagle3.py): vLLM's own head class and loader,
the head's first pass inside the target's graph, its passes in one propose graph per decode shape; against
HF's greedy tokens and vLLM's own CPU runner on the same pair."""

import pytest

from server.check import plan_of
from server.info_endpoint import describe
from tests.conftest import ENGINE_KWARGS
from tests.eagle3_head import build_eagle3_head
from tests.engine.test_preemption import BLOCK_BYTES
from tests.engine.test_speculative import SPEC_COUNTERS
from tests.environment import TENSOR_PARALLEL_ENVIRONMENT
from tests.fp8_reference import hf_with_weights, round_kv_through_fp8
from tests.helpers import engine_config, hf_greedy, random_prompt, run_engine
from vllm_neuron.compiler import hlo_text

DRAFTS = 3
# The suite's engine with fresh prefill calls off (the head's first pass reads the cache) and room for 8
# requests over `blocks` KV blocks, each holding the target's two layers and the head's one.
# Compiled calls, propose calls and scheduler steps.
LAUNCHES = (
    "vllm_neuron:bucket_calls",
    "vllm_neuron:bucket_calls{phase=propose}",
    "vllm_neuron:sampled_steps",
)
BUCKETS = {"prefill_buckets": [64], "decode_batch_buckets": [2, 8], "context_buckets": [256]}


def eagle3_engine(head_dir, blocks: int, fp8_cache: bool = False) -> dict:
    return {
        **ENGINE_KWARGS,
        "max_num_seqs": 8,
        # float32 (4 bytes an element) or FP8 (1)
        "kv_cache_memory_bytes": blocks * BLOCK_BYTES * 3 // 2 // (4 if fp8_cache else 1),
        "kv_cache_dtype": "fp8" if fp8_cache else "auto",
        "disable_log_stats": False,
        "speculative_config": {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": DRAFTS},
        "additional_config": {**BUCKETS, "fresh_prefill_buckets": []},
    }


@pytest.fixture(scope="module")
def echo_head(tiny_model_dir, tmp_path_factory):
    """A head that mostly proposes the target's token again (tests/eagle3_head.py): accepted where the
    output repeats a token, so that both acceptance and rejection run."""
    return build_eagle3_head(
        tmp_path_factory.mktemp("eagle3") / "echo", tiny_model_dir, echo=True, scale=0.002
    )


@pytest.fixture(scope="module")
def attending_head(tiny_model_dir, tmp_path_factory):
    """The echo head with sharp attention that weighs in: its drafts depend on every entry of its cache (a
    first pass that skips the kept hidden states changes the drafts of half these prompts), and a few are
    accepted."""
    out = tmp_path_factory.mktemp("eagle3") / "attending"
    return build_eagle3_head(out, tiny_model_dir, echo=True, scale=0.02, attention_scale=0.3)


PROMPTS = [random_prompt(5 + (37 * i) % 150, seed=950 + i) for i in range(10)]  # past 64 tokens: chunked
# Two more after the first eight, sharing a prefix of 3 blocks: the second finds it in the prefix cache.
PREFIX = random_prompt(100, seed=990)
SHARED = [PREFIX + random_prompt(7, seed=991), PREFIX + random_prompt(12, seed=992)]


@pytest.mark.slow
def test_an_eagle3_head_drafts_and_accepts_as_vllms_own_runner(
    tiny_model_dir, hf_model, attending_head, tmp_path
):
    """Through chunked prefill, requests joining mid-stream and a prefix-cache hit, over two tensor-parallel
    ranks (the head's attention split by KV head as the target's), the plugin proposes exactly the drafts
    vLLM's own CPU runner (one rank) proposes on the same pair, request by request, accepts as many, and its
    tokens are HF's greedy ones. Its graphs, lowered on TorchNeuron's route: the target's calls write the
    head's layer beside the target's two, each once; the propose call writes the head's layer once a pass,
    each pass on the value the one before wrote; the kept hidden states are written in place too."""
    extra = {"metrics": [*SPEC_COUNTERS, "vllm:prefix_cache_hits"], "record_drafts": True}
    prompts = PROMPTS + SHARED
    # (80 blocks: no tensor of these graphs has a cache's size, or half of it, by chance)
    env = {**TENSOR_PARALLEL_ENVIRONMENT, "VLLM_NEURON_DUMP_GRAPHS": str(tmp_path)}
    engine = eagle3_engine(attending_head, 80)
    ours = run_engine(tiny_model_dir, engine | {"tensor_parallel_size": 2}, env, prompts, 24, extra)
    vllm_cpu = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "enforce_eager": True, "seed": 0}
    vllm_cpu |= {"disable_log_stats": False, "speculative_config": engine["speculative_config"]}
    vllm_env = {"VLLM_NEURON_DEVICE": None, "VLLM_CPU_KVCACHE_SPACE": "1"}
    vllm = run_engine(tiny_model_dir, vllm_cpu, vllm_env, prompts, 24, extra)
    assert vllm["platform"] == "CpuPlatform"
    assert ours["tokens"] == vllm["tokens"] == [hf_greedy(hf_model, p, 24) for p in prompts]
    assert ours["drafts"] == vllm["drafts"] and all(vllm["drafts"])
    hits = ours["metrics"].pop("vllm:prefix_cache_hits")
    # The shared prefix's whole blocks but the last, which vLLM computes again for an EAGLE head: its entry
    # before the first new token comes from that token.
    assert hits >= 64
    vllm["metrics"].pop("vllm:prefix_cache_hits")
    assert ours["metrics"] == vllm["metrics"]
    drafted = vllm["metrics"]["vllm:spec_decode_num_draft_tokens"]
    assert 0 < vllm["metrics"]["vllm:spec_decode_num_accepted_tokens"] < drafted
    # prefill 1, decode 2, mixed 1, verify 2, and a propose graph per decode shape: all at warm-up
    for stats in ours["compile_stats"]:  # each rank's
        assert (stats["graphs"], stats["unexpected_recompiles"]) == (6 + 2, 0)
    progress = ours["compile_progress"]
    assert progress["graphs_total"] == progress["graphs_ready"] == stats["graphs"]
    dumps = sorted((tmp_path / "rank-0").glob("*.stablehlo.mlir"))
    assert len(dumps) == stats["graphs"]
    for dump in dumps:
        writes = hlo_text.cache_writes(dump.read_text())
        assert all(write.problems == [] for write in writes), (dump.name, [w.problems for w in writes])
        if "-propose-of-" in dump.name:
            (write,) = writes  # the head's layer, once a pass
            rows = int(dump.name.split("-batch-")[1].split("-")[0])
            assert write.scatters == [(2 * rows, 32)] * DRAFTS  # K and V of one KV head a rank; head size 32
        else:
            # the target's two layers, the head's, and the kept hidden states (the hidden slots, a matrix)
            assert sorted(len(write.shape) for write in writes) == [2, 4, 4, 4], dump.name
            assert all(len(write.scatters) == 1 for write in writes), dump.name


@pytest.mark.slow
def test_an_eagle3_head_under_preemption_sampling_and_an_fp8_cache_changes_no_token(
    tiny_model_dir, hf_model, echo_head
):
    """Preempted requests come back without their kept hidden states (and their drafts); random rows (top-k
    1: a point mass) give the greedy tokens, a seeded row the same tokens twice; async scheduling is off. Over
    an FP8 cache (the head's layer quantized in the shared blocks too, scales 1.0) the tokens are HF's with
    its keys and values rounded through FP8 the same way."""
    seeded = {"temperature": 0.9, "top_p": 0.9, "seed": 11, "max_tokens": 16, "ignore_eos": True}
    near_greedy = {"temperature": 1.0, "top_k": 1, "max_tokens": 24, "ignore_eos": True}
    sampling = [{"prompt": PROMPTS[0], "params": seeded}, {"prompt": PROMPTS[0], "params": seeded}]
    sampling += [{"prompt": prompt, "params": near_greedy} for prompt in PROMPTS[1:3]]
    # 8 requests at once want up to 48 KV blocks of 24
    result = run_engine(
        tiny_model_dir,
        eagle3_engine(echo_head, 24, fp8_cache=True),
        {"VLLM_NEURON_DEVICE": "cpu"},
        PROMPTS,
        24,
        {"sampling": sampling, "metrics": [*SPEC_COUNTERS, *LAUNCHES]},
    )
    reference = round_kv_through_fp8(hf_with_weights(tiny_model_dir, {}), {0: (1.0, 1.0), 1: (1.0, 1.0)})
    assert result["tokens"] == [hf_greedy(reference, p, 24) for p in PROMPTS]
    assert result["compile_stats"][0]["kv_cache_dtype"] == "uint8"
    assert result["preemptions"] > 0 and not result["async_scheduling"]
    first, second, *near_greedy_tokens = result["sampled_tokens"]
    assert first == second
    assert near_greedy_tokens == [hf_greedy(reference, p, 24) for p in PROMPTS[1:3]]
    metrics = result["metrics"]
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens"] < metrics["vllm:spec_decode_num_draft_tokens"]
    calls, proposes, steps = (metrics[name] for name in LAUNCHES)
    # One propose call a step at most (the decode rows fit one call): a decode step is a verify call and a
    # propose call; a step with prefill chunks runs their calls too, as it would without speculation.
    assert 0 < proposes <= steps < calls, (calls, proposes, steps)


def test_an_eagle3_heads_graphs_are_in_the_plan_and_the_info(tiny_model_dir, tmp_path):
    head = build_eagle3_head(tmp_path / "head", tiny_model_dir)
    config = engine_config(tiny_model_dir, **eagle3_engine(head, 24))
    described = describe(config)["speculative"]
    assert (described["method"], described["draft_model"]) == ("eagle3", str(head))
    assert described["propose_graphs"] == described["verify_graphs"] == 2  # one per decode shape
    graphs = plan_of(config).graphs  # `vllm-neuron check` counts them in its compile estimate
    assert graphs["propose"] == graphs["decode"] == 2
    assert not config.scheduler_config.async_scheduling


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"additional_config": {**BUCKETS, "fresh_prefill_buckets": [64]}}, "fresh_prefill_buckets \\[\\]"),
        ({"enable_lora": True}, "LoRA with a draft model or an EAGLE3 head"),
    ],
)
def test_what_an_eagle3_head_does_not_run_is_refused_at_start_up(tiny_model_dir, tmp_path, change, refused):
    head = build_eagle3_head(tmp_path / "head", tiny_model_dir)
    with pytest.raises(ValueError, match=refused):
        engine_config(tiny_model_dir, **(eagle3_engine(head, 24) | change))
