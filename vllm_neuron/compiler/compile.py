"""The only caller of torch.compile: static shapes, full graphs, every graph recorded, recompiles guarded.

`CompileRecorder` sits between dynamo and the real backend (neuron; stablehlo, which lowers each graph along
TorchNeuron's route and runs its FX graph on the CPU, vllm_neuron/compiler/stablehlo.py; xla, the same
lowering then XLA compiles and runs the StableHLO itself, vllm_neuron/compiler/xla_graph.py; lower-only, which
lowers without running; eager; inductor, compiled in separate processes,
vllm_neuron/compiler/compile_pool.py). Dynamo hands a backend one graph per new input signature, so the
recorder sees every compile, whatever the backend:
- it refuses what TorchNeuron's compiler refuses (symbolic shapes, float64, non-contiguous inputs), so CPU
  runs fail where a Neuron compile would;
- it records the input shapes of each graph;
- once armed (after warm-up), a new graph is an unexpected recompile: counted and logged with its shapes,
  or refused with an error in strict mode; except in a thread that `expecting` a graph (staged readiness's
  background compiles, worker/compiles/background.py).
"""

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_neuron.calls import Call
from vllm_neuron.compiler.compile_pool import OutOfProcessInductor, end_compiler_processes
from vllm_neuron.upstream import torch_compile

logger = logging.getLogger("vllm.vllm_neuron.compiler.compile")

Shapes = tuple[tuple[int, ...], ...]


# The backends that lower each graph along TorchNeuron's route (vllm_neuron/compiler/stablehlo.py), and how
# each runs the lowered graph.
_EXECUTION = {"stablehlo": "fx", "xla": "xla", "lower-only": "none"}


class NeuronCompileError(RuntimeError):
    """A graph TorchNeuron's compiler would refuse."""


class UnexpectedRecompileError(RuntimeError):
    """A new graph after warm-up while recompiles are forbidden (VLLM_NEURON_STRICT_SHAPES=1)."""


def check_neuron_constraints(graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """Raise NeuronCompileError for what torch.compile(backend="neuron") cannot compile."""
    for position, value in enumerate(example_inputs):
        if isinstance(value, torch.SymInt | torch.SymFloat):
            raise NeuronCompileError(
                f"input {position} is a symbolic scalar: TorchNeuron needs static shapes"
            )
        if not isinstance(value, torch.Tensor):
            continue
        if any(isinstance(size, torch.SymInt) for size in value.shape):
            raise NeuronCompileError(
                f"input {position} has a dynamic shape {tuple(value.shape)}: TorchNeuron needs static shapes"
            )
        if value.dtype == torch.float64:
            raise NeuronCompileError(f"input {position} is float64: TorchNeuron computes float64 as float32")
        if not value.is_contiguous():
            raise NeuronCompileError(
                f"input {position} of shape {tuple(value.shape)} is not contiguous: TorchNeuron graphs need "
                "contiguous inputs"
            )
    for node in graph_module.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
            raise NeuronCompileError(f"graph node {node.name} ({node.target}) computes in float64")


class ThreadCall(threading.local):
    """What one thread is about to run: the model call (recompile messages, lowered graphs' labels) or
    another graph's label (NIXL's block copies, worker/kv/nixl_blocks.py), and whether a new graph is
    expected for it even once the recorder is armed."""

    call: "Call | str | None" = None
    expected: bool = False


@dataclass(repr=False)
class CompileRecorder:
    backend_name: str
    strict: bool = False
    graphs: list[Shapes] = field(default_factory=list)
    unexpected: list[Shapes] = field(default_factory=list)
    armed: bool = False
    on_unexpected: Callable[[Shapes], None] | None = None

    dump_dir: Path | None = None
    compile_workers: int = 1  # inductor's compile processes

    def __post_init__(self) -> None:
        # Serving and background compiles run in different threads: each sets the call it is about to run.
        self.thread = ThreadCall()
        self.compile_pool: OutOfProcessInductor | None = None
        if self.backend_name in _EXECUTION:
            from vllm_neuron.compiler.stablehlo import StableHLOBackend

            execute = _EXECUTION[self.backend_name]
            self.lowering: StableHLOBackend | None = StableHLOBackend(self.dump_dir, execute=execute)
            self._inner = self.lowering
            return
        self.lowering = None
        if self.backend_name == "inductor":
            self.compile_pool = self._inner = OutOfProcessInductor(self.compile_workers)
        else:
            self._inner = torch_compile.lookup_backend(self.backend_name)

    def close(self) -> None:
        """End the backend's compile processes, if it has any."""
        if self.compile_pool is not None:
            self.compile_pool.close()

    def cancel(self) -> None:
        """Engine shutdown: end the backend's compiles under way and refuse later ones (inductor's compile
        processes; on Trainium, TorchNeuron's neuronx-cc processes)."""
        if self.compile_pool is not None:
            self.compile_pool.close(cancel=True)
        if self.backend_name == "neuron" and (ended := end_compiler_processes("neuronx-cc")):
            logger.info("Ended %d neuronx-cc compiles under way", ended)

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        check_neuron_constraints(graph_module, example_inputs)
        shapes = tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor))
        if self.armed and not self.thread.expected:
            self._unexpected(shapes)
        self.graphs.append(shapes)
        if self.lowering is not None:
            current = self.thread.call
            self.lowering.label = str(current or f"graph {len(self.graphs) - 1}")
            self.lowering.call = current if isinstance(current, Call) else None
        return self._inner(graph_module, example_inputs)

    @contextmanager
    def expecting(self, call: Call) -> Iterator[None]:
        """Within this block, in this thread, a new graph for `call` is expected even once armed."""
        self.thread.call, self.thread.expected = call, True
        try:
            yield
        finally:
            self.thread.call, self.thread.expected = None, False

    def __repr__(self) -> str:  # dynamo names the backend by it in compile errors
        return f"CompileRecorder({self.backend_name})"

    def _unexpected(self, shapes: Shapes) -> None:
        described = f"{self.thread.call or 'a call'} (input shapes {list(shapes)[:4]}...)"
        advice = (
            "Every call should be padded to a configured bucket: check prefill_buckets, decode_batch_buckets "
            "and context_buckets (--additional-config or VLLM_NEURON_*_BUCKETS), and report this as a bug."
        )
        if self.strict:
            raise UnexpectedRecompileError(
                f"refused a recompile after warm-up for {described} (VLLM_NEURON_STRICT_SHAPES=1). {advice}"
            )
        self.unexpected.append(shapes)
        if self.on_unexpected is not None:
            self.on_unexpected(shapes)
        logger.warning("Unexpected recompile after warm-up for %s. %s", described, advice)

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed buffer the graphs update in place (a KV cache). Under `xla` its memory is XLA's, so the
        compiled programs can write it in place (vllm_neuron/compiler/xla.py)."""
        if self.backend_name == "xla":
            from vllm_neuron.compiler import xla

            return xla.allocate_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)


def compile_config() -> Callable[[], None]:
    """The torch.compile configuration of this thread (dynamo's, AOTAutograd's, inductor's), as a function
    that applies it in another thread: torch keeps these settings per thread, so a background compile would
    otherwise trace with the defaults (a recompile limit of 8, for one)."""
    return torch_compile.thread_compile_settings()


def compile_static(
    module: torch.nn.Module,
    backend_name: str,
    expected_graphs: int,
    *,
    strict: bool = False,
    dump_dir: Path | None = None,
    compile_workers: int = 1,
    recorder: CompileRecorder | None = None,
) -> tuple[Callable, CompileRecorder]:
    """Compile `module` for static shapes: one graph per bucket shape, no graph breaks, default mode (the only
    mode TorchNeuron has). Backend "none" returns the module uncompiled (debugging); nothing is recorded.
    `recorder`: one already recording another module's graphs (a draft model's beside its target's)."""
    if recorder is None:
        recorder = CompileRecorder(
            "eager" if backend_name == "none" else backend_name,
            strict=strict,
            dump_dir=dump_dir,
            compile_workers=compile_workers,
        )
    if backend_name == "none":
        return module, recorder
    # Each bucket is one more cache entry for the same code; past the limit (default 8) dynamo would
    # silently fall back to running the module uncompiled.
    torch_compile.raise_recompile_limits(expected_graphs + 8)
    compiled = torch.compile(module, backend=recorder, dynamic=False, fullgraph=True, mode="default")
    return compiled, recorder
