"""Inductor's compiles out of the serving process: the CPU stand-in for neuronx-cc, which TorchNeuron runs as
a program of its own beside the process that traces.

Dynamo traces in the serving process, one graph at a time under its lock. `OutOfProcessInductor` pickles the
traced graph, hands it to a pool of compile processes (AOTAutograd and inductor, through inductor's
`standalone_compile`, the precompilation API vLLM's own compile cache uses) and returns at once, so the lock
is free for the next trace while the compile runs: with N background workers N graphs compile at once, and
the serving thread no longer shares the GIL with inductor's code generation. A graph's first call waits for
its compile and loads the artefact. Artefacts are kept in inductor's cache folder (the compile cache's, see
vllm_neuron/compiler/compile_cache.py) under a digest of the traced graph and its input shapes, so a restart
loads them without compiling.
"""

import concurrent.futures
import hashlib
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import kv_cache.kernels  # noqa: F401  (registers the neuron_kv ops an unpickled graph calls by name)
from vllm_neuron.upstream import torch_compile

logger = logging.getLogger("vllm.vllm_neuron.compiler.compile_pool")

# One file: loading it puts its entries into inductor's cache, where the compile process left the kernels it
# built, so nothing is built twice.
ARTEFACT_FORMAT = "binary"


@dataclass(frozen=True)
class InputSpec:
    """What a compile needs of a graph input: its layout, not its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, value: Any) -> "InputSpec":
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"a static-shape graph takes tensors only, not {type(value).__name__}")
        return cls(tuple(value.shape), tuple(value.stride()), value.dtype, str(value.device))


@dataclass(frozen=True)
class CompileReport:
    """One compile in a compile process."""

    pid: int
    started: float  # wall-clock time (time.time)
    seconds: float


def artefact_folder() -> Path:
    return Path(torch_compile.inductor_cache_dir()) / "neuron-graphs"


def _portable(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a traced graph that pickles: without dynamo's attributes (they hold the traced values), and
    of each node's metadata only its source line and the layout of its value, as a fresh fake tensor
    (GraphPickler cannot pickle fake views; AOTAutograd's cache wants a value on every tensor node)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    fake_mode = torch_compile.fake_tensor_mode()

    def fresh(value: torch.Tensor) -> torch.Tensor:
        with fake_mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)

    for node in graph.nodes:
        kept = {key: node.meta[key] for key in ("stack_trace",) if key in node.meta}
        if "example_value" in node.meta:
            kept["example_value"] = torch_compile.map_tensors(fresh, node.meta["example_value"])
        node.meta = kept
    return torch.fx.GraphModule(graph_module, graph)


def compile_graph(graph: bytes, inputs: list[InputSpec], path: str) -> CompileReport:
    """In a compile process: compile a pickled traced graph for fake inputs of its traced layout and save
    the artefact at `path` (atomically: pods may share the cache)."""
    started, start = time.time(), time.perf_counter()
    fake_mode = torch_compile.fake_tensor_mode(shape_env=True)
    module = torch_compile.unpickle_graph(graph, fake_mode)
    with fake_mode:
        examples = [
            torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=spec.device)
            for spec in inputs
        ]
    artefact = torch_compile.standalone_compile(module, examples, fake_mode)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    artefact.save(path=path, format=ARTEFACT_FORMAT)  # written to a temporary file and renamed
    return CompileReport(os.getpid(), started, time.perf_counter() - start)


def _exit_with_parent(parent: int) -> None:
    """In a compile process: exit as soon as the process that started it is gone (killed, out of memory),
    instead of finishing a compile nobody will load."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def end_compiler_processes(program: str, timeout: float = 5.0) -> int:
    """End this process's descendants running `program` (its executable or script is named so), SIGTERM then
    SIGKILL after `timeout` seconds; returns how many. At shutdown TorchNeuron's neuronx-cc compiles (minutes
    each) would otherwise hold the exit for a graph nobody will load; their caller then raises."""
    import psutil

    from vllm_neuron.processes import end_processes

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = child.cmdline()
        except psutil.Error:  # gone, or not ours to read
            continue
        if any(Path(part).name == program for part in command[:2]):
            found.append(child)
    end_processes(found, timeout)
    return len(found)


class DeferredGraph:
    """A traced graph whose artefact a compile process makes (or made, on an earlier start): the first call
    waits for it and loads it."""

    def __init__(self, path: Path, compiling: concurrent.futures.Future | None) -> None:
        self.path = path
        self._compiling = compiling
        self._compiled: Any = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    if self._compiling is not None:
                        self._compiling.result()  # a compile error is raised here
                    self._compiled = torch_compile.load_compiled_artifact(str(self.path), ARTEFACT_FORMAT)
        return self._compiled(*args)


class OutOfProcessInductor:
    """The inductor backend with its compiles in up to `workers` processes, started on the first compile."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.compiles = 0  # graphs handed to the compile processes
        self.cache_hits = 0  # graphs whose artefact an earlier start saved
        self.reports: list[CompileReport] = []  # of the compiles done
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._cancelled = False

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> DeferredGraph:
        inputs = [InputSpec.of(value) for value in example_inputs]
        graph = torch_compile.pickle_graph(_portable(graph_module))
        digest = hashlib.sha256(graph + repr(inputs).encode()).hexdigest()[:40]
        path = artefact_folder() / f"{digest}.bin"
        if path.exists():
            self.cache_hits += 1
            return DeferredGraph(path, None)
        self.compiles += 1
        compiling = self._submit(graph, inputs, path)
        compiling.add_done_callback(self._done)
        return DeferredGraph(path, compiling)

    def _done(self, compiling: concurrent.futures.Future) -> None:
        if not compiling.cancelled() and compiling.exception() is None:
            report = compiling.result()
            self.reports.append(report)
            logger.debug("Compiled a graph in compile process %d in %.1f s", report.pid, report.seconds)

    def _submit(self, graph: bytes, inputs: list[InputSpec], path: Path) -> concurrent.futures.Future:
        with self._lock:
            if self._cancelled:
                raise RuntimeError("compiles were cancelled: the engine is shutting down")
            if self._pool is not None:
                try:
                    return self._pool.submit(compile_graph, graph, inputs, str(path))
                except BrokenProcessPool:
                    # A compile process died (out of memory, killed): later compiles get a fresh pool.
                    self._pool.shutdown(wait=False)
            # spawn: a fork of a process with threads (and possibly a device) is unsafe.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_exit_with_parent,
                initargs=(os.getpid(),),
            )
            return self._pool.submit(compile_graph, graph, inputs, str(path))

    def close(self, cancel: bool = False) -> None:
        """End the compile processes, including compiles under way (their graphs are never used); a later
        compile starts new ones, unless `cancel` (the engine shuts down) refuses it."""
        with self._lock:
            self._cancelled = self._cancelled or cancel
            pool, self._pool = self._pool, None
        if pool is None:
            return
        # A compile under way would otherwise hold this process's exit for its whole length. Python 3.14's
        # terminate_workers does this; 3.11 keeps the processes in `_processes`.
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        pool.shutdown(wait=True)
