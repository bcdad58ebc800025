"""The `xla` backend: XLA compiles each lowered graph's plain StableHLO and runs it, the KV cache updated in
place in memory XLA owns. These tests also pin the parts of jax/jaxlib vllm_neuron/compiler/xla.py uses that
are not public API: a jax upgrade that moves them fails here first."""

import pytest
import torch

from kv_cache.layout import allocate
from kv_cache.ops import write_kv
from tests.conftest import EXPECTED_GRAPHS, model_runner
from tests.engine.test_lowering import BLOCK_SIZE, BLOCKS, HEAD_SIZE, KV_HEADS, WriteThenRead, write_inputs
from vllm_neuron.compiler import xla
from vllm_neuron.compiler.stablehlo import StableHLOBackend
from vllm_neuron.compiler.xla_graph import cache_buffers, compile_graph

_SCATTER = """module attributes {mhlo.input_output_alias = [{alias = {kind = "must_alias", parameter_index = \
array<i64>, parameter_number = 0 : i64}, output_index = array<i64: 1>}]} {
  func.func @main(%arg0: tensor<64x8xf32>, %arg1: tensor<2x1xi64>, %arg2: tensor<2x8xf32>) -> \
(tensor<2x8xf32>, tensor<64x8xf32>) {
    %0 = "stablehlo.scatter"(%arg0, %arg1, %arg2) <{indices_are_sorted = false, scatter_dimension_numbers = \
#stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], \
index_vector_dim = 1>, unique_indices = false}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      stablehlo.return %b : tensor<f32>
    }) : (tensor<64x8xf32>, tensor<2x1xi64>, tensor<2x8xf32>) -> tensor<64x8xf32>
    %1 = stablehlo.add %arg2, %arg2 : tensor<2x8xf32>
    return %1, %0 : tensor<2x8xf32>, tensor<64x8xf32>
  }
}"""


def test_a_program_updates_an_xla_owned_cache_in_place_and_reports_its_buffers():
    """The pinned surface: compile_and_load, execute_sharded, memory stats, cost analysis, optimised HLO."""
    program = xla.compile(_SCATTER, {0: 1})
    cache = xla.allocate_zeros((64, 8), torch.float32)
    address = cache.data_ptr()
    rows, updates = torch.tensor([[3], [60]]), torch.randn(2, 8)
    for _ in range(2):  # the cache comes back at the same address each call
        (doubled,) = program.run([cache, rows, updates])
    torch.testing.assert_close(doubled, updates * 2)
    torch.testing.assert_close(cache[[3, 60]], updates)
    assert cache.data_ptr() == address and cache.sum() == updates.sum()
    assert program.memory.alias == 64 * 8 * 4 and program.memory.temp < 64 * 8 * 4
    assert program.cost.bytes_accessed > 0
    (write,) = cache_buffers(program.optimized_hlo, {64 * 8})
    assert "scatter" in write


def test_a_bfloat16_cache_xlas_cpu_compiler_converts_around_its_write_is_reported_not_in_place():
    """XLA's CPU compiler has no bfloat16 scatter: it converts the whole cache to float32 and back around the
    write, on every call. Aliased all the same, so only the optimised HLO's buffers show it."""
    caches = [torch.zeros(64, 8, dtype=torch.bfloat16)]
    _, report = compile_graph(_SCATTER.replace("f32", "bf16"), {0: 1}, [*caches, None, None])
    assert report.memory.alias == 64 * 8 * 2
    assert any(problem.startswith("converts a cache") for problem in report.problems), report.problems
    assert report.summary()["caches_in_place"] is False


def test_a_cache_xla_does_not_own_is_refused_not_copied():
    """A torch-owned cache would be copied by XLA (PJRT does not update memory it does not own in place)."""
    program = xla.compile(_SCATTER, {0: 1})
    with pytest.raises(xla.CacheNotOwnedError, match="allocate it"):
        program.run([torch.zeros(64, 8), torch.tensor([[3], [6]]), torch.randn(2, 8)])


def test_buffers_of_a_caches_size_are_found_in_the_optimised_entry_computation():
    hlo = (
        "%fused (p: f32[512,8]) -> f32[512,8] {\n  %copy.1 = f32[512,8]{1,0} copy(%p)\n}\n\n"
        "ENTRY %main (a: f32[2,4,64,8]) -> f32[2,4,64,8] {\n"
        "  %a = f32[2,4,64,8]{3,2,1,0} parameter(0)\n"
        "  %b = f32[512,8]{1,0} bitcast(%a)\n"
        "  %copy.3 = f32[2,4,64,8]{3,2,1,0} copy(%a), metadata={x}\n"
        "  %copy.4 = f32[4,8]{1,0} copy(%q)\n"
        "  %d = bf16[2,4,64,8]{3,2,1,0} convert(%a)\n"
        "  ROOT %w = f32[512,8]{1,0} fusion(%b), kind=kLoop\n"
        "}\n"
    )
    found = cache_buffers(hlo, {2 * 4 * 64 * 8})
    assert found == [
        "%copy.3 = f32[2,4,64,8]{3,2,1,0} copy(%a)",
        "%d = bf16[2,4,64,8]{3,2,1,0} convert(%a)",
        "ROOT %w = f32[512,8]{1,0} fusion(%b), kind=kLoop",
    ]


class XlaWriteThenRead(WriteThenRead):
    def __init__(self) -> None:
        super().__init__(write_kv)
        self.kv_cache = allocate(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, torch.float32, "cpu", _xla_zeros)


def _xla_zeros(shape, dtype, device):
    return xla.allocate_zeros(shape, dtype)


def test_the_lowered_graph_runs_through_xla_with_the_cache_in_place():
    backend = StableHLOBackend(execute="xla")
    module = XlaWriteThenRead()
    address = module.kv_cache.data_ptr()
    out = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(*write_inputs())
    eager = WriteThenRead(write_kv)
    expected = eager(*write_inputs())
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(module.kv_cache, eager.kv_cache)
    assert module.kv_cache.data_ptr() == address
    (graph,) = backend.graphs
    assert graph.compiled is not None and graph.compiled.problems == []
    assert graph.summary()["caches_in_place"] is True
    assert "arith." not in graph.stablehlo and "tensor.empty" not in graph.stablehlo


class TransposedWeight(torch.nn.Module):
    """A weight kept as a transposed view, as vLLM's FP8 linear methods keep theirs (weight.t())."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 16).t(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_a_strided_input_reaches_xla_as_its_values_not_its_memory():
    module, backend = TransposedWeight(), StableHLOBackend(execute="xla")
    x = torch.randn(4, 16)
    assert not module.weight.is_contiguous()
    torch.testing.assert_close(torch.compile(module, backend=backend, fullgraph=True)(x), module(x))
    (graph,) = backend.graphs
    assert module.weight.data_ptr() in graph.program.copied_inputs.values()


@pytest.mark.slow
def test_every_warm_up_graph_of_the_engine_runs_through_xla_with_its_caches_in_place(llm):
    """The shared engine runs the xla backend (tests/environment.py): for every warm-up graph, XLA aliases
    every layer's cache, needs no temporary as large as one, and copies none in its optimised HLO."""
    runner = model_runner(llm)
    graphs = runner.recorder.lowering.graphs
    assert len(graphs) == EXPECTED_GRAPHS
    layer_bytes = runner.kv_cache.tensors[0].numel() * runner.kv_cache.tensors[0].element_size()
    weights = {parameter.data_ptr() for parameter in runner.model.parameters()}
    for graph in graphs:
        compiled = graph.compiled
        assert compiled is not None, graph.label
        assert compiled.problems == [], (graph.label, compiled.problems)
        assert compiled.memory.alias >= layer_bytes * len(runner.kv_cache.tensors)
        assert compiled.memory.temp < layer_bytes
        assert compiled.cost.flops > 0
        # Weights reached XLA as views of the engine's tensors, never copied per call.
        assert weights.isdisjoint(graph.program.copied_inputs.values()), graph.label


def test_a_compiled_module_is_kept_in_the_compile_cache_folder_and_loaded_from_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_XLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(xla, "_executables", {})  # as a new process starts
    compiled = xla.compile(_SCATTER, {0: 1})
    (kept,) = tmp_path.iterdir()
    monkeypatch.setattr(xla, "_executables", {})
    program = xla.compile(_SCATTER, {0: 1})  # loaded from the folder
    assert list(tmp_path.iterdir()) == [kept]
    cache = xla.allocate_zeros((64, 8), torch.float32)
    updates = torch.randn(2, 8)
    (doubled,) = program.run([cache, torch.tensor([[3], [60]]), updates])
    torch.testing.assert_close(doubled, updates * 2)
    torch.testing.assert_close(cache[[3, 60]], updates)
    # The size the graph reserve counts for the executable, compiled, loaded, or reused in the process, is
    # the file's.
    reused = xla.compile(_SCATTER, {0: 1})
    sizes = {compiled.serialized_bytes, program.serialized_bytes, reused.serialized_bytes}
    assert sizes == {kept.stat().st_size} and kept.stat().st_size > 0
