"""Our plugin against vLLM's own CPU platform (plugin off) and in half precision, each engine in its own
process because a process picks its vLLM platform once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENGINE_KWARGS, EXPECTED_GRAPHS, hf_greedy
from tests.test_engine import generate_ids, greedy, random_prompt
from vllm_neuron import hlo_text

pytestmark = pytest.mark.slow

PROMPTS = [random_prompt(n, seed=100 + n) for n in (3, 40, 120)]
MAX_TOKENS = 12


def run_engine(
    model_dir: Path,
    engine: dict,
    env: dict[str, str | None],
    prompts: list[list[int]] = PROMPTS,
    max_tokens: int = MAX_TOKENS,
    extra: dict | None = None,
) -> dict:
    request = {"model": str(model_dir), "engine": engine, "prompts": prompts, "max_tokens": max_tokens}
    request |= extra or {}
    child_env = dict(os.environ)
    for name, value in env.items():
        if value is None:
            child_env.pop(name, None)
        else:
            child_env[name] = value
    script = Path(__file__).with_name("generate_in_subprocess.py")
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(request)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


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
    result = run_engine(tiny_model_dir, {**ENGINE_KWARGS, "dtype": dtype}, env)
    assert result["platform"] == "NeuronPlatform"
    # Every warm-up graph lowered in this dtype too (the suite's engines use the stablehlo backend), each
    # KV cache written in place; --dump-graphs wrote them, named by call.
    dumped = sorted(tmp_path.glob("*.stablehlo.mlir"))
    assert len(dumped) == len(list(tmp_path.glob("*.fx.txt"))) == EXPECTED_GRAPHS
    assert dumped[0].name.startswith("000-prefill-of-")
    for path in dumped:
        writes = hlo_text.cache_writes(path.read_text())
        assert len(writes) == 2 and all(write.problems == [] for write in writes), (path.name, writes)
    float32 = generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))
    for half, full in zip(result["tokens"], float32, strict=True):
        assert len(half) == MAX_TOKENS
        # Rounding may flip a near tie later in the sequence, but the first token must agree.
        assert half[0] == full[0], (dtype, half, full)
