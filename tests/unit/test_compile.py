"""The compile recorder: counts graphs for any backend, guards recompiles after warm-up, and refuses what
TorchNeuron's compiler refuses."""

import logging
import threading

import pytest
import torch

from vllm_neuron.calls import Call
from vllm_neuron.compiler.compile import (
    CompileRecorder,
    NeuronCompileError,
    UnexpectedRecompileError,
    compile_config,
    compile_static,
)


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_one_graph_per_shape_for_every_backend(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # inductor's artefacts: this test's own
    compiled, recorder = compile_static(Scale(), backend, expected_graphs=2)
    for _ in range(3):
        assert torch.equal(compiled(torch.ones(4)), torch.full((4,), 3.0))
        compiled(torch.ones(8))
    recorder.close()  # inductor's compile processes
    assert recorder.num_graphs == 2
    assert recorder.graphs == [((4,),), ((8,),)]


def test_new_shape_after_warm_up_is_counted_and_logged(caplog):
    compiled, recorder = compile_static(Scale(), "eager", expected_graphs=1)
    compiled(torch.ones(4))
    recorder.armed = True
    recorder.thread.call = Call.decode(rows=5, batch=8, decode_context=256)
    seen = []
    recorder.on_unexpected = seen.append
    compiled(torch.ones(4))
    assert recorder.unexpected == []
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_neuron.compiler.compile"):
        compiled(torch.ones(5))
    assert recorder.unexpected == [((5,),)] == seen
    assert "decode of 5 requests: batch 8 x context 256" in caplog.text and "(5,)" in caplog.text


def test_strict_mode_refuses_a_new_shape_and_names_the_setting():
    compiled, recorder = compile_static(Scale(), "eager", expected_graphs=1, strict=True)
    compiled(torch.ones(4))
    recorder.armed = True
    recorder.thread.call = Call.prefill(tokens=70, token_bucket=128, chunk_context=256)
    with pytest.raises(Exception, match="prefill_buckets") as error:
        compiled(torch.ones(5))
    assert isinstance(error.value, UnexpectedRecompileError) or "UnexpectedRecompileError" in str(error.value)
    assert "tokens 128 x context 256" in str(error.value)
    assert recorder.num_graphs == 1
    assert torch.equal(compiled(torch.ones(4)), torch.full((4,), 3.0))  # known shapes still run


def test_strict_mode_allows_a_background_compile_only_in_its_thread():
    """Staged readiness: once armed, a thread `expecting` a graph compiles it; any other thread is refused,
    even while that compile runs; the graph compiled in the background then runs everywhere."""
    compiled, recorder = compile_static(Scale(), "eager", expected_graphs=40, strict=True)
    compiled(torch.ones(4))
    recorder.armed = True
    apply_config = compile_config()
    outcome = {}

    def background() -> None:
        apply_config()
        with recorder.expecting(Call.decode(rows=6, batch=6, decode_context=128)):
            outcome["background"] = compiled(torch.ones(6))

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert torch.equal(outcome["background"], torch.full((6,), 3.0))
    assert recorder.num_graphs == 2 and recorder.unexpected == []
    assert torch.equal(compiled(torch.ones(6)), torch.full((6,), 3.0))  # serving runs it, no compile
    with pytest.raises(Exception, match="VLLM_NEURON_STRICT_SHAPES"):
        compiled(torch.ones(7))  # this thread expects nothing


def test_background_threads_get_the_serving_threads_compile_limits():
    """torch keeps dynamo's settings per thread: without compile_config a background thread would fall back
    to a recompile limit of 8 graphs per model."""
    compile_static(Scale(), "eager", expected_graphs=40)
    apply_config, seen = compile_config(), {}

    def background() -> None:
        seen["before"] = torch._dynamo.config.recompile_limit
        apply_config()
        seen["after"] = torch._dynamo.config.recompile_limit

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen == {"before": 8, "after": torch._dynamo.config.recompile_limit} and seen["after"] >= 48


def refused(module: torch.nn.Module, *inputs: torch.Tensor, match: str) -> None:
    compiled, _ = compile_static(module, "eager", expected_graphs=1)
    with pytest.raises(Exception, match=match) as error:
        compiled(*inputs)
    assert isinstance(error.value, NeuronCompileError) or "NeuronCompileError" in repr(error.value)


def test_float64_inputs_and_float64_math_are_refused():
    refused(Scale(), torch.ones(4, dtype=torch.float64), match="float64")

    class Upcast(torch.nn.Module):
        def forward(self, x):
            return (x.double() * 2).float()

    refused(Upcast(), torch.ones(4), match="float64")


def test_non_contiguous_inputs_are_refused():
    refused(Scale(), torch.ones(4, 6).t(), match="not contiguous")


def test_symbolic_shapes_are_refused():
    recorder = CompileRecorder("eager")
    compiled = torch.compile(Scale(), backend=recorder, dynamic=True, fullgraph=True)
    with pytest.raises(Exception, match="static shapes"):
        compiled(torch.ones(4))


def test_graph_breaks_are_refused():
    class Breaks(torch.nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x + 1

    compiled, _ = compile_static(Breaks(), "eager", expected_graphs=1)
    with pytest.raises(Exception, match="graph_break|Graph break"):
        compiled(torch.ones(4))


def test_backend_none_runs_uncompiled():
    module = Scale()
    compiled, recorder = compile_static(module, "none", expected_graphs=1)
    assert compiled is module and recorder.num_graphs == 0
