"""Trainium2's published figures per chip and per tensor-parallel rank (sources in docs/performance.md), and
the rule start-up divides a NeuronCore's memory by. Used by serving (worker/neuron_worker.py, the compiler's
per-graph estimate) and by the planning models (vllm_neuron/planning/capacity.py)."""

from dataclasses import dataclass

GIB = 2**30
# Trainium2 chip (AWS Neuron docs, Trainium2 architecture): 8 NeuronCore-v3, 96 GiB HBM, 2.9 TB/s, 667 dense
# BF16 TFLOPS. The per-rank shares divide the chip evenly; the docs give no separate per-core bandwidth.
CHIP_HBM_BYTES = 96 * GIB
CHIP_HBM_BW = 2.9e12
CHIP_BF16_FLOPS = 667e12
PHYSICAL_CORES_PER_CHIP = 8
LNC = 2
RANKS_PER_CHIP = PHYSICAL_CORES_PER_CHIP // LNC
RANK_HBM_BYTES = CHIP_HBM_BYTES // RANKS_PER_CHIP
RANK_HBM_BW = CHIP_HBM_BW / RANKS_PER_CHIP
# Device memory kept for compiled graphs where none of the configuration's graphs were lowered yet (derived
# otherwise: vllm_neuron/compiler/graph_memory.py). AWS's own plugin keeps 5 GiB cold.
COLD_GRAPH_RESERVE_BYTES = 4 * GIB
# neuronx-cc compiles a top-k of k at most this, and makes a sort that slices read a top-k with k its width
# (NCC_EVRF014; aws-neuron-sdk#1339): the sampler's top-k sorts chunks no wider.
SORT_LIMIT = 16384
# The option that makes neuronx-cc take float8_e4m3fn on trn1/trn2, reading its bits as trn2's e4m3
# (NCC_EVRF051; the format and its largest value, 240: kv_cache/fp8_format.py), in the form NxD Inference
# passes it (models/model_wrapper.py). TorchNeuron splits NEURON_CC_FLAGS on whitespace, with no shell: no
# quotes around it, and no other sub-option beside it.
FP8_COMPILER_OPTION = "--internal-hlo2tensorizer-options=--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


@dataclass(frozen=True)
class KVSettings:
    """The plugin's KV sizing on a NeuronCore (docs/configuration.md): VLLM_NEURON_KV_CACHE_FRACTION of the
    core's memory, if the weights, that and the graph reserve fit in --gpu-memory-utilization of it. The
    defaults are the plugin's and vLLM's (the graph reserve's where no graph was lowered yet)."""

    kv_cache_fraction: float = 0.3
    gpu_memory_utilization: float = 0.92
    graph_reserve_bytes: int = COLD_GRAPH_RESERVE_BYTES
    kv_cache_bytes: int | None = None  # --kv-cache-memory-bytes: this size instead of the share


@dataclass(frozen=True)
class CoreBudget:
    """One NeuronCore's memory as start-up divides it."""

    total: int
    weights: float
    kv_bytes: int
    reserve: int
    budget: int  # --gpu-memory-utilization of total

    @property
    def fits(self) -> bool:
        return self.weights + self.kv_bytes + self.reserve <= self.budget


def core_budget(total: int, weights: float, settings: KVSettings) -> CoreBudget:
    """The rule start-up checks (worker/neuron_worker.py) and the capacity model applies."""
    return CoreBudget(
        total=total,
        weights=weights,
        kv_bytes=settings.kv_cache_bytes or int(total * settings.kv_cache_fraction),
        reserve=settings.graph_reserve_bytes,
        budget=int(total * settings.gpu_memory_utilization),
    )
