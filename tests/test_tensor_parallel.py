"""Tensor parallelism in CPU mode (gloo): vLLM's multiprocess executor, one worker process per rank, each
engine in its own process (tests/generate_in_subprocess.py), compared with the session's TP=1 engine."""

import json

import pytest

from tests.conftest import ENGINE_KWARGS, EXPECTED_GRAPHS, hf_greedy
from tests.serving import ServerProcess, http
from tests.test_engine import generate_ids, greedy
from tests.test_vllm_parity import MAX_TOKENS, PROMPTS, run_engine
from tests.tiny_model import build_tiny_llama

pytestmark = pytest.mark.slow

TP2 = {**ENGINE_KWARGS, "tensor_parallel_size": 2}
CPU_MODE = {"VLLM_NEURON_DEVICE": "cpu"}


def assert_every_rank_warm(result: dict, kv_heads_per_rank: int) -> None:
    stats = result["compile_stats"]
    assert [rank["rank"] for rank in stats] == [0, 1]
    for rank in stats:
        assert rank["graphs"] == EXPECTED_GRAPHS, rank
        assert rank["unexpected_recompiles"] == 0, rank
        # [K/V, kv_heads, blocks, block_size, head_size]: the cache is sharded (or replicated) by KV head.
        assert rank["kv_cache_shape"][1] == kv_heads_per_rank, rank


def test_tp2_equals_tp1_with_kv_heads_split(llm, hf_model, tiny_model_dir):
    """GQA with 2 KV heads: one KV head per rank."""
    result = run_engine(tiny_model_dir, TP2, CPU_MODE)
    tp2 = result["tokens"]
    assert tp2 == generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))
    assert tp2 == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    assert_every_rank_warm(result, kv_heads_per_rank=1)


def test_tp2_churn_compiles_nothing_on_any_rank(tiny_model_dir):
    result = run_engine(tiny_model_dir, TP2, CPU_MODE, prompts=PROMPTS[:1], extra={"churn_bursts": 4})
    churn = result["churn"]
    assert churn["finished"] + churn["cancelled"] == churn["requests"] and churn["blocks_freed"]
    assert_every_rank_warm(result, kv_heads_per_rank=1)


def test_tp2_replicates_a_single_kv_head(tmp_path):
    """One KV head, two ranks: vLLM replicates the head, so each rank caches it in full."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_llama(tmp_path / "mqa", num_kv_heads=1)
    result = run_engine(model_dir, TP2, CPU_MODE)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # TP=1 equals HF transformers (tests/test_engine.py); here TP=2 must equal both.
    assert result["tokens"] == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
    assert_every_rank_warm(result, kv_heads_per_rank=1)


def test_tp2_through_the_http_server(llm, tiny_model_dir, tmp_path):
    server = ServerProcess(tiny_model_dir, tmp_path / "server.log", "--tensor-parallel-size", "2")
    try:
        server.wait_healthy()
        status, info = http("GET", server.base + "/v1/neuron/info")
        assert status == 200 and json.loads(info)["tensor_parallel_size"] == 2, info
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}
        status, answer = http(
            "POST", server.base + "/v1/completions", json.dumps(body | {"ignore_eos": True}).encode()
        )
        assert status == 200, answer
        text = json.loads(answer)["choices"][0]["text"]
    finally:
        server.stop()
    expected = llm.generate("The quick brown fox", greedy(16), use_tqdm=False)[0].outputs[0].text
    assert text == expected
