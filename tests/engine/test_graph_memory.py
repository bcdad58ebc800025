"""The graph reserve derived from lowered graphs (vllm_neuron/compiler/graph_memory.py): each graph's
scratchpad estimate grows with its shapes, the reserve follows the documented rule (largest scratchpad in
pages, plus per graph, plus the runtime) with the calls' inputs and outputs in flight and their staging
buffers beside it, each graph's size is what the compiler wrote once it compiled, and start-up takes the
user's setting, else a recorded derivation (old records too), else the cold default; a reserve below the
derived need is named."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ENGINE_KWARGS, EXPECTED_GRAPHS, model_runner
from tests.helpers import engine_config
from vllm_neuron import trn2
from vllm_neuron.calls import most_calls_per_step
from vllm_neuron.compiler import compile_cache, graph_memory
from vllm_neuron.compiler.graph_memory import MIB, PER_GRAPH_BYTES, RUNTIME_BYTES
from vllm_neuron.compiler.stablehlo import StableHLOBackend
from worker import neuron_worker
from worker.neuron_worker import NeuronWorker

CALLS = 6  # calls a step makes at most, for the reserves derived here

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


def graphs(*scratchpads: int, inputs: int = 0, outputs: int = 0) -> list[dict[str, object]]:
    return [
        {"call": f"call {i}", "scratchpad_bytes": size, "input_bytes": inputs, "output_bytes": outputs}
        for i, size in enumerate(scratchpads)
    ]


def test_the_reserve_is_the_largest_scratchpad_in_pages_plus_each_graph_plus_the_runtime(monkeypatch):
    monkeypatch.delenv("NEURON_SCRATCHPAD_PAGE_SIZE", raising=False)
    derived = graph_memory.derive(graphs(10 * MIB, 700 * MIB, 3 * MIB), CALLS)
    assert (derived.largest_call, derived.largest_scratchpad, derived.scratchpad) == (
        "call 1",
        700 * MIB,
        1024 * MIB,
    )
    assert derived.total == 1024 * MIB + 3 * PER_GRAPH_BYTES + RUNTIME_BYTES
    assert (
        graph_memory.derive(graphs(10 * MIB) * 20, CALLS).total
        > graph_memory.derive(graphs(10 * MIB) * 10, CALLS).total
    )
    monkeypatch.setenv("NEURON_SCRATCHPAD_PAGE_SIZE", "64")  # MB, as the runtime reads it
    assert graph_memory.derive(graphs(700 * MIB), CALLS).scratchpad == 704 * MIB
    assert "700.0 MiB, call 0, in 64 MiB pages" in graph_memory.derive(graphs(700 * MIB), CALLS).describe()


class LogitsAndCache(torch.nn.Module):
    """A call in miniature: its rows' logits from a weight (a parameter) and a scale (a buffer), and its rows
    written into a cache it is handed (an input it writes, as the KV caches and token slots are)."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, vocab))
        self.register_buffer("scale", torch.ones(vocab))

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, slots, x)
        return (x @ self.weight) * self.scale


def lowered_call(rows: int, vocab: int, width: int = 8) -> dict[str, object]:
    backend = StableHLOBackend(execute="none")
    with torch.no_grad():
        torch.compile(LogitsAndCache(width, vocab), backend=backend, fullgraph=True, dynamic=False)(
            torch.randn(rows, width), torch.arange(rows), torch.zeros(64, width)
        )
    (graph,) = backend.graphs
    return graph.summary()


def test_a_calls_inputs_and_outputs_are_its_own_not_the_models_state_nor_the_inputs_it_writes():
    call = lowered_call(rows=4, vocab=100)
    # x [4, 8] float32 and slots [4] int64 in; the logits [4, 100] float32 out. Not the weight, the scale, nor
    # the cache (nor its new value, returned first).
    assert (call["input_bytes"], call["output_bytes"]) == (4 * 8 * 4 + 4 * 8, 4 * 100 * 4)


def test_the_logits_of_the_calls_in_flight_raise_the_reserve(monkeypatch):
    monkeypatch.delenv("NEURON_SCRATCHPAD_PAGE_SIZE", raising=False)
    rows, vocab = 16, 32000
    narrow, wide = lowered_call(rows, vocab=8), lowered_call(rows, vocab=vocab)
    raised = graph_memory.derive([wide], CALLS).total - graph_memory.derive([narrow], CALLS).total
    # float32 logits of 16 rows, for each call of the two steps in flight (the one running and the one whose
    # outputs the engine has not taken); the inputs and the scratchpad's one page unchanged.
    assert raised == rows * (vocab - 8) * 4 * 2 * CALLS
    both = graph_memory.derive([narrow, wide], CALLS)
    assert (both.largest_outputs, both.largest_outputs_call) == (rows * vocab * 4, wide["call"])
    assert f"x 2 steps x {CALLS} calls" in both.describe()


def test_every_graphs_inputs_are_staged_once_per_calling_thread(monkeypatch):
    monkeypatch.delenv("NEURON_SCRATCHPAD_PAGE_SIZE", raising=False)
    summaries = [
        {"call": f"call {i}", "scratchpad_bytes": MIB, "input_bytes": size, "output_bytes": MIB}
        for i, size in enumerate((3 * MIB, MIB, 2 * MIB))
    ]
    derived = graph_memory.derive(summaries, CALLS, compile_workers=3)
    # The engine thread, the device thread and 3 compile workers each keep a buffer of every graph's inputs.
    assert derived.staging == 6 * MIB * 5
    # A call's inputs are read where they were staged: only its outputs are allocated per call in flight.
    assert derived.in_flight == MIB * 2 * CALLS
    assert derived.total == 512 * MIB + 3 * PER_GRAPH_BYTES + 30 * MIB + 12 * MIB + RUNTIME_BYTES
    # Where the host's compile workers are unknown (the check on a CPU): the most trn2 starts by default.
    assert graph_memory.derive(summaries, CALLS).calling_threads == 2 + 8


def test_a_configurations_calls_count_its_readiness_its_draft_model_and_its_steps_in_flight(tiny_model_dir):
    """derive_for: each configuration's most calls a step, steps in flight and calling threads."""
    few = {"prefill_buckets": [32, 64], "decode_batch_buckets": [1, 4], "context_buckets": [256]}
    base = dict(max_num_batched_tokens=96, additional_config=few)
    lowered = graphs(MIB, inputs=MIB, outputs=MIB)

    def derived(**overrides) -> graph_memory.GraphReserve:
        config = engine_config(tiny_model_dir, **base, **overrides)
        return graph_memory.derive_for(config, lowered, compile_workers=3)

    # One rank may stage its graphs: a step may find only the minimal ones (calls of 32 tokens, one row).
    plain = derived()
    assert (plain.calls_per_step, plain.steps_in_flight, plain.calling_threads) == (4 + 92 // 32, 2, 5)
    # A KV connector, or tensor parallelism, compiles every graph first: calls of 64 tokens, 4 rows; with
    # several ranks no compile worker sends calls.
    connector = derived(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"})
    assert (connector.calls_per_step, connector.calling_threads) == (4 + 92 // 64, 5)
    ranks = derived(tensor_parallel_size=2)
    assert (ranks.calls_per_step, ranks.calling_threads) == (4 + 92 // 64, 2)
    # A draft model of 2 tokens: beside each call of the model, then 2 passes over 4 rows a row a call; its
    # engine schedules without async scheduling, so one step is in flight.
    speculative = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 2}
    draft = derived(speculative_config=speculative)
    assert (draft.calls_per_step, draft.steps_in_flight) == (2 * (4 + 92 // 32) + 2 * 4, 1)
    assert draft.in_flight == MIB * (2 * (4 + 92 // 32) + 2 * 4)
    assert "x 1 steps x 20 calls" in draft.describe()


FIELDS = {"model": "tiny", "max_model_len": 256, "device_mode": "cpu", "versions": {"torch": "x"}}


def test_start_up_takes_the_setting_else_the_recorded_derivation_else_the_cold_default(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("VLLM_NEURON_GRAPH_RESERVE_BYTES", raising=False)
    cold = graph_memory.planned(FIELDS)
    assert (cold.bytes, cold.source) == (trn2.COLD_GRAPH_RESERVE_BYTES, "cold default")

    derived = graph_memory.derive(graphs(100 * MIB, 30 * MIB), CALLS)
    graph_memory.record(FIELDS, derived)
    # Recorded on a CPU, read by a Neuron host with other software: the host's fields are not the key's.
    on_trn2 = {**FIELDS, "device_mode": "neuron", "versions": {"torch-neuronx": "y"}}
    planned = graph_memory.planned(on_trn2)
    assert (planned.bytes, planned.source, planned.derived) == (derived.total, "derived", derived)
    assert graph_memory.planned({**FIELDS, "max_model_len": 512}).source == "cold default"

    monkeypatch.setenv("VLLM_NEURON_GRAPH_RESERVE_BYTES", str(5 * trn2.GIB))
    explicit = graph_memory.planned(on_trn2)
    assert (explicit.bytes, explicit.source) == (5 * trn2.GIB, "VLLM_NEURON_GRAPH_RESERVE_BYTES")


def test_a_record_written_before_the_io_terms_reads_with_its_own_terms(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("VLLM_NEURON_GRAPH_RESERVE_BYTES", raising=False)
    graph_memory.record(FIELDS, graph_memory.derive(graphs(10 * MIB), CALLS))
    path = tmp_path / "graph-reserve" / f"{compile_cache.configuration_key(FIELDS)}.json"
    assert path.is_file()
    old = {"graphs": 15, "largest_scratchpad": 600 * MIB, "largest_call": "prefill", "page": 512 * MIB}
    path.write_text(json.dumps(old))
    planned = graph_memory.planned(FIELDS)
    # Nearer the need than the cold default: its scratchpad, per-graph and runtime terms, no calls' outputs.
    assert (planned.source, planned.bytes) == ("derived", 1024 * MIB + 15 * PER_GRAPH_BYTES + RUNTIME_BYTES)
    assert planned.derived.in_flight == planned.derived.staging == 0
    path.write_text(json.dumps([15, 600]))
    assert graph_memory.planned(FIELDS).source == "cold default"


def test_the_compilers_product_replaces_the_estimate_and_a_trn2_start_takes_only_neffs(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("VLLM_NEURON_GRAPH_RESERVE_BYTES", raising=False)
    estimated = graph_memory.derive(graphs(100 * MIB, 30 * MIB, 10 * MIB), CALLS)
    compiled = estimated.with_compiled(900 * MIB, graph_memory.NEFF)  # aws-neuron-sdk#1210: NEFFs of ~800 MB
    # 900 MiB of NEFFs and the runtime's 4 MiB a graph, in place of 44 MiB a graph.
    assert compiled.total - estimated.total == 900 * MIB + 3 * 4 * MIB - 3 * 44 * MIB
    assert "3 graphs' NEFFs 900.0 MiB + 3 x 4 MiB" in compiled.describe()
    graph_memory.record(FIELDS, compiled)
    assert graph_memory.planned(FIELDS).bytes == compiled.total
    # A CPU's XLA executables are recorded, but say nothing of a NEFF: a trn2 start-up takes the estimate.
    on_cpu = {**FIELDS, "max_model_len": 512}
    graph_memory.record(on_cpu, estimated.with_compiled(MIB, graph_memory.XLA_EXECUTABLE))
    assert graph_memory.recorded(on_cpu).compiled == MIB
    assert graph_memory.planned(on_cpu).bytes == estimated.total


def test_a_derivation_recorded_after_a_trn2_start_keeps_its_neffs_size(tmp_path, monkeypatch):
    """`vllm-neuron check` run again, or a start that lowers (XLA's executables), after a trn2 start measured
    the NEFFs: the new derivation's terms, with the NEFFs in place of its per-graph estimate."""
    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("VLLM_NEURON_GRAPH_RESERVE_BYTES", raising=False)
    measured = graph_memory.derive(graphs(100 * MIB, 30 * MIB), CALLS).with_compiled(900 * MIB, "NEFF")
    graph_memory.record(FIELDS, measured)
    rederived = graph_memory.derive(graphs(100 * MIB, 30 * MIB, outputs=MIB), CALLS + 4)
    kept = graph_memory.record(FIELDS, rederived)
    assert kept == rederived.with_compiled(900 * MIB, graph_memory.NEFF) == graph_memory.recorded(FIELDS)
    assert graph_memory.planned(FIELDS).bytes == kept.total > measured.total
    assert graph_memory.record(FIELDS, rederived.with_compiled(MIB, graph_memory.XLA_EXECUTABLE)) == kept
    # A newer measurement replaces the older.
    assert graph_memory.record(FIELDS, measured.with_compiled(800 * MIB, "NEFF")).compiled == 800 * MIB


def test_after_warm_up_on_trainium_the_neffs_replace_the_estimate_for_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("VLLM_NEURON_GRAPH_RESERVE_BYTES", raising=False)
    neffs = tmp_path / "neff"  # TorchNeuron's cache: ab/cd/<key>.neff
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(neffs))
    for name, size in (("ab/cd/1.neff", 3 * MIB), ("ab/ef/2.neff", 5 * MIB), ("ab/cd/1.lock", 100)):
        (neffs / name).parent.mkdir(parents=True, exist_ok=True)
        (neffs / name).write_bytes(b"\0" * size)
    assert compile_cache.neff_bytes() == 8 * MIB
    checked = graph_memory.derive(graphs(100 * MIB, 30 * MIB), CALLS)  # `vllm-neuron check`'s, on a CPU
    graph_memory.record(FIELDS, checked)
    # The `neuron` backend lowers nothing here: the worker takes the check's derivation and the NEFFs.
    worker = NeuronWorker.__new__(NeuronWorker)
    worker.vllm_config, worker.cache_fields = SimpleNamespace(), FIELDS
    worker.graph_reserve = graph_memory.planned(FIELDS)
    worker.model_runner = SimpleNamespace(
        compile_progress=lambda: {"graphs_pending": 0}, lowered_graphs=lambda: []
    )
    monkeypatch.setattr(neuron_worker.NeuronConfig, "of", lambda _: SimpleNamespace(compile_backend="neuron"))
    worker._derive_graph_reserve()
    assert graph_memory.planned(FIELDS).bytes == checked.total - 2 * 44 * MIB + 8 * MIB + 2 * 4 * MIB
    # Before any NEFF is written (or with a backend that writes none), the estimate stays.
    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path / "other-root"))
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "empty"))
    graph_memory.record(FIELDS, checked)
    worker._derive_graph_reserve()
    assert graph_memory.planned(FIELDS).bytes == checked.total


def test_a_reserve_below_the_derived_need_is_named_with_the_setting():
    derived = graph_memory.derive(graphs(4 * trn2.GIB), CALLS)
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
    # At most 4 requests a step, and 96 - 4 tokens more in calls of the smallest prefill bucket, 32.
    scheduled = (ENGINE_KWARGS["max_num_seqs"], ENGINE_KWARGS["max_num_batched_tokens"])
    assert most_calls_per_step(runner.buckets, *scheduled, staged=True) == 4 + 92 // 32
    steps = 2 if worker.vllm_config.scheduler_config.async_scheduling else 1
    derived = graph_memory.derive(lowered, 4 + 92 // 32, runner.readiness.compile_workers, steps)
    # Under `xla` the graphs' size is their executables' (test_xla: the files the compile cache keeps).
    executables = sum(graph.program.serialized_bytes for graph in runner.recorder.lowering.graphs)
    assert executables > 0
    assert graph_memory.recorded(worker.cache_fields) == derived.with_compiled(
        executables, graph_memory.XLA_EXECUTABLE
    )
    # Every call returns its rows' logits in float32, at least, and nothing that grows with its context (the
    # masks its layers share stay in the graph): the prefill calls keep 8 rows each, whatever their shape, a
    # decode call its batch over any context.
    vocab = runner.model_config.get_vocab_size()
    assert all(graph["output_bytes"] >= vocab * 4 for graph in lowered)
    outputs: dict[str, set[int]] = {}
    for graph in lowered:
        decode = re.fullmatch(r"decode of \d+ requests: (batch \d+) x context \d+", graph["call"])
        rows = decode.group(1) if decode else "prefill" if "prefill" in graph["call"].split(":")[0] else None
        outputs.setdefault(rows, set()).add(graph["output_bytes"])
    assert {"prefill", "batch 1", "batch 2", "batch 4"} <= outputs.keys()
    assert all(len(sizes) == 1 for rows, sizes in outputs.items() if rows is not None), outputs
