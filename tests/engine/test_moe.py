"""Mixture-of-experts layers (vllm_neuron/moe.py, vllm_neuron/fused_moe.py): the dense experts against a
per-token loop over the selected experts, their lowering to StableHLO, what is refused, and tensor
parallelism. The MoE architectures served end to end, equal to HF transformers, are cases of the
architecture matrix (tests/model_matrix.py: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.architectures import ARCHITECTURES, build
from tests.environment import TENSOR_PARALLEL_ENVIRONMENT
from tests.helpers import MAX_TOKENS, PROMPTS, engine_config, hf_greedy, run_engine
from vllm_neuron import moe
from vllm_neuron.compiler.stablehlo import StableHLOBackend

TOKENS, HIDDEN, EXPERTS, INTER, TOP_K = 7, 8, 4, 5, 2
IDLE = 3  # the expert no token selects in the "idle expert" case


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    return x, w13, w2


def router_logits(case: str) -> torch.Tensor:
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(1))
    if case == "idle expert":
        # Every other expert's logit is above the idle one's, so top-2 never picks it; its probability is
        # still far from 0, so an expert computed but not masked out would change the output.
        logits = 1.0 + logits.abs()
        logits[:, IDLE] = 0.5
    return logits


def per_token_loop(x, w13, w2, logits, top_k: int, renormalize: bool) -> torch.Tensor:
    """HF transformers' MoE block, one token and one selected expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t], dim=-1)
        chosen = sorted(range(EXPERTS), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        for e in chosen:
            gate, up = w13[e, :INTER] @ x[t], w13[e, INTER:] @ x[t]
            out[t] += probs[e] / total * (w2[e] @ (F.silu(gate) * up))
    return out


def routed(x, w13, w2, logits, renormalize: bool) -> torch.Tensor:
    routing_weights, ids = moe.route(logits, TOP_K, renormalize)
    return moe.dense_experts(x, w13, w2, routing_weights, ids)


@pytest.mark.parametrize("case", ["random", "idle expert"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalised", "not renormalised"])
def test_dense_experts_equal_a_per_token_loop(case, renormalize):
    x, w13, w2 = weights()
    logits = router_logits(case)
    _, ids = moe.route(logits, TOP_K, renormalize)
    assert (IDLE in ids) == (case == "random")
    expected = per_token_loop(x, w13, w2, logits, TOP_K, renormalize)
    torch.testing.assert_close(routed(x, w13, w2, logits, renormalize), expected)


def test_routing_weights_are_the_selected_softmax_probabilities():
    logits = router_logits("random")
    probs = torch.softmax(logits, dim=-1)
    for renormalize in (True, False):
        routing_weights, ids = moe.route(logits, TOP_K, renormalize)
        dense = moe.expert_weights(routing_weights, ids, EXPERTS)
        assert ((dense > 0).sum(dim=-1) == TOP_K).all()
        kept = torch.where(dense > 0, probs, 0.0)
        torch.testing.assert_close(dense, kept / kept.sum(-1, keepdim=True) if renormalize else kept)


def test_the_experts_lower_to_two_matmuls_without_gathers_or_scatters():
    """Routing and experts through TorchNeuron's route (the stablehlo backend), static shapes: the
    TensorEngine work is the two dense matmuls, and nothing indexes by expert id."""
    backend = StableHLOBackend()
    x, w13, w2 = weights()
    logits = router_logits("random")
    out = torch.compile(routed, backend=backend, fullgraph=True, dynamic=False)(x, w13, w2, logits, True)
    (graph,) = backend.graphs
    assert graph.op_histogram["stablehlo.dot_general"] == 2
    assert not {"stablehlo.gather", "stablehlo.scatter"} & graph.op_histogram.keys()
    # The router's top-k: a sort of the experts and a slice, which neuronx-cc makes its top-k (k = the
    # experts, within its limit: the rules hold) and XLA's preparation a chlo.top_k.
    assert graph.op_histogram["stablehlo.sort"] == 1 and graph.broken_rules == []
    assert graph.xla_stablehlo.count("chlo.top_k") == 1
    torch.testing.assert_close(out, routed(x, w13, w2, logits, True))


def architecture(name: str):
    return next(arch for arch in ARCHITECTURES if arch.name == name)


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            dict(quantization="fp8", dtype="bfloat16"),
            "quantized MoE models are not supported \\(fp8",
        ),
        (dict(enable_return_routed_experts=True), "returning routed experts is not supported"),
        (dict(data_parallel_size=2), "data parallelism with an MoE model is not supported"),
        (dict(enable_expert_parallel=True), "expert parallelism is not supported"),
    ],
    ids=["quantized experts", "routed experts returned", "data parallel", "expert parallel"],
)
def test_moe_settings_the_plugin_cannot_serve_are_refused_at_start_up(tmp_path, settings, message):
    model_dir = build(architecture("Mixtral"), tmp_path / "mixtral")
    with pytest.raises(ValueError, match=message):
        engine_config(model_dir, **settings)


# Two graphs per rank: one prefill bucket, one decode bucket, one context bucket.
ENGINE = dict(
    dtype="float32",
    max_model_len=256,
    max_num_seqs=2,
    max_num_batched_tokens=64,
    seed=0,
    additional_config={"prefill_buckets": [64], "decode_batch_buckets": [2], "context_buckets": [256]},
)


def build_llama4_text(out: Path) -> Path:
    """Llama 4's text model: sigmoid top-1 routing (a custom routing function) applied to the experts'
    input, which the plugin's experts do not compute (its chunked local attention, refused before, off)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(out)
    config = AutoConfig.for_model(
        "llama4_text",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        attention_chunk_size=None,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.slow
def test_an_moe_layer_the_experts_do_not_compute_is_refused_naming_it(tmp_path):
    model_dir = build_llama4_text(tmp_path / "llama4")
    request = {"model": str(model_dir), "engine": ENGINE, "prompts": [[1]], "max_tokens": 1}
    script = Path(__file__).parents[1] / "generate_in_subprocess.py"
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(request)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode != 0
    assert (
        "Neuron plugin: MoE layer model.layers.0.feed_forward.experts: CustomRoutingRouter routing is not "
        "supported" in done.stderr
    ), done.stderr[-3000:]
    assert "router weights applied to the experts' input are not supported" in done.stderr


@pytest.mark.slow
def test_tp2_shards_the_experts_and_equals_hf(tmp_path):
    """Tensor parallelism as vLLM's FusedMoE does it: each rank holds every expert's shard of the
    intermediate dimension and the layer all-reduces the partial sums; Qwen2-MoE's gated shared expert,
    sharded the same way, joins that all-reduce."""
    from transformers import AutoModelForCausalLM

    model_dir = build(architecture("Qwen2-MoE"), tmp_path / "qwen2-moe")
    result = run_engine(model_dir, ENGINE | {"tensor_parallel_size": 2}, TENSOR_PARALLEL_ENVIRONMENT)
    reference = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert result["tokens"] == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
    for rank in result["compile_stats"]:
        assert rank["lowered_graphs"] == rank["graphs"] == 2 and rank["unexpected_recompiles"] == 0, rank
        # Per graph: the embedding's all-reduce; per layer, the attention output's and the MoE layer's (2
        # layers); the logits' gather.
        assert rank["collectives_per_graph"] == [1 + 2 * 2 + 1] * 2, rank
