"""worker.compiles.background: the order of staged readiness's background compiles, failures, how many at
once, and how they stop."""

import threading
import time

import pytest

from worker.compiles.background import BackgroundCompiler, compile_workers

GRAPHS = [("prefill", 32, 128), ("prefill", 64, 256), ("decode", 2, 128), ("decode", 4, 256)]


def run(demand: dict, fail: set = frozenset(), workers: int = 1) -> tuple[list, dict]:
    compiled, done = [], {}

    def compile_graph(graph):
        if graph in fail:
            raise RuntimeError("does not lower")
        compiled.append(graph)
        return 0.0

    compiler = BackgroundCompiler(GRAPHS, compile_graph, lambda g, error: done.__setitem__(g, error), workers)
    compiler.add_demand(demand)  # as the serving thread reports after each step
    compiler.start()
    assert compiler.wait(timeout=10)
    return compiled, done


def test_the_graph_that_would_have_saved_the_most_compiles_first():
    """Graphs nobody asked for follow in the bucket set's order."""
    compiled, _ = run({("decode", 4, 256): 5.0, ("prefill", 64, 256): 9.0})
    assert compiled == [("prefill", 64, 256), ("decode", 4, 256), ("prefill", 32, 128), ("decode", 2, 128)]


def test_a_graph_that_fails_is_reported_and_the_others_go_on():
    compiled, done = run({}, fail={("decode", 2, 128)}, workers=2)
    assert sorted(compiled) == sorted(g for g in GRAPHS if g != ("decode", 2, 128))
    assert done[("decode", 2, 128)] == "RuntimeError: does not lower"
    assert [g for g, error in done.items() if error is None] == compiled


def test_compile_workers():
    assert compile_workers(0, neuron=False, cpus=64) == 1  # CPU mode: compiles share serving's cores
    assert compile_workers(0, neuron=True, cpus=192) == 8  # trn2.48xlarge: 8 neuronx-cc at once
    assert compile_workers(0, neuron=True, cpus=8) == 1
    assert compile_workers(3, neuron=False, cpus=2) == 3


def test_a_negative_number_of_workers_is_refused(monkeypatch):
    from vllm_neuron import envs

    monkeypatch.setenv("VLLM_NEURON_COMPILE_WORKERS", "-1")
    with pytest.raises(ValueError, match="VLLM_NEURON_COMPILE_WORKERS=-1"):
        _ = envs.VLLM_NEURON_COMPILE_WORKERS


def test_shutdown_cancels_a_trace_under_way_and_joins_its_thread():
    """A compile thread must not outlive the engine: one left running into the interpreter's exit aborts the
    process (worker/compiles/background.py). Dynamo's trace stops at its next instruction."""
    import torch

    def long_trace(x):  # about 20 s of dynamo's tracing
        for _ in range(20_000):
            x = x * 2 + 1
        return x

    compiled = torch.compile(long_trace, backend="eager", fullgraph=True, dynamic=False)
    tracing, done, cancelled = threading.Event(), {}, []

    def compile_graph(graph):
        tracing.set()
        compiled(torch.ones(3))
        return 0.0

    graph = GRAPHS[0]
    compiler = BackgroundCompiler(
        [graph], compile_graph, done.__setitem__, workers=1, cancel_compiles=lambda: cancelled.append(1)
    )
    compiler.start()
    assert tracing.wait(10)
    time.sleep(0.5)  # well into the trace
    start = time.monotonic()
    assert compiler.shutdown(timeout=10)
    assert time.monotonic() - start < 5
    assert not compiler.compiling and cancelled == [1]
    assert done == {} and compiler.pending == [graph]  # cancelled, not failed: nothing reported


def test_pause_lets_the_compile_under_way_finish_and_keeps_the_others():
    compiled = []
    started = threading.Event()

    def compile_graph(graph):
        started.set()
        time.sleep(0.3)
        compiled.append(graph)
        return 0.0

    compiler = BackgroundCompiler(GRAPHS, compile_graph, lambda g, error: None, workers=1)
    compiler.start()
    assert started.wait(10)
    assert compiler.stop(wait=True) == GRAPHS[1:]
    assert compiled == GRAPHS[:1] and not compiler.compiling
