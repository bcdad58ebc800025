"""Mixture-of-experts routing and experts (vllm_neuron/moe.py): the dense experts against a per-token loop
over the selected experts, and their lowering to StableHLO."""

import pytest
import torch
import torch.nn.functional as F

from vllm_neuron import moe
from vllm_neuron.stablehlo import StableHLOBackend

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
    torch.testing.assert_close(out, routed(x, w13, w2, logits, True))
