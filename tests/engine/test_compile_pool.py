"""Inductor's compiles in compile processes (vllm_neuron/compiler/compile_pool.py): results equal eager, input
mutations (the KV cache write) kept, several graphs at once, artefacts reused, no process left behind."""

import multiprocessing
import os
import subprocess
import sys
import threading
from concurrent.futures import CancelledError
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch

from vllm_neuron.compiler.compile import compile_static
from vllm_neuron.compiler.compile_pool import OutOfProcessInductor, end_compiler_processes


class CacheWrite(torch.nn.Module):
    """A weight, and an in-place write into an input, as the model step writes the KV cache."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.silu(self.proj(x))
        cache[: x.shape[0]].copy_(hidden)
        return (hidden * 2).sum(dim=-1)


@pytest.fixture
def inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path


def run_shapes(module: torch.nn.Module, compiled, sizes: list[int]) -> None:
    for size in sizes:
        x = torch.randn(size, 64)
        cache, expected_cache = torch.zeros(16, 64), torch.zeros(16, 64)
        with torch.no_grad():
            out = compiled(x, cache)
            expected = module(x, expected_cache)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(cache, expected_cache)


@pytest.mark.slow
def test_compiles_run_at_once_in_other_processes_and_a_restart_loads_them(inductor_cache):
    """Two threads' first calls: dynamo traces one graph at a time, and the two compiles that follow overlap,
    each in a compile process. A restart traces again and loads both artefacts without compiling."""
    module = CacheWrite()
    compiled, recorder = compile_static(module, "inductor", expected_graphs=2, compile_workers=2)
    errors: list[BaseException] = []

    def first_call(size: int) -> None:
        try:
            run_shapes(module, compiled, [size])
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=first_call, args=(size,)) for size in (4, 8)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        run_shapes(module, compiled, [8, 4])  # and again, from another thread
        pool = recorder.compile_pool
        assert (recorder.num_graphs, pool.compiles, pool.cache_hits) == (2, 2, 0)
        first, second = sorted(pool.reports, key=lambda report: report.started)
        assert os.getpid() != first.pid != second.pid != os.getpid()
        assert second.started < first.started + first.seconds  # the second began before the first ended
        assert len(list((inductor_cache / "neuron-graphs").iterdir())) == 2  # no partial folders left
    finally:
        recorder.close()

    # A restart: the graphs traced again (not with torch._dynamo.reset(), which would make the suite's
    # shared engine recompile), handed to a new pool, which finds both artefacts.
    restarted = OutOfProcessInductor(workers=2)
    for size in (8, 4):
        graph = restarted(*traced(module, size))
        x, cache, expected_cache = torch.randn(size, 64), torch.zeros(16, 64), torch.zeros(16, 64)
        with torch.no_grad():
            (out,) = graph(*module.parameters(), x, cache)
            torch.testing.assert_close(out, module(x, expected_cache))
        torch.testing.assert_close(cache, expected_cache)
    assert (restarted.compiles, restarted.cache_hits) == (0, 2)
    restarted.close()


def test_close_ends_a_compile_under_way(inductor_cache):
    module = CacheWrite()
    others = set(multiprocessing.active_children())
    _, recorder = compile_static(module, "inductor", expected_graphs=1, compile_workers=1)
    graph = recorder.compile_pool(*traced(module, 4))
    recorder.close()
    with pytest.raises((CancelledError, BrokenProcessPool)):  # not yet started, or ended under way
        graph(torch.zeros(4, 64), torch.zeros(16, 64))
    # A process still on its way out is waited for (CI runs under load saw one alive just after close, and
    # once 30 s after it: a spawned process imports torch before it reads the pool's shutdown); one that
    # outlives that is a process close left behind.
    for child in set(multiprocessing.active_children()) - others:
        child.join(timeout=120)
    assert set(multiprocessing.active_children()) <= others


def test_cancel_ends_the_compiles_and_refuses_later_ones(inductor_cache):
    """An engine shutting down (Readiness.stop) starts no compile process again."""
    module = CacheWrite()
    others = set(multiprocessing.active_children())
    _, recorder = compile_static(module, "inductor", expected_graphs=1, compile_workers=1)
    recorder.cancel()
    with pytest.raises(RuntimeError, match="cancelled"):
        recorder.compile_pool(*traced(module, 4))
    assert set(multiprocessing.active_children()) <= others


def test_end_compiler_processes_ends_only_the_named_program(tmp_path):
    """TorchNeuron's neuronx-cc compiles, found by their program's name among this process's descendants."""
    compiler = tmp_path / "neuronx-cc"
    compiler.write_text("import time\ntime.sleep(120)\n")
    other = tmp_path / "other"
    other.write_text("import time\ntime.sleep(120)\n")
    running = subprocess.Popen([sys.executable, str(compiler), "compile"])
    bystander = subprocess.Popen([sys.executable, str(other)])
    try:
        assert end_compiler_processes("neuronx-cc", timeout=10) == 1
        assert running.wait(timeout=10) is not None
        assert bystander.poll() is None
    finally:
        for process in (running, bystander):
            process.kill()
            process.wait()


def traced(module: torch.nn.Module, size: int) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """The graph and inputs dynamo hands a backend (a new one: dynamo traces again) for `size` rows; the
    graph takes the module's parameters first."""
    captured = []

    def backend(graph_module, example_inputs):
        captured.append((graph_module, example_inputs))
        return graph_module.forward

    with torch.no_grad():
        torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(
            torch.zeros(size, 64), torch.zeros(16, 64)
        )
    return captured[0]
