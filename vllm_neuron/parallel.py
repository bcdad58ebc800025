"""Tensor parallelism: start-up checks of the TP size, and which NeuronCores each rank's process may use.

vLLM shards the layers itself (--tensor-parallel-size) and its multiprocess executor starts one worker per
rank; what Trainium adds is that each rank's process must reserve only its own NeuronCore (the runtime
reserves every visible core for the first process that starts it), and that the TP size must fit the
cores this host or pod was given.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class TensorParallelError(ValueError):
    """A tensor-parallel configuration the plugin cannot serve; the message names the constraint."""


# Why Ray is refused rather than placed (docs/tensor-parallel.md).
RAY_REFUSAL = (
    "Ray is not supported (--distributed-executor-backend ray, --data-parallel-backend ray, or a Ray "
    "placement group around the engine): on one instance vLLM's multiprocessing executor already gives "
    "each rank its own NeuronCore, and across instances TorchNeuron's communicator needs MASTER_ADDR, "
    "which vLLM's Ray executor does not set (as with --nnodes); the image has no Ray. Use "
    "--distributed-executor-backend mp (the default) and --data-parallel-backend mp, and scale out with "
    "replicas behind a router (llm-d)"
)


def parse_cores(spec: str) -> list[int]:
    """NeuronCore indices of a NEURON_RT_VISIBLE_CORES value: "3", "0-7" or "0-3,8-11"."""
    cores: list[int] = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise TensorParallelError(
                f"NEURON_RT_VISIBLE_CORES={spec!r}: expected core indices or ranges such as 0-7"
            ) from None
        if first > last:
            raise TensorParallelError(f"NEURON_RT_VISIBLE_CORES={spec!r}: range {part} is descending")
        cores.extend(range(first, last + 1))
    return cores


def rank_core(visible: str | None, local_rank: int, local_world_size: int) -> int:
    """The NeuronCore of one rank: the local_rank-th of the cores this process was given (all cores, from
    index 0, when NEURON_RT_VISIBLE_CORES is unset)."""
    if not visible:
        return local_rank
    cores = parse_cores(visible)
    if len(cores) < local_world_size:
        raise TensorParallelError(
            f"{local_world_size} ranks on this node need {local_world_size} NeuronCores, but "
            f"NEURON_RT_VISIBLE_CORES={visible} gives {len(cores)}: lower --tensor-parallel-size or "
            "request more cores (Helm: tensorParallelSize sizes aws.amazon.com/neuroncore)"
        )
    return cores[local_rank]


def cpu_share(cpus: list[int], slot: int, slots: int) -> list[int]:
    """CPU mode: worker `slot`'s share of `cpus` when `slots` workers (data-parallel engines times their
    tensor-parallel ranks) share this host, as a NeuronCore is a worker's own on Trainium: an equal,
    contiguous share (neighbouring CPUs share caches), the first shares one smaller where they do not
    divide evenly."""
    if not 0 <= slot < slots <= len(cpus):
        raise TensorParallelError(
            f"{slots} workers on this host need a CPU each, but this process may use {len(cpus)}: lower "
            "--data-parallel-size or --tensor-parallel-size"
        )
    return cpus[slot * len(cpus) // slots : (slot + 1) * len(cpus) // slots]


def check_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """TP must split the query heads evenly; KV heads are either split evenly or, when there are fewer
    KV heads than ranks, replicated so that each rank holds one (vLLM's QKVParallelLinear does that)."""
    if num_heads % tp_size:
        raise TensorParallelError(
            f"--tensor-parallel-size {tp_size} must divide the model's {num_heads} attention heads; "
            f"use one of {_divisors(num_heads)}"
        )
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise TensorParallelError(
            f"--tensor-parallel-size {tp_size} must divide the model's {num_kv_heads} KV heads "
            f"(or be a multiple of it, to replicate them); use one of {_divisors(num_kv_heads)}"
        )
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise TensorParallelError(
            f"--tensor-parallel-size {tp_size} is above the model's {num_kv_heads} KV heads, so each KV "
            f"head is replicated: TP must then be a multiple of {num_kv_heads}"
        )


def check_fits_cores(world_size_on_node: int, visible_cores: int) -> None:
    if world_size_on_node > visible_cores:
        raise TensorParallelError(
            f"--tensor-parallel-size needs {world_size_on_node} NeuronCores on this node (one per rank) "
            f"but {visible_cores} are visible: lower --tensor-parallel-size, request more cores, or check "
            "NEURON_RT_VISIBLE_CORES"
        )


def check(vllm_config: "VllmConfig", visible_cores: int | None) -> None:
    """Start-up checks; visible_cores is None in CPU mode (any TP size runs there, one process per rank)."""
    parallel = vllm_config.parallel_config
    if parallel.nnodes > 1:
        raise TensorParallelError(
            f"--nnodes {parallel.nnodes}: a tensor-parallel group across instances is not supported yet. "
            "TorchNeuron builds its root communicator's address from MASTER_ADDR, which vLLM's executor does "
            "not set (each node would point at itself), and the image has no EFA; serve on one instance "
            "(a trn2.48xlarge has 64 ranks) and add replicas for throughput"
        )
    if parallel.use_ray or parallel.data_parallel_backend == "ray":
        raise TensorParallelError(RAY_REFUSAL)
    tp_size = parallel.tensor_parallel_size
    if tp_size > 1:
        model_config = vllm_config.model_config
        heads = model_config.model_arch_config.total_num_attention_heads
        check_heads(heads, model_config.get_total_num_kv_heads(), tp_size)
    if visible_cores is not None:
        check_fits_cores(parallel.local_world_size, visible_cores)


def _divisors(count: int) -> list[int]:
    return [size for size in range(1, count + 1) if count % size == 0]
