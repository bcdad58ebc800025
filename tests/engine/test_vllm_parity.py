"""Our plugin against vLLM's own CPU platform (plugin off) and in half precision, each engine in its own
process because a process picks its vLLM platform once."""

import pytest

from tests.conftest import FEW_BUCKETS_ENGINE, FEW_BUCKETS_GRAPHS
from tests.helpers import MAX_TOKENS, PROMPTS, generate_ids, greedy, hf_greedy, run_engine
from vllm_neuron.compiler import hlo_text

pytestmark = pytest.mark.slow


def test_same_tokens_as_vllm_own_cpu_platform(llm, hf_model, tiny_model_dir):
    baseline = run_engine(
        tiny_model_dir,
        {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "seed": 0},
        {"VLLM_NEURON_DEVICE": None, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert baseline["platform"] == "CpuPlatform"  # the plugin stayed off without VLLM_NEURON_DEVICE
    ours = generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))
    assert ours == baseline["tokens"]
    assert ours == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_tracks_float32(llm, tiny_model_dir, dtype, tmp_path):
    env = {"VLLM_NEURON_DEVICE": "cpu", "VLLM_NEURON_DUMP_GRAPHS": str(tmp_path)}
    kwargs = FEW_BUCKETS_ENGINE | {"dtype": dtype}
    result = run_engine(tiny_model_dir, kwargs, env)
    assert result["platform"] == "NeuronPlatform"
    # Every warm-up graph lowered in this dtype too (the suite's engines use the xla backend), each KV cache
    # written with one aliased scatter; --dump-graphs wrote them, named by call.
    dumped = sorted(tmp_path.glob("*.stablehlo.mlir"))
    (stats,) = result["compile_stats"]
    assert len(dumped) == len(list(tmp_path.glob("*.fx.txt"))) == stats["graphs"] == FEW_BUCKETS_GRAPHS
    assert [path.name.split("-")[1] for path in dumped] == ["prefill", "decode", "decode"]  # the last mixed
    assert dumped[0].name.startswith("000-prefill-of-")
    for path in dumped:
        writes = hlo_text.cache_writes(path.read_text())
        assert len(writes) == 2 and all(write.problems == [] for write in writes), (path.name, writes)
    float32 = generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))
    for half, full in zip(result["tokens"], float32, strict=True):
        assert len(half) == MAX_TOKENS
        # Rounding may flip a near tie later in the sequence, but the first token must agree.
        assert half[0] == full[0], (dtype, half, full)
