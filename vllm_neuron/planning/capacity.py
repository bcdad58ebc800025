"""What Trainium2 gives a model: weights and KV cache per tensor-parallel rank, the requests that fit, the
decode roofline, and an estimate of warm-up compile time. Pure arithmetic from published trn2 figures
(sources in docs/performance.md) and a model's figures: no device, no torch.

Tensor-parallel ranks are logical NeuronCores: neuronx-cc compiles for LNC=2 on trn2 by default, so two
physical cores sharing an HBM stack form one rank and a chip shows 4 of them. A decode call is bound by HBM
bandwidth (docs/performance.md): it reads every weight of the rank once and the KV of every row up to its
context bucket, and static shapes make it read the padded buckets, not the real batch and context:

    step_s = (weights per rank + batch bucket x context bucket x KV bytes per token per rank)
             / HBM bandwidth per rank
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_neuron.parallel import TensorParallelError, check_heads
from vllm_neuron.trn2 import (
    CHIP_BF16_FLOPS,
    RANK_HBM_BW,
    RANK_HBM_BYTES,
    RANKS_PER_CHIP,
    KVSettings,
    core_budget,
)

# neuronx-cc seconds per graph and model layer, low and high, plus a vocabulary-wide sampler's seconds per
# graph. aws-neuron-sdk issue 1210 (2025-08-07): a Llama-3.1-8B forward pass (32 layers) compiled in about 1
# minute at --optlevel=1 without an argmax, about 5 minutes eight months earlier, and about 22 minutes with an
# argmax over the vocabulary (an 800 MB decode NEFF against 40 MB for prefill). Every graph of the plugin ends
# in a vocabulary-wide sampler (vllm_neuron/sampling.py: a top-k in sorts of at most 16,384 elements, no
# argmax), so each pays it once: nothing if neuronx-cc compiles its sorts as native top-ks, 21 minutes if as
# slowly as 1210's argmax. neuronx-cc unrolls every layer, so
# the forward pass is taken to grow with the layers; prefill and decode graphs, bucket sizes and TP are not
# told apart. TorchNeuron compiles torch.compile graphs at -O2 unless told otherwise; Neuron mode sets
# NEURON_COMPILER_OPT_LEVEL=-O1 (1210's) where the user has not (vllm_neuron/device.py), so these are -O1's.
COMPILE_SECONDS_PER_LAYER = (60 / 32, 300 / 32)
SAMPLER_COMPILE_SECONDS = (0.0, 21 * 60.0)
COMPILE_BASIS = (
    "neuronx-cc, 1-5 minutes per graph of a 32-layer Llama-3.1-8B forward pass scaled by layers, plus 0-21 "
    "minutes for the vocabulary-wide sampler each graph ends in (aws-neuron-sdk issue 1210, 2025, at -O1); "
    "graphs compile one after another on each rank, ranks in parallel"
)


@dataclass(frozen=True)
class AdapterSlots:
    """LoRA adapter slots in device memory (--enable-lora), whole model and every slot: the bytes each rank
    holds whole, and those tensor parallelism splits across the ranks (B of column-parallel layers, A of
    row-parallel ones)."""

    slots: int  # --max-loras
    rank: int  # --max-lora-rank: every slot is padded to it
    whole_bytes: int
    split_bytes: int

    def bytes_per_rank(self, tp: int) -> float:
        return self.whole_bytes + self.split_bytes / tp

    def bytes_per_slot(self, tp: int = 1) -> float:
        return self.bytes_per_rank(tp) / self.slots


@dataclass(frozen=True)
class ModelFigures:
    """What the capacity model needs of a model: its size and the shape of its KV cache (whole model)."""

    name: str
    parameters: int
    weight_bytes: int  # parameters and buffers at the served dtype
    layers: int  # layers with a KV cache
    heads: int  # attention (query) heads
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    adapters: AdapterSlots | None = None  # counted with the weights: fixed device memory beside them

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """K and V of every layer for one token, on one rank. With more ranks than KV heads, vLLM replicates
        KV heads so that each rank holds one."""
        heads_per_rank = max(1, math.ceil(self.kv_heads / tp))
        return 2 * self.layers * heads_per_rank * self.head_dim * self.kv_dtype_bytes

    def weight_bytes_per_rank(self, tp: int) -> float:
        """The weights in an even split (the norms each rank repeats, and K/V projections replicated beyond
        TP = KV heads, are left out), and the adapter slots."""
        adapters = self.adapters.bytes_per_rank(tp) if self.adapters is not None else 0
        return self.weight_bytes / tp + adapters


@dataclass(frozen=True)
class RankCapacity:
    """One tensor-parallel size: what each rank holds, and the KV tokens the group can keep."""

    tp: int
    chips: int
    weight_bytes: float  # per rank
    kv_bytes_per_token: int  # per rank
    kv_tokens: int  # tokens whose KV each rank holds (its heads of them); 0: the rank's memory does not fit

    def requests(self, length: int) -> int:
        """Requests of `length` tokens whose KV fits at once."""
        return self.kv_tokens // length


def chips(tp: int) -> int:
    """Whole Trainium2 chips a tensor-parallel group occupies."""
    return math.ceil(tp / RANKS_PER_CHIP)


def rank_capacity(model: ModelFigures, tp: int, settings: KVSettings) -> RankCapacity:
    weights = model.weight_bytes_per_rank(tp)
    budget = core_budget(RANK_HBM_BYTES, weights, settings)
    per_token = model.kv_bytes_per_token(tp)
    return RankCapacity(
        tp=tp,
        chips=chips(tp),
        weight_bytes=weights,
        kv_bytes_per_token=per_token,
        kv_tokens=budget.kv_bytes // per_token if budget.fits else 0,
    )


def tensor_parallel_sizes(model: ModelFigures, max_ranks: int) -> list[int]:
    """Powers of two up to max_ranks that vLLM can shard the model's heads over."""
    sizes = []
    tp = 1
    while tp <= max_ranks:
        try:
            check_heads(model.heads, model.kv_heads, tp)
            sizes.append(tp)
        except TensorParallelError:
            pass
        tp *= 2
    return sizes


def step_seconds(model: ModelFigures, tp: int, batch_bucket: int, context_bucket: int) -> float:
    """One decode call of this bucket shape on the memory-bound roofline."""
    kv = batch_bucket * context_bucket * model.kv_bytes_per_token(tp)
    return (model.weight_bytes_per_rank(tp) + kv) / RANK_HBM_BW


def decode_tokens_per_s(
    model: ModelFigures, tp: int, rows: int, batch_bucket: int, context_bucket: int
) -> float:
    """Output tokens per second of decode calls with `rows` real rows padded to the batch bucket."""
    return rows / step_seconds(model, tp, batch_bucket, context_bucket)


def compute_bound_tokens_per_s(model: ModelFigures, tp: int) -> float:
    """The ceiling dense BF16 compute sets: 2 FLOPs per parameter and token, over the group's chips."""
    return CHIP_BF16_FLOPS * tp / RANKS_PER_CHIP / (2 * model.parameters)


@dataclass(frozen=True)
class Throughput:
    """Full decode calls of one bucket shape at one TP: rows are the batch bucket, or fewer where the KV of
    that many requests of the context does not fit."""

    tp: int
    batch_bucket: int
    context_bucket: int
    rows: int
    step_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.rows / self.step_seconds


def throughput(
    model: ModelFigures, capacity: RankCapacity, batch_bucket: int, context: int, context_bucket: int
) -> Throughput:
    """Decode at the batch bucket with requests of `context` tokens, which read `context_bucket` positions."""
    rows = min(batch_bucket, capacity.requests(context))
    seconds = step_seconds(model, capacity.tp, batch_bucket, context_bucket)
    return Throughput(capacity.tp, batch_bucket, context_bucket, rows, seconds)


def suggest_tensor_parallel(options: list[tuple[RankCapacity, Throughput]]) -> int | None:
    """The TP with the most decode tokens/s per chip (what a chip-hour buys), among those that hold at least
    one request: the smaller on a tie (the ratio repeats exactly wherever KV heads split evenly). None if no
    size holds one."""
    best: tuple[float, int] | None = None
    for capacity, rate in options:
        if rate.rows < 1:
            continue
        per_chip = rate.tokens_per_s / capacity.chips
        if best is None or per_chip > best[0] * (1 + 1e-9):
            best = (per_chip, capacity.tp)
    return best[1] if best else None


def compile_seconds(graphs: int, layers: int) -> tuple[float, float]:
    """Low and high estimates of warm-up's neuronx-cc time on trn2 (COMPILE_BASIS)."""
    (low, high), (sampler_low, sampler_high) = COMPILE_SECONDS_PER_LAYER, SAMPLER_COMPILE_SECONDS
    return graphs * (layers * low + sampler_low), graphs * (layers * high + sampler_high)
