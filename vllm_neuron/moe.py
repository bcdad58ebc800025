"""Mixture-of-experts routing and experts in plain torch that traces with fullgraph=True and static shapes.

No vLLM imports: this is the kernel, as kv_cache/ops.py is for attention; vllm_neuron/fused_moe.py plugs it
into vLLM's FusedMoE layer.

Layout (vLLM's unquantized FusedMoE weights, per tensor-parallel rank): w13 [experts, 2 * inter, hidden]
holds each expert's gate projection (rows :inter) then its up projection; w2 [experts, hidden, inter] its
down projection. With tensor parallelism `inter` is this rank's shard of the intermediate dimension, so the
result is this rank's partial sum, which vLLM's layer all-reduces.

The experts are computed densely: every token goes through every expert, and each expert's activation is
scaled by the token's routing weight for it, 0 where the expert was not selected. On Trainium that is two
static-shape matmuls for the TensorEngine (tokens x hidden by hidden x experts * 2 * inter, then one batched
over the experts, tokens x inter by inter x hidden) and no data-dependent shapes. The cost is experts / top_k
times the FLOPs of the selected experts (4x for 8 experts top-2, 16x for 128 experts top-8). The static-shape
alternatives: gathering each token's top_k experts' weights materialises tokens x top_k weight matrices
(cheaper for a few decode rows, prohibitive for a prefill chunk); grouping tokens by expert needs a
per-expert capacity, either the worst case (dense again) or smaller, which drops tokens (wrong tokens).
docs/lowering.md has the trade-off and the CPU cost.
"""

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's softmax top-k routing (its `topk_softmax` kernel): a float32 softmax over all experts, the
    top_k largest, renormalised to sum to 1 when asked (Mixtral, Qwen3-MoE) or kept as they are (Qwen2-MoE,
    OLMoE). Returns float32 weights and int64 expert ids, both [tokens, top_k]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_weights(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The routing weight of every expert for every token, [tokens, experts]: the token's weight for a
    selected expert, 0 for the others. A comparison with the expert index rather than a scatter: elementwise
    ops only."""
    experts = torch.arange(num_experts, device=ids.device)
    selected = ids.unsqueeze(-1) == experts  # [tokens, top_k, experts]
    return (selected * weights.unsqueeze(-1)).sum(dim=1)


def dense_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts' output for x [tokens, hidden]: sum over the selected experts e of
    weight(e) * w2[e] @ (silu(gate_e(x)) * up_e(x)), computed densely (see the module docstring)."""
    num_experts, _, inter = w2.shape
    tokens = x.shape[0]
    gate_up = torch.matmul(x, w13.reshape(-1, w13.shape[-1]).t()).view(tokens, num_experts, 2 * inter)
    gate, up = gate_up[..., :inter], gate_up[..., inter : 2 * inter]
    # The routing weight is applied before the down projection (it is linear); the down projections are one
    # batched matmul over the experts, then summed. (One matmul over experts * inter would need w2 laid out
    # [experts * inter, hidden]: a transposed copy of every expert's weights per call.)
    scale = expert_weights(weights, ids, num_experts).to(x.dtype).unsqueeze(-1)
    hidden = (F.silu(gate) * up * scale).transpose(0, 1)  # [experts, tokens, inter]
    return torch.matmul(hidden, w2.transpose(1, 2)).sum(dim=0)
