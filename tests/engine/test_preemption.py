"""When the KV cache runs out, vLLM's scheduler preempts requests and recomputes them later; every request
still completes with exactly the tokens it produces alone."""

import pytest

from tests.conftest import ENGINE_KWARGS
from tests.helpers import hf_greedy, random_prompt, run_engine

pytestmark = pytest.mark.slow

BLOCK_BYTES = 2 * 32 * 2 * 32 * 4 * 2  # K and V, 32 tokens, 2 KV heads of 32, float32, 2 layers


def test_64_concurrent_requests_under_kv_pressure_match_running_alone(tiny_model_dir, hf_model):
    prompts = [random_prompt(10 + (37 * i) % 110, seed=500 + i) for i in range(64)]
    engine = {
        **ENGINE_KWARGS,
        "max_num_seqs": 16,
        "kv_cache_memory_bytes": 40 * BLOCK_BYTES,  # 40 blocks; 16 running requests want up to 80
        "additional_config": {
            "prefill_buckets": [32, 64],
            "decode_batch_buckets": [4, 16],
            "context_buckets": [128, 256],
            # Decode and mixed calls over context buckets of their own: 2 pages a row, always.
            "decode_context_buckets": [256],
        },
    }
    result = run_engine(tiny_model_dir, engine, {"VLLM_NEURON_DEVICE": "cpu"}, prompts=prompts, max_tokens=24)
    assert result["preemptions"] > 0
    # prefill 2 x 2 contexts, decode 2 x 1, mixed (a batch of 4) 1 x 1; nothing compiled while serving
    [stats] = result["compile_stats"]
    assert (stats["graphs"], stats["unexpected_recompiles"]) == (4 + 2 + 1, 0)
    assert result["tokens"] == [hf_greedy(hf_model, p, 24) for p in prompts]
