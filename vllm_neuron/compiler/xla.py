"""XLA's CPU compiler, the closest public stand-in for neuronx-cc's front end: compiles a StableHLO module,
runs it on torch tensors, and reports what its buffer assignment and cost model make of it.

Every use of jax/jaxlib goes through this module (pinned by tests/engine/test_xla.py): the PJRT CPU client,
its `compile_and_load`, `execute_sharded`, compiled memory stats, cost analysis and optimised HLO are jaxlib's
`_jax` extension and `jax._src.xla_bridge`, not public API.

Buffers. Inputs reach XLA as DLPack views of the torch tensors (no copy). A KV cache must be written in
place, and PJRT updates a donated (must_alias) buffer in place only when it owns the memory and nothing
holds an external reference to it: a DLPack view either way makes it copy the cache to a new output. So a
cache the engine runs through XLA is allocated by XLA (`allocate_zeros`): XLA owns the buffer, the engine's
torch tensor is a raw view of the same memory, and each call donates the buffer and gets it back at the same
address, which `Program.run` checks.
"""

import ctypes
import hashlib
import os
import platform
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_neuron import envs

_lock = threading.Lock()
_state: dict[str, Any] = {}
# sha256 of a module's text -> its loaded executable and the size of its serialized form
_executables: dict[str, tuple[Any, int]] = {}


def _jax() -> Any:
    """jax, configured once: 64-bit integers kept (the graphs' indices are int64; jax narrows them to
    int32 otherwise, a copy per call and a type the program refuses)."""
    with _lock:
        if "jax" not in _state:
            import jax

            jax.config.update("jax_enable_x64", True)
            jax.config.update("jax_platforms", "cpu")
            _state["jax"] = jax
        return _state["jax"]


def _client() -> Any:
    _jax()
    from jax._src import xla_bridge

    return xla_bridge.get_backend("cpu")


@dataclass(frozen=True)
class Memory:
    """XLA's buffer assignment of a compiled program, in bytes."""

    argument: int
    output: int
    alias: int  # outputs that live in their input's buffer (donated, updated in place)
    temp: int  # scratch the program needs beside its arguments and outputs


@dataclass(frozen=True)
class Cost:
    """XLA's cost model of a compiled program: floating-point operations and bytes read plus written."""

    flops: float
    bytes_accessed: float
    transcendentals: float


class _CacheMemory:
    """The XLA buffer behind a cache's torch view: the array that owns it now (each call donates it and
    gets back a new array over the same memory)."""

    def __init__(self, array: Any) -> None:
        self.array = array
        self.address = array.unsafe_buffer_pointer()


# A cache's address -> its XLA buffer, while a torch view of it lives.
_caches: "weakref.WeakValueDictionary[int, _CacheMemory]" = weakref.WeakValueDictionary()
_donating = threading.Lock()


def allocate_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor whose memory XLA owns, so programs can update it in place (donated, must_alias)."""
    _jax()
    import jax.numpy as jnp

    array = jnp.zeros(shape, dtype=_jax_dtype(jnp, dtype), device=_client().devices()[0])
    array.block_until_ready()
    memory = _CacheMemory(array)
    nbytes = array.nbytes
    # A raw view: a DLPack or numpy view would hold an external reference, and PJRT copies a donated buffer
    # that has one. The view object keeps the XLA buffer alive as long as torch uses the memory.
    raw = type("XlaBuffer", (ctypes.c_ubyte * max(nbytes, 1),), {}).from_address(memory.address)
    raw.owner = memory
    tensor = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    _caches[memory.address] = memory
    return tensor


def _jax_dtype(jnp: Any, dtype: torch.dtype) -> Any:
    return getattr(jnp, str(dtype).removeprefix("torch."))


class CacheNotOwnedError(RuntimeError):
    """A donated (in-place) argument whose memory XLA does not own: XLA would copy it."""


class Program:
    """A compiled XLA executable that runs on torch tensors.

    donated: parameter numbers updated in place (the module's must_alias entries), with the output each
    one comes back as. Other inputs are DLPack views, kept between calls while the tensor is the same
    memory (weights, persistent input buffers)."""

    def __init__(self, executable: Any, donated: dict[int, int], serialized_bytes: int = 0) -> None:
        self._executable = executable
        self._donated = donated
        # The executable as XLA serializes it (what the compile cache keeps): its code and constants, the
        # CPU's stand-in for a NEFF's size. Taken at compile time: XLA refuses to serialize some executables
        # once they have run.
        self.serialized_bytes = serialized_bytes
        self._views: dict[int, tuple[tuple[int, tuple[int, ...], torch.dtype], Any]] = {}
        # Inputs jax copied instead of viewing (memory not aligned as XLA needs: a slice of a step's input
        # buffer), position -> address, at their last call.
        self.copied_inputs: dict[int, int] = {}

    @property
    def memory(self) -> Memory:
        stats = self._executable.get_compiled_memory_stats()
        return Memory(
            argument=stats.argument_size_in_bytes,
            output=stats.output_size_in_bytes,
            alias=stats.alias_size_in_bytes,
            temp=stats.temp_size_in_bytes,
        )

    @property
    def cost(self) -> Cost:
        analysis = self._executable.cost_analysis()
        return Cost(
            flops=float(analysis.get("flops", 0.0)),
            bytes_accessed=float(analysis.get("bytes accessed", 0.0)),
            transcendentals=float(analysis.get("transcendentals", 0.0)),
        )

    @property
    def optimized_hlo(self) -> str:
        return "\n".join(module.to_string() for module in self._executable.hlo_modules())

    def run(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        """Outputs of one call as torch tensors (DLPack views of XLA's buffers), each donated argument
        updated in place, every output ready."""
        inputs = [self._input(position, tensor) for position, tensor in enumerate(args)]
        # One call at a time donates a cache: a background compile's first run (staged readiness) and a
        # serving step share the caches, and a donated buffer is gone until its call returns it.
        with _donating:
            donated = {}
            for parameter in self._donated:
                memory = _caches.get(args[parameter].data_ptr())
                if memory is None:
                    raise CacheNotOwnedError(
                        f"argument {parameter} is updated in place but XLA does not own its memory: allocate "
                        "it with vllm_neuron.compiler.xla.allocate_zeros"
                    )
                inputs[parameter], donated[parameter] = memory.array, memory
            results = self._executable.execute_sharded(inputs).disassemble_into_single_device_arrays()
            outputs = [arrays[0] for arrays in results]
            for parameter, output in self._donated.items():
                memory, array = donated[parameter], outputs[output]
                if array.unsafe_buffer_pointer() != memory.address:
                    raise CacheNotOwnedError(
                        f"XLA wrote argument {parameter}'s update to a new buffer instead of in place"
                    )
                memory.array = array
            for array in outputs:
                array.block_until_ready()
        kept = [array for index, array in enumerate(outputs) if index not in self._donated.values()]
        return [torch.from_dlpack(array) for array in kept]

    def run_graph(self, written: int, copies: tuple[tuple[int, int], ...], args: list[torch.Tensor]) -> list:
        """A traced graph's call: its first `written` outputs are the inputs it writes, the donated ones
        updated in place and left out of `run`'s outputs; each of `copies` (parameter, output) is stored into
        its input. Returns the graph's other outputs."""
        outputs = self.run(args)  # every output but the donated ones, in order
        donated = set(self._donated.values())
        total = len(outputs) + len(donated)
        by_index = dict(zip((i for i in range(total) if i not in donated), outputs, strict=True))
        for parameter, output in copies:
            args[parameter].copy_(by_index[output])
        return [by_index[index] for index in range(written, total)]

    def _input(self, position: int, tensor: torch.Tensor) -> Any:
        if position in self._donated:
            return None
        jax = _jax()
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        kept = self._views.get(position)
        if kept is not None and kept[0] == key:
            return kept[1]
        # XLA's arrays are row-major: a strided view (a transposed weight) reaches it as its memory is laid
        # out, which reads other elements, so it goes as a row-major copy, recorded as copied.
        contiguous = tensor.detach().contiguous()
        array = jax.dlpack.from_dlpack(contiguous)
        # Only a view (the same memory) stays valid when the tensor's contents change.
        if not tensor.numel():
            return array
        if contiguous.data_ptr() == tensor.data_ptr() and array.unsafe_buffer_pointer() == tensor.data_ptr():
            self._views[position] = (key, array)
        else:
            self.copied_inputs[position] = tensor.data_ptr()
        return array


def compile(stablehlo: str, donated: dict[int, int]) -> Program:  # noqa: A001 (XLA's own word)
    """Compile a plain StableHLO module (its text) for the CPU. donated: parameter -> aliased output.

    A module compiled before reuses that executable, as TorchNeuron's compile cache reuses a NEFF: from this
    process (another engine of the same shapes: the weights are parameters, not in the text), or from the
    compile cache's folder (VLLM_NEURON_XLA_CACHE_DIR), keyed by the module, jaxlib and the host's CPU."""
    from jax._src.lib import xla_client

    key = hashlib.sha256("\n".join([stablehlo, *_host()]).encode()).hexdigest()
    with _lock:
        known = _executables.get(key)
    if known is not None:
        return Program(known[0], donated, known[1])
    client, options = _client(), xla_client.CompileOptions()
    devices = client.devices()[:1]
    folder = envs.VLLM_NEURON_XLA_CACHE_DIR
    path = Path(folder) / f"{key}.xla" if folder else None
    if path is not None and path.is_file():
        serialized = path.read_bytes()
        executable = client.deserialize_executable(serialized, devices, options)
    else:
        executable = client.compile_and_load(stablehlo, devices, options)
        serialized = client.serialize_executable(executable)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            written = path.with_suffix(f".{os.getpid()}.tmp")  # whole or absent, for processes sharing it
            written.write_bytes(serialized)
            os.replace(written, path)
    with _lock:
        _executables[key] = (executable, len(serialized))
    return Program(executable, donated, len(serialized))


def _host() -> tuple[str, ...]:
    """What an executable compiled here depends on besides its module: jaxlib, the CPU's features (XLA
    compiles for the host's instruction set) and XLA's own flags (XLA_FLAGS)."""
    import jaxlib

    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    return jaxlib.__version__, platform.machine(), flags, os.environ.get("XLA_FLAGS", "")
