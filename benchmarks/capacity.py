"""Trainium2 capacity model for docs/performance.md: decode roofline (tokens/s) and KV-cache capacity for
Llama-3.1-8B and 70B under tensor parallelism, from published trn2 figures and the models' configs.
Pure arithmetic, no device: `python benchmarks/capacity.py` prints the tables.

Model of one decode step (memory-bound, which decode at batch <= 32 is on trn2; see the doc):
  step_s = (weights per rank + batch_bucket * context_bucket * KV bytes per token per rank) / HBM B/W per rank
  tokens/s = real rows / step_s
Every compiled call reads the padded shape, so buckets, not the real batch and context, set the cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30
# Trainium2 chip (AWS Neuron docs, Trainium2 architecture): 8 NeuronCore-v3, 96 GiB HBM, 2.9 TB/s,
# 667 dense BF16 TFLOPS. neuronx-cc compiles for LNC=2 on trn2 by default: one logical core = 2 physical
# cores sharing an HBM stack, so a chip shows 4 logical cores and tensor-parallel ranks are logical cores.
CHIP_HBM_BYTES = 96 * GIB
CHIP_HBM_BW = 2.9e12
CHIP_BF16_FLOPS = 667e12
PHYSICAL_CORES_PER_CHIP = 8
LNC = 2
RANKS_PER_CHIP = PHYSICAL_CORES_PER_CHIP // LNC
# The plugin's KV sizing (docs/configuration.md, CPU mode and Neuron mode): a fixed share of the core's
# memory, if the weights, that and the graph reserve fit in utilization x memory.
KV_CACHE_FRACTION = 0.3  # VLLM_NEURON_KV_CACHE_FRACTION default
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
GRAPH_RESERVE_BYTES = 4 * GIB  # VLLM_NEURON_GRAPH_RESERVE_BYTES default
MAX_NUM_SEQS = 32  # vllm-neuron serve's default
BF16 = 2


@dataclass(frozen=True)
class Llama:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 128_256
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def parameters(self) -> int:
        kv = self.kv_heads * self.head_dim
        attention = self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden  # qkv, o
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        per_layer = attention + mlp + 2 * self.hidden  # two RMSNorms
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * per_layer + embeddings + self.hidden

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """K and V of every layer for one token, on one rank. With more ranks than KV heads, vLLM
        replicates KV heads so each rank holds at least one."""
        heads_per_rank = max(1, math.ceil(self.kv_heads / tp))
        return 2 * self.layers * heads_per_rank * self.head_dim * BF16


LLAMA_8B = Llama("Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14_336)
LLAMA_70B = Llama("Llama-3.1-70B", layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28_672)


def rank_memory(tp: int) -> tuple[float, float]:
    """HBM bytes and bandwidth of one tensor-parallel rank (one logical core)."""
    return CHIP_HBM_BYTES / RANKS_PER_CHIP, CHIP_HBM_BW / RANKS_PER_CHIP


def kv_tokens(model: Llama, tp: int) -> int:
    """KV tokens one rank holds; 0 where start-up would refuse the configuration (it does not fit)."""
    memory, _ = rank_memory(tp)
    weights = model.parameters * BF16 / tp
    kv_bytes = memory * KV_CACHE_FRACTION
    if weights + kv_bytes + GRAPH_RESERVE_BYTES > memory * GPU_MEMORY_UTILIZATION:
        return 0
    return int(kv_bytes // model.kv_bytes_per_token(tp))


def step_seconds(model: Llama, tp: int, batch_bucket: int, context_bucket: int) -> float:
    _, bandwidth = rank_memory(tp)
    weights = model.parameters * BF16 / tp
    kv = batch_bucket * context_bucket * model.kv_bytes_per_token(tp)
    return (weights + kv) / bandwidth


def compute_bound_tokens_s(model: Llama, tp: int) -> float:
    return CHIP_BF16_FLOPS * tp / RANKS_PER_CHIP / (2 * model.parameters)


def main() -> None:
    print("| model | parameters | bf16 weights | KV bytes per token (whole model) |")
    print("|---|---|---|---|")
    for model in (LLAMA_8B, LLAMA_70B):
        print(
            f"| {model.name} | {model.parameters / 1e9:.2f} B | {model.parameters * BF16 / 1e9:.1f} GB | "
            f"{model.kv_bytes_per_token():,} ({model.kv_bytes_per_token() / 1024:.0f} KiB) |"
        )
    print()
    header = "| model | TP | chips | weights / rank | KV / token / rank | KV tokens | "
    header += "requests of 8k / 32k / 128k | compute bound tok/s |"
    print(header)
    print("|---|---|---|---|---|---|---|---|")
    configs = [(LLAMA_8B, 4), (LLAMA_8B, 8), (LLAMA_70B, 16), (LLAMA_70B, 32), (LLAMA_70B, 64)]
    for model, tp in configs:
        tokens = kv_tokens(model, tp)
        fits = " / ".join(f"{tokens // length}" for length in (8192, 32768, 131072))
        print(
            f"| {model.name} | {tp} | {tp / RANKS_PER_CHIP:g} | "
            f"{model.parameters * BF16 / tp / GIB:.2f} GiB | "
            f"{model.kv_bytes_per_token(tp) / 1024:.0f} KiB | {tokens:,} | {fits} | "
            f"{compute_bound_tokens_s(model, tp):,.0f} |"
        )
    print()
    print("| model | TP | context bucket | batch 1 | batch 8 | batch 32 | step ms at batch 32 |")
    print("|---|---|---|---|---|---|---|")
    for model, tp in configs:
        for context in (512, 2048, 8192):
            rates = [batch / step_seconds(model, tp, batch, context) for batch in (1, 8, MAX_NUM_SEQS)]
            print(
                f"| {model.name} | {tp} | {context} | "
                + " | ".join(f"{rate:,.0f}" for rate in rates)
                + f" | {1e3 * step_seconds(model, tp, MAX_NUM_SEQS, context):.2f} |"
            )


if __name__ == "__main__":
    main()
