"""A stand-in for TorchNeuron (`torch_neuronx`, `torch.neuron`) that enforces the Neuron runtime's start-up
rules, so that an engine started with VLLM_NEURON_DEVICE=neuron on a host without Trainium fails where the
plugin would break them on Trainium.

Use: put tests/fake_neuron on the PYTHONPATH of an engine process (tests/engine/test_neuron_startup.py does).

The seam: tensors stay on the host. Python alone cannot give a torch device memory, so on import this module
sets `vllm_neuron.device.TENSOR_DEVICE_TYPE = "cpu"` (documented there); everything else runs the plugin's
Neuron mode: the `neuron` compile backend and process group, NeuronCore pinning, memory answers from
`torch.neuron`. The plugin asks for `torch_neuronx` only where a Neuron device is requested or present.

The runtime starts at the first device use. Here that is: creating the `neuron` process group (TorchNeuron's
group starts it itself), a memory query, a synchronize, or a compile. The rules, each raising
FakeNeuronRuleError:
(a) TORCH_NEURONX_NEFF_CACHE_DIR is read once, when the runtime starts: a compile that finds another value
    fails (TorchNeuron would keep writing NEFFs to the folder it read first);
(b) the `neuron` process group must be created before the runtime starts;
(c) in a process group each process sees one NeuronCore: NEURON_RT_VISIBLE_CORES names one core when the
    runtime starts (set to LOCAL_RANK where unset, as TorchNeuron does);
(d) memory statistics may be 0: memory_reserved and memory_allocated answer 0, total memory is
    FAKE_NEURON_TOTAL_MEMORY bytes (default 24 GiB, one trn2 logical core; 0 models a runtime that answers 0),
    and there is no mem_get_info (TorchNeuron has none);
(e) in a process group, memory queries take indices as TorchNeuron passes them: get_device_properties hands
    PyTorch's index to the runtime unmapped (nrt_get_vnc_memory_stats numbers the process's one visible core
    0), so any index but 0 answers 0 bytes; memory_allocated reads the allocator of PyTorch's device (the
    local rank), so another index answers 0 for a device the process never used. Both raise here.
(h) the root communicator: unless NEURON_RT_ROOT_COMM_ID is set, the first process group sets it to
    MASTER_ADDR (default localhost) and a free port that rank 0 picks and shares through the group's store,
    as TorchNeuron does. Raised where the group spans nodes (more ranks than LOCAL_WORLD_SIZE) and the
    address is a loopback one: each node's root communicator would point at itself. (The plugin refuses
    --nnodes > 1 at start-up, so a served engine only records it.)
Modelled and recorded, not raised:
(f) copying a non-contiguous device tensor to the host makes TorchNeuron run an eager kernel that makes it
    contiguous on the device first, compiled by neuronx-cc per shape (cast_policy.py, contiguous_internal):
    seconds on the first request of each shape. `vllm_neuron.device.to_host` is where the plugin's device
    tensors reach the host (the seam); the fake wraps it and records each new shape as an eager compile;
(g) synchronize waits for the device: each call is recorded with its thread;
(i) each host-to-device copy is a runtime transfer of its own, and each device-to-host copy waits for the
    tensor's producers: `vllm_neuron.device.copy_to_device`, `to_host` and `start_read` (the seams) are
    counted per thread, and so are the compiled graphs' runs, so that a test can bound transfers per call and
    find a token's round trip through the host between two steps;
(j) a blocking host-to-device copy is a synchronize: TorchNeuron's copy_cpu_to_neuron waits until the
    stream is idle after the write unless the copy is non-blocking or of one element
    (csrc/utils/CopyUtils.cpp), and every thread's current stream is the device's default one
    (c10/neuron/NeuronStream.cpp). The fake watches the torch calls
    `copy_to_device` makes (`Tensor.copy_` / `Tensor.to` and their non_blocking) and counts each blocking one
    as a synchronize of the calling thread, and apart as `blocking_to_device`;
(k) an eager op on a device tensor (outside compiled graphs: `fill_`, `zero_`, `index_put_`, `copy_` between
    device tensors, `__setitem__`/`__getitem__` with tensor indices or a scalar) runs a kernel neuronx-cc
    compiles once per new input shapes and dtypes: each new one is recorded (`eager_kernels`: op, shapes,
    dtypes, static arguments, thread). A host tensor copied into a contiguous device tensor (any storage
    offset) is a runtime write, not a kernel (rule (i));
(l) a write into a non-contiguous device view copies the whole storage to the host and back, blocking, unless
    the view permutes the whole storage (a compiled transpose, rule (k)): each is recorded
    (`host_round_trips`: op, shape, stride, storage offset, dtype, the storage's bytes, thread), and so is a
    device tensor read to the host past the to_host seam (`host_reads`: `copy_` into a host tensor, `cpu`,
    `tolist`, `item`, `bool`, `int`, `float`), each blocking one a synchronize (g); `numpy()` of a device
    tensor raises, as torch does on Trainium. Device tensors are those a compiled graph read or wrote
    (eager_ops.py says how they are told apart, and what TorchNeuron runs for each op);
(m) a blocking read to the host waits until the stream is idle, work other threads queued after the tensor's
    producer included: `to_host` is also counted as a synchronize of the calling thread (g). `start_read`
    queues a read without waiting: its host tensor holds a value no output has until a `torch.neuron.Event`
    recorded after the read has been queried or synchronized (`event_waits`, per thread; streams.py).

Other settings: FAKE_NEURON_CORES (NeuronCores of the host, default 2). What the fake saw is written as JSON
to FAKE_NEURON_RECORD (when set; where it is a folder, to <pid>.json in it, a file per process: tensor
parallelism runs a worker process per rank) after every event: the process id and, once the process group
exists, the local rank; what started the runtime, the NEFF cache folder and the visible cores it read then,
whether the process group came first, the root communicator's address (h), each memory query with its
index (e), per compile whether fallback to eager execution was disabled
(TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1), NEURON_CC_FLAGS and NEURON_COMPILER_OPT_LEVEL as the compile
read them (None: unset) and its NEFF, the eager compiles (f), the synchronize calls per thread (g, j, m),
the transfers, reads started and graph runs per thread (i), the event waits (m), the eager kernels (k), and
the host round trips and reads (l). The `neuron` compile backend runs TorchNeuron's stages up to StableHLO
as its source writes them (neuron_dynamo_backend.py), writes that StableHLO as the graph's .neff file into the
cache folder, records the inputs its executor binds in place (`mutated_inputs`), and runs the graph on the
host.
"""

import hashlib
import ipaddress
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

NEFF_CACHE_VARIABLE = "TORCH_NEURONX_NEFF_CACHE_DIR"
DEFAULT_NEFF_CACHE = "/tmp/neff_cache"
FALLBACK_VARIABLE = "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"
ROOT_PORT_KEY = "neuron_root_comm_port"
COMPILER_VARIABLES = ("NEURON_CC_FLAGS", "NEURON_COMPILER_OPT_LEVEL")  # what TorchNeuron hands neuronx-cc


class FakeNeuronRuleError(RuntimeError):
    """The plugin did something the Neuron runtime refuses or silently ignores."""


def _cores(spec: str) -> list[int]:
    cores: list[int] = []
    for part in spec.split(","):
        low, _, high = part.strip().partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


class Runtime:
    """The state of this process's (fake) Neuron runtime."""

    def __init__(self) -> None:
        self.started_by: str | None = None
        self.lock = threading.Lock()  # the device thread and the engine's record events at once
        self.facts: dict[str, Any] = {
            "compiles": [],
            "process_group_before_runtime": False,
            "eager_compiles": [],
            "memory_queries": [],
            "synchronize": {},
            "to_device": {},
            "blocking_to_device": {},
            "to_host": {},
            "reads_started": {},
            "event_waits": {},
            "graph_runs": {},
        }

    def start(self, trigger: str) -> None:
        """The first device use starts the runtime, which reads its settings once."""
        if self.started_by is not None:
            return
        self.started_by = trigger
        visible = os.environ.get("NEURON_RT_VISIBLE_CORES")
        self.facts.update(
            runtime_started_by=trigger,
            neff_cache_dir_at_start=os.environ.get(NEFF_CACHE_VARIABLE, DEFAULT_NEFF_CACHE),
            visible_cores_at_start=visible,
        )
        self.record()

    def create_process_group(self, rank: int, size: int = 1, store: dist.Store | None = None) -> None:
        """TorchNeuron's first `neuron` process group pins the process to one core, sets the root
        communicator's address (rule (h)) and starts the runtime."""
        if self.started_by is not None:
            raise FakeNeuronRuleError(
                f"the neuron process group was created after the Neuron runtime started ({self.started_by}): "
                "TorchNeuron refuses a runtime started before init_process_group"
            )
        self.set_root_comm_id(rank, size, store)
        if not os.environ.get("NEURON_RT_VISIBLE_CORES"):
            os.environ["NEURON_RT_VISIBLE_CORES"] = os.environ.get("LOCAL_RANK", str(rank))
        visible = os.environ["NEURON_RT_VISIBLE_CORES"]
        if len(_cores(visible)) != 1:
            raise FakeNeuronRuleError(
                f"NEURON_RT_VISIBLE_CORES={visible} when the neuron process group started the runtime: in a "
                "process group each process may see one NeuronCore"
            )
        self.facts["process_group_before_runtime"] = True
        self.facts["local_rank"] = int(os.environ.get("LOCAL_RANK", rank))
        self.start("process group")

    def set_root_comm_id(self, rank: int, size: int, store: dist.Store | None) -> None:
        """Rule (h), TorchNeuron's `_set_root_comm_id`: unless NEURON_RT_ROOT_COMM_ID is set, rank 0 picks a
        free port and shares it through the group's store, and every rank sets
        NEURON_RT_ROOT_COMM_ID=MASTER_ADDR (default localhost):port. Across nodes (a group larger than
        LOCAL_WORLD_SIZE) a loopback address points each node's root communicator at itself."""
        if os.environ.get("NEURON_RT_ROOT_COMM_ID") is None:
            if store is None or rank == 0:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", 0))
                    port = str(probe.getsockname()[1])
                if store is not None:
                    store.set(ROOT_PORT_KEY, port)
            else:
                port = store.get(ROOT_PORT_KEY).decode()
            address = os.environ.get("MASTER_ADDR", "localhost")
            os.environ["NEURON_RT_ROOT_COMM_ID"] = f"{address}:{port}"
        root = os.environ["NEURON_RT_ROOT_COMM_ID"]
        self.facts["root_comm_id"] = root
        host = root.rpartition(":")[0].strip("[]")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        if size > local and (host == "localhost" or ipaddress.ip_address(host).is_loopback):
            raise FakeNeuronRuleError(
                f"NEURON_RT_ROOT_COMM_ID={root} in a process group of {size} ranks, {local} on this node: "
                "the other nodes' root communicators would point at themselves (set MASTER_ADDR to rank 0's "
                "node address before the process group)"
            )

    def check_neff_cache_dir(self) -> str:
        """Rule (a): the folder read at start-up is the one NEFFs go to; a later change has no effect."""
        read = self.facts["neff_cache_dir_at_start"]
        now = os.environ.get(NEFF_CACHE_VARIABLE, DEFAULT_NEFF_CACHE)
        if now != read:
            raise FakeNeuronRuleError(
                f"{NEFF_CACHE_VARIABLE}={now} at compile time, but the Neuron runtime read {read} when it "
                f"started ({self.started_by}): NEFFs would go to {read}. Set it before any device use."
            )
        return read

    def compile(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """TorchNeuron's stages up to StableHLO (neuron_dynamo_backend.py); the fake NEFF holds the StableHLO
        neuronx-cc would get, and the graph runs on the host. A NEFF writes each output into a dense tensor
        of its own, so the outputs are contiguous (the FX graph on the host may return a view)."""
        from torch_neuronx import neuron_dynamo_backend

        self.start("compile")
        folder = Path(self.check_neff_cache_dir())
        compiled, graphs = neuron_dynamo_backend.compile_graph(graph, example_inputs)
        for lowered in graphs:
            digest = hashlib.sha256(lowered.stablehlo.encode()).hexdigest()
            neff = folder / digest[:2] / digest[2:4] / f"{digest}.neff"
            neff.parent.mkdir(parents=True, exist_ok=True)
            neff.write_text(lowered.stablehlo)
            self.facts["compiles"].append(
                {
                    "fallback_disabled": os.environ.get(FALLBACK_VARIABLE) == "1",
                    "neff": str(neff),
                    "mutated_inputs": [parameter for parameter, _ in lowered.mutation_info.aliases],
                    **{name: os.environ.get(name) for name in COMPILER_VARIABLES},
                }
            )
        self.record()

        def run(*args: Any) -> Any:
            self.count("graph_runs")
            outputs = compiled(*args)
            return type(outputs)(o.contiguous() if isinstance(o, torch.Tensor) else o for o in outputs)

        run.__dict__.update(compiled.__dict__)  # the calling convention dynamo reads from the function
        return run

    def copy_to_host(self, tensor: torch.Tensor) -> None:
        """Rule (f): a non-contiguous tensor is made contiguous on the device first, by an eager kernel
        compiled once per shape."""
        if tensor.is_contiguous():
            return
        shape = {"shape": list(tensor.shape), "stride": list(tensor.stride()), "dtype": str(tensor.dtype)}
        if shape not in self.facts["eager_compiles"]:
            self.facts["eager_compiles"].append(shape)
            self.record()

    def synchronize(self) -> None:
        """Rule (g): who waited for the device."""
        self.start("synchronize")
        self.count("synchronize")

    def count(self, event: str) -> None:
        """Rules (g) and (i): an event, counted per thread."""
        thread = threading.current_thread().name
        with self.lock:
            self.facts[event][thread] = self.facts[event].get(thread, 0) + 1
        self.record()

    def check_memory_index(self, query: str, index: int | None) -> None:
        """Rule (e)."""
        asked = {"query": query, "index": index}
        if asked not in self.facts["memory_queries"]:
            self.facts["memory_queries"].append(asked)
            self.record()
        own = self.facts.get("local_rank")
        if own is None:
            return
        if query == "get_device_properties" and index not in (None, 0):
            raise FakeNeuronRuleError(
                f"get_device_properties({index}) in the process of local rank {own}: TorchNeuron passes "
                "the index to nrt_get_vnc_memory_stats unmapped, and the process's one NeuronCore is VNC 0 "
                "there: the runtime answers total_memory=0"
            )
        if query == "memory_allocated" and index not in (None, own):
            raise FakeNeuronRuleError(
                f"memory_allocated({index}) in the process of local rank {own}: the allocator's statistics "
                f"of device {index}, which this process never uses, are 0 (its device is {own}, the current "
                "one)"
            )

    def record(self) -> None:
        """To FAKE_NEURON_RECORD; where that is a folder (tensor parallelism: a process per rank), to a file
        of this process's own in it, <pid>.json."""
        path = os.environ.get("FAKE_NEURON_RECORD")
        if not path:
            return
        target = Path(path)
        if target.is_dir():
            target = target / f"{os.getpid()}.json"
        with self.lock:
            target.write_text(json.dumps({**self.facts, "pid": os.getpid()}))


runtime = Runtime()


def device_count() -> int:
    if runtime.facts["process_group_before_runtime"]:
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    visible = os.environ.get("NEURON_RT_VISIBLE_CORES")
    return len(_cores(visible)) if visible else int(os.environ.get("FAKE_NEURON_CORES", 2))


def _process_group(store: dist.Store, rank: int, size: int, timeout: Any) -> dist.ProcessGroup:
    if not runtime.facts["process_group_before_runtime"]:
        runtime.create_process_group(rank, size, store)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _neuron_backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return runtime.compile(graph, example_inputs)


class HostToDeviceCopies(TorchFunctionMode):
    """Rule (j): the copies a host-to-device seam makes, and how many of them wait. TorchNeuron's
    copy_cpu_to_neuron synchronizes the stream after a write unless it is non-blocking
    (csrc/utils/CopyUtils.cpp)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocking = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            source, waits = args[1], not kwargs.get("non_blocking", len(args) > 2 and args[2])
        elif func is torch.Tensor.to:  # to(device, dtype, non_blocking, copy): its first bool
            flags = [arg for arg in args[1:] if isinstance(arg, bool)]
            source, waits = args[0], not kwargs.get("non_blocking", bool(flags and flags[0]))
        else:
            return func(*args, **kwargs)
        # A one-element source takes the bounce buffer, blocking or not (CopyUtils.cpp).
        self.blocking += waits and source.numel() != 1
        return func(*args, **kwargs)


def _register() -> None:
    from torch._dynamo import register_backend

    from torch_neuronx import neuron, streams

    register_backend(_neuron_backend, name="neuron")
    # Tensors are host tensors, so the group serves the cpu device (gloo underneath).
    dist.Backend.register_backend("neuron", _process_group, devices=["cpu"])
    # TorchNeuron also renames PrivateUse1 to "neuron"; without its C++ hooks that would make torch (and
    # dynamo) expect an accelerator it cannot reach, so only the module is registered.
    torch.neuron = neuron
    # TorchNeuron is torch's accelerator; vLLM calls torch.accelerator, which raises with none.
    torch.accelerator.synchronize = neuron.synchronize
    torch.accelerator.empty_cache = neuron.empty_cache
    torch.accelerator.empty_host_cache = neuron.empty_cache
    import vllm_neuron.device

    vllm_neuron.device.TENSOR_DEVICE_TYPE = "cpu"  # the seam: see the module docstring
    to_host, copy_to_device = vllm_neuron.device.to_host, vllm_neuron.device.copy_to_device

    def copying_to_host(tensor: torch.Tensor) -> torch.Tensor:
        runtime.copy_to_host(tensor)  # rule (f)
        runtime.count("to_host")  # rule (i)
        runtime.synchronize()  # rule (m): a blocking read waits until the stream is idle
        return to_host(tensor)

    def starting_read(tensor: torch.Tensor) -> torch.Tensor:
        runtime.copy_to_host(tensor)  # rule (f)
        runtime.count("reads_started")  # rule (i)
        return streams.stream.start_read(tensor)  # rule (m)

    def copying_to_device(destination: torch.Tensor, source: torch.Tensor) -> None:
        runtime.count("to_device")  # rule (i)
        with HostToDeviceCopies() as copies:
            copy_to_device(destination, source)
        for _ in range(copies.blocking):  # rule (j)
            runtime.count("blocking_to_device")
            runtime.synchronize()

    vllm_neuron.device.to_host = copying_to_host
    vllm_neuron.device.start_read = starting_read
    vllm_neuron.device.copy_to_device = copying_to_device


_register()

# Rules (k) and (l): after the seams are wrapped, whose to_host it wraps again.
from torch_neuronx import eager_ops  # noqa: E402

eager = eager_ops.install(runtime)
