"""The CPU cost of the dense experts (vllm_neuron/moe.py) against a loop over the experts that computes only
the tokens each one was given (the FLOPs of the selected experts, with data-dependent shapes: what a
static-shape graph cannot do). One thread, CPU time of this process (best of several runs), so that other
processes on the host disturb the figures less.

    .venv/bin/python benchmarks/moe.py [--runs 7]
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_neuron import moe  # noqa: E402

# experts, top_k, hidden, intermediate: Mixtral's expert shape at a quarter of its hidden size, and a
# fine-grained MoE (many small experts, Qwen3-MoE / OLMoE style).
SHAPES = ((8, 2, 1024, 3584), (64, 8, 1024, 256))
TOKENS = (8, 64, 256)  # a decode batch, a prefill chunk, a large prefill bucket


def per_expert_loop(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for expert in range(w2.shape[0]):
        tokens, slots = torch.where(ids == expert)
        gate_up = x[tokens] @ w13[expert].t()
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, hidden @ w2[expert].t() * weights[tokens, slots, None])
    return out


def cpu_ms(fn: Callable[[], torch.Tensor], runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print("| experts | top_k | hidden | inter | tokens | dense ms | per-expert loop ms | dense / loop |")
    print("|---|---|---|---|---|---|---|---|")
    for experts, top_k, hidden, inter in SHAPES:
        w13 = torch.randn(experts, 2 * inter, hidden) * hidden**-0.5
        w2 = torch.randn(experts, hidden, inter) * inter**-0.5
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden)
            weights, ids = moe.route(torch.randn(tokens, experts), top_k, renormalize=True)
            torch.testing.assert_close(
                moe.dense_experts(x, w13, w2, weights, ids),
                per_expert_loop(x, w13, w2, weights, ids),
                rtol=1e-4,
                atol=1e-4,
            )
            dense = cpu_ms(lambda: moe.dense_experts(x, w13, w2, weights, ids), args.runs)  # noqa: B023
            loop = cpu_ms(lambda: per_expert_loop(x, w13, w2, weights, ids), args.runs)  # noqa: B023
            print(
                f"| {experts} | {top_k} | {hidden} | {inter} | {tokens} | {dense:.1f} | {loop:.1f} | "
                f"{dense / loop:.1f} |"
            )


if __name__ == "__main__":
    main()
