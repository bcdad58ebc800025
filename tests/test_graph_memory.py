"""The graph reserve derived from lowered graphs (vllm_neuron/compiler/graph_memory.py): each graph's
scratchpad estimate grows with its shapes, the reserve follows the documented rule (largest scratchpad in
pages, plus per graph, plus the runtime), and start-up takes the user's setting, else a recorded derivation,
else the cold default; a reserve below the derived need is named."""

import pytest
import torch

from tests.conftest import EXPECTED_GRAPHS, model_runner
from vllm_neuron import trn2
from vllm_neuron.compiler import graph_memory
from vllm_neuron.compiler.graph_memory import MIB, PER_GRAPH_BYTES, RUNTIME_BYTES
from vllm_neuron.compiler.stablehlo import StableHLOBackend

# Two f32 [4, 8] intermediates live at once (%0 until %2 reads it), the output and a reshape not counted.
MODULE = """module {
  func.func @main(%arg0: tensor<4x8xf32>) -> (tensor<32xf32>) {
    %0 = stablehlo.exponential %arg0 : tensor<4x8xf32>
    %1 = stablehlo.negate %0 : tensor<4x8xf32>
    %2 = stablehlo.add %0, %1 : tensor<4x8xf32>
    %3 = stablehlo.convert %2 : (tensor<4x8xf32>) -> tensor<4x8xbf16>
    %4 = stablehlo.reshape %3 : (tensor<4x8xbf16>) -> tensor<32xbf16>
    %5 = stablehlo.convert %4 : (tensor<32xbf16>) -> tensor<32xf32>
    return %5 : tensor<32xf32>
  }
}
"""


def test_the_scratchpad_is_the_peak_of_live_intermediates():
    # At %2: %0, %1 and %2 are live (3 x 128 bytes); then %0, %1 freed, %3 (bf16, 64 bytes) beside %2.
    assert graph_memory.scratchpad_bytes(MODULE) == 3 * 4 * 8 * 4


class Projection(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, 4 * width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.relu(x @ self.weight) * 2).sum(-1)


def lowered_scratchpad(tokens: int, width: int) -> int:
    backend = StableHLOBackend(execute="none")
    with torch.no_grad():
        torch.compile(Projection(width), backend=backend, fullgraph=True, dynamic=False)(
            torch.randn(tokens, width)
        )
    (graph,) = backend.graphs
    assert graph.summary()["scratchpad_bytes"] == graph.scratchpad_bytes
    return graph.scratchpad_bytes


def test_a_larger_graph_needs_a_larger_scratchpad():
    # Three [tokens, 4 x width] f32 intermediates at once: the ReLU, the 2 broadcast to its shape, their
    # product (neuronx-cc may fuse them; the StableHLO makes each).
    assert lowered_scratchpad(16, 8) == 3 * 16 * 32 * 4
    assert lowered_scratchpad(64, 8) == 4 * lowered_scratchpad(16, 8)


def graphs(*scratchpads: int) -> list[dict[str, object]]:
    return [{"call": f"call {i}", "scratchpad_bytes": size} for i, size in enumerate(scratchpads)]


def test_the_reserve_is_the_largest_scratchpad_in_pages_plus_each_graph_plus_the_runtime(monkeypatch):
    monkeypatch.delenv("NEURON_SCRATCHPAD_PAGE_SIZE", raising=False)
    derived = graph_memory.derive(graphs(10 * MIB, 700 * MIB, 3 * MIB))
    assert (derived.largest_call, derived.largest_scratchpad, derived.scratchpad) == (
        "call 1",
        700 * MIB,
        1024 * MIB,
    )
    assert derived.total == 1024 * MIB + 3 * PER_GRAPH_BYTES + RUNTIME_BYTES
    assert graph_memory.derive(graphs(10 * MIB) * 20).total > graph_memory.derive(graphs(10 * MIB) * 10).total
    monkeypatch.setenv("NEURON_SCRATCHPAD_PAGE_SIZE", "64")  # MB, as the runtime reads it
    assert graph_memory.derive(graphs(700 * MIB)).scratchpad == 704 * MIB
    assert "700.0 MiB, call 0, in 64 MiB pages" in graph_memory.derive(graphs(700 * MIB)).describe()


FIELDS = {"model": "tiny", "max_model_len": 256, "device_mode": "cpu", "versions": {"torch": "x"}}


def test_start_up_takes_the_setting_else_the_recorded_derivation_else_the_cold_default(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("VLLM_NEURON_GRAPH_RESERVE_BYTES", raising=False)
    cold = graph_memory.planned(FIELDS)
    assert (cold.bytes, cold.source) == (trn2.COLD_GRAPH_RESERVE_BYTES, "cold default")

    derived = graph_memory.derive(graphs(100 * MIB, 30 * MIB))
    graph_memory.record(FIELDS, derived)
    # Recorded on a CPU, read by a Neuron host with other software: the host's fields are not the key's.
    on_trn2 = {**FIELDS, "device_mode": "neuron", "versions": {"torch-neuronx": "y"}}
    planned = graph_memory.planned(on_trn2)
    assert (planned.bytes, planned.source, planned.derived) == (derived.total, "derived", derived)
    assert graph_memory.planned({**FIELDS, "max_model_len": 512}).source == "cold default"

    monkeypatch.setenv("VLLM_NEURON_GRAPH_RESERVE_BYTES", str(5 * trn2.GIB))
    explicit = graph_memory.planned(on_trn2)
    assert (explicit.bytes, explicit.source) == (5 * trn2.GIB, "VLLM_NEURON_GRAPH_RESERVE_BYTES")


def test_a_reserve_below_the_derived_need_is_named_with_the_setting():
    derived = graph_memory.derive(graphs(4 * trn2.GIB))
    assert graph_memory.shortfall(graph_memory.Reserve(derived.total, "derived"), derived) is None
    cold = graph_memory.shortfall(
        graph_memory.Reserve(trn2.COLD_GRAPH_RESERVE_BYTES, "cold default"), derived
    )
    assert (
        "more than the 4.00 GiB reserved (cold default)" in cold and "VLLM_NEURON_KV_CACHE_FRACTION" in cold
    )
    explicit = graph_memory.shortfall(graph_memory.Reserve(trn2.GIB, graph_memory.EXPLICIT), derived)
    assert "VLLM_NEURON_GRAPH_RESERVE_BYTES is unset or raised" in explicit


@pytest.mark.slow
def test_the_engines_graphs_give_a_reserve_that_grows_with_the_prefill_bucket(llm):
    """The shared engine lowered every graph at warm-up: larger prefill buckets have larger scratchpads, and
    the reserve derived from them is recorded for its configuration."""
    runner = model_runner(llm)
    lowered = runner.lowered_graphs()
    assert len(lowered) == EXPECTED_GRAPHS and all(graph["scratchpad_bytes"] > 0 for graph in lowered)
    prefill = {graph.label: graph.scratchpad_bytes for graph in runner.recorder.lowering.graphs}
    prefill = [size for label, size in prefill.items() if label.startswith("prefill")]
    assert len(set(prefill)) > 1 and max(prefill) > min(prefill)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    assert graph_memory.recorded(worker.cache_fields) == graph_memory.derive(lowered)
