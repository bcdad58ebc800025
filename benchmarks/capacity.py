"""Trainium2 capacity model for docs/performance.md: decode roofline (tokens/s) and KV-cache capacity for
Llama-3.1-8B and 70B under tensor parallelism, from published trn2 figures and the models' configs.
Pure arithmetic, no device: `python benchmarks/capacity.py` prints the tables. The arithmetic is the
package's (vllm_neuron/planning/capacity.py, which `vllm-neuron check` uses for any model); this script gives
it the two models and the settings of the doc.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_neuron.planning import capacity  # noqa: E402
from vllm_neuron.planning.capacity import ModelFigures  # noqa: E402
from vllm_neuron.trn2 import GIB, KVSettings  # noqa: E402

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

    def figures(self) -> ModelFigures:
        """In bfloat16, weights only (the rotary table vLLM builds beside them is left out here)."""
        return ModelFigures(
            name=self.name,
            parameters=self.parameters,
            weight_bytes=self.parameters * BF16,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            kv_dtype_bytes=BF16,
        )


LLAMA_8B = Llama("Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14_336)
LLAMA_70B = Llama("Llama-3.1-70B", layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28_672)
SETTINGS = KVSettings()  # the plugin's defaults


def main() -> None:
    print("| model | parameters | bf16 weights | KV bytes per token (whole model) |")
    print("|---|---|---|---|")
    for model in (LLAMA_8B.figures(), LLAMA_70B.figures()):
        print(
            f"| {model.name} | {model.parameters / 1e9:.2f} B | {model.weight_bytes / 1e9:.1f} GB | "
            f"{model.kv_bytes_per_token():,} ({model.kv_bytes_per_token() / 1024:.0f} KiB) |"
        )
    print()
    header = "| model | TP | chips | weights / rank | KV / token / rank | KV tokens | "
    header += "requests of 8k / 32k / 128k | compute bound tok/s |"
    print(header)
    print("|---|---|---|---|---|---|---|---|")
    configs = [(LLAMA_8B, 4), (LLAMA_8B, 8), (LLAMA_70B, 16), (LLAMA_70B, 32), (LLAMA_70B, 64)]
    for llama, tp in configs:
        model = llama.figures()
        rank = capacity.rank_capacity(model, tp, SETTINGS)
        fits = " / ".join(f"{rank.requests(length)}" for length in (8192, 32768, 131072))
        print(
            f"| {model.name} | {tp} | {rank.chips} | {rank.weight_bytes / GIB:.2f} GiB | "
            f"{rank.kv_bytes_per_token / 1024:.0f} KiB | {rank.kv_tokens:,} | {fits} | "
            f"{capacity.compute_bound_tokens_per_s(model, tp):,.0f} |"
        )
    print()
    print("| model | TP | context bucket | batch 1 | batch 8 | batch 32 | step ms at batch 32 |")
    print("|---|---|---|---|---|---|---|")
    for llama, tp in configs:
        model = llama.figures()
        for context in (512, 2048, 8192):
            rates = [capacity.decode_tokens_per_s(model, tp, b, b, context) for b in (1, 8, MAX_NUM_SEQS)]
            print(
                f"| {model.name} | {tp} | {context} | "
                + " | ".join(f"{rate:,.0f}" for rate in rates)
                + f" | {1e3 * capacity.step_seconds(model, tp, MAX_NUM_SEQS, context):.2f} |"
            )


if __name__ == "__main__":
    main()
