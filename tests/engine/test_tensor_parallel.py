"""Tensor parallelism in CPU mode (gloo): vLLM's multiprocess executor, one worker process per rank. TP=2
greedy tokens equal TP=1 (the session's engine) and HF transformers, through the engine (in its own
process: tests/generate_in_subprocess.py) with KV heads split, and through the HTTP server with a KV head
replicated; no rank compiles after warm-up under churn."""

import json

import pytest

from tests.conftest import FEW_BUCKETS_ENGINE, FEW_BUCKETS_GRAPHS
from tests.environment import TENSOR_PARALLEL_ENVIRONMENT
from tests.helpers import MAX_TOKENS, PROMPTS, generate_ids, greedy, hf_greedy, run_engine
from tests.serving import ServerProcess, http
from tests.tiny_model import build_tiny_llama

pytestmark = pytest.mark.slow

# One graph per phase: greedy tokens do not depend on the buckets, and strict shapes fail a recompile in any.
TP2 = {**FEW_BUCKETS_ENGINE, "tensor_parallel_size": 2}
CPU_MODE = TENSOR_PARALLEL_ENVIRONMENT


def assert_every_rank_warm(result: dict, kv_heads_per_rank: int) -> None:
    stats = result["compile_stats"]
    assert [rank["rank"] for rank in stats] == [0, 1]
    for rank in stats:
        assert rank["graphs"] == FEW_BUCKETS_GRAPHS, rank
        assert rank["unexpected_recompiles"] == 0, rank
        # [2 * kv_heads, blocks, block_size, head_size]: the cache is sharded (or replicated) by KV head.
        assert rank["kv_cache_shape"][0] == 2 * kv_heads_per_rank, rank
        # Each rank's graphs lowered (stablehlo backend), each with its collectives: two all-reduces per
        # layer (2 layers) and the gather of the logits.
        assert rank["lowered_graphs"] == FEW_BUCKETS_GRAPHS, rank
        assert all(count >= 2 * 2 for count in rank["collectives_per_graph"]), rank


def test_tp2_equals_tp1_with_kv_heads_split_and_churn_compiles_nothing(llm, hf_model, tiny_model_dir):
    """Through the engine, GQA with 2 KV heads: one KV head per rank. Then the churn workload of
    tests/engine/test_churn.py (strict shapes: a recompile on any rank would fail the engine)."""
    result = run_engine(tiny_model_dir, TP2, CPU_MODE, extra={"churn_bursts": 4})
    tp2 = result["tokens"]
    assert tp2 == generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))
    assert tp2 == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    churn = result["churn"]
    assert churn["finished"] + churn["cancelled"] == churn["requests"] and churn["blocks_freed"]
    assert_every_rank_warm(result, kv_heads_per_rank=1)


def test_tp2_through_the_http_server_replicates_a_single_kv_head(tmp_path):
    """Through `vllm-neuron serve`, one KV head and two ranks: vLLM replicates the head, so each rank caches
    it in full. TP=1 equals HF transformers (tests/engine/test_engine.py); TP=2 must equal it too."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_llama(tmp_path / "mqa", num_kv_heads=1)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
    # One bucket of each kind: the ranks' graphs of every phase, in a third of the test plan's warm-up.
    small = {"prefill_buckets": [64], "decode_batch_buckets": [2], "context_buckets": [256]}
    server = ServerProcess(
        model_dir,
        tmp_path / "server.log",
        "--tensor-parallel-size",
        "2",
        "--additional-config",
        json.dumps(small),
        env=CPU_MODE,
    )
    try:
        server.wait_healthy()
        status, info = http("GET", server.base + "/v1/neuron/info")
        assert status == 200 and json.loads(info)["tensor_parallel_size"] == 2, info
        got = []
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            body |= {"ignore_eos": True, "return_token_ids": True}
            status, answer = http("POST", server.base + "/v1/completions", json.dumps(body).encode())
            assert status == 200, answer
            got.append(json.loads(answer)["choices"][0]["token_ids"])
    finally:
        server.stop()
    assert got == expected
    # Every rank warmed up every bucket (and strict shapes would have failed a request on a recompile).
    assert server.log().count("Warm-up compiled 3 graphs") == 2
