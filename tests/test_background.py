"""worker.background: the order of staged readiness's background compiles, failures, and how many at once."""

import pytest

from worker.background import BackgroundCompiler, compile_workers

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
