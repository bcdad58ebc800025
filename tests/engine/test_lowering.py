"""TorchNeuron's lowering route on a CPU (vllm_neuron.compiler.stablehlo): the KV write as one aliased
scatter, the decompositions, lowering failures that name their op, source line and call, and every warm-up
graph of the test engine lowered (float32 here, through the shared engine; bfloat16 in test_vllm_parity)."""

import inspect

import pytest
import torch

from kv_cache.layout import allocate
from kv_cache.ops import causal_attention, gather_blocks, write_kv
from tests.conftest import EXPECTED_GRAPHS, model_runner
from vllm_neuron.calls import Call
from vllm_neuron.compiler import hlo_text
from vllm_neuron.compiler.compile import CompileRecorder
from vllm_neuron.compiler.decompositions import decomposition_table
from vllm_neuron.compiler.stablehlo import StableHLOBackend

KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_SIZE, TOKENS = 2, 64, 4, 8, 6


class WriteThenRead(torch.nn.Module):
    """A layer's cache use in miniature: write the step's rows, then gather blocks that hold them."""

    def __init__(self, write) -> None:
        super().__init__()
        self.write = write
        self.register_buffer(
            "kv_cache", allocate(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, torch.float32, "cpu")
        )

    def forward(self, key, value, slots, blocks):
        self.write(self.kv_cache, key, value, slots)
        keys, values = gather_blocks(self.kv_cache, blocks)
        return keys.sum() + values.sum()


def whole_cache_write(kv_cache, key, value, slots):
    """The write the plugin had: index_copy_ into the keys and the values, a select_scatter of the whole
    cache."""
    copies, num_blocks, block_size, head_size = kv_cache.shape
    kv_heads, flat = copies // 2, num_blocks * block_size
    kv_cache[:kv_heads].view(kv_heads, flat, head_size).index_copy_(1, slots, key.transpose(0, 1))
    kv_cache[kv_heads:].view(kv_heads, flat, head_size).index_copy_(1, slots, value.transpose(0, 1))


def write_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(TOKENS, KV_HEADS, HEAD_SIZE, generator=gen)
    value = torch.randn(TOKENS, KV_HEADS, HEAD_SIZE, generator=gen)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE - BLOCK_SIZE, generator=gen)[:TOKENS] + BLOCK_SIZE
    blocks = torch.arange(1, 16).view(3, 5)
    return key, value, slots, blocks


def lower_module(write) -> tuple[StableHLOBackend, WriteThenRead, torch.Tensor]:
    backend = StableHLOBackend()
    module = WriteThenRead(write)
    out = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(*write_inputs())
    return backend, module, out


def test_kv_write_is_one_aliased_scatter_of_the_new_rows():
    backend, module, out = lower_module(write_kv)
    (graph,) = backend.graphs
    assert 'mhlo.input_output_alias = [{alias = {kind = "must_alias"' in graph.stablehlo
    (write,) = hlo_text.cache_writes(graph.stablehlo)
    assert write.shape == (2 * KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_SIZE)
    assert write.scatters == [(2 * KV_HEADS * TOKENS, HEAD_SIZE)]
    assert write.problems == []
    # The aliased output was stored into the cache, as the runtime's aliasing leaves it.
    eager = WriteThenRead(write_kv)
    expected = eager(*write_inputs())
    torch.testing.assert_close(module.kv_cache, eager.kv_cache)
    torch.testing.assert_close(out, expected)
    # The largest intermediate is the gathered context, not the cache the graph writes in place.
    assert graph.largest_tensor[0] == (2 * KV_HEADS * 3 * 5, BLOCK_SIZE * HEAD_SIZE)


def test_lower_only_lowers_the_graph_and_runs_nothing():
    """The `lower-only` backend (`vllm-neuron check`): the graph is lowered with its cache aliased, and the
    call returns zeros of its output's shape, leaving the cache as it was."""
    backend = StableHLOBackend(execute="none")
    module = WriteThenRead(write_kv)
    out = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(*write_inputs())
    (graph,) = backend.graphs
    assert graph.aliases and graph.op_count > 0
    assert out.shape == () and out.item() == 0
    assert not module.kv_cache.any()


class PassesThenRead(torch.nn.Module):
    """Two passes over one layer's cache, as an EAGLE3 head's propose call runs them: each writes its rows,
    then reads the cache it wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer(
            "kv_cache", allocate(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, torch.float32, "cpu")
        )

    def forward(self, key, value, slots, blocks):
        write_kv(self.kv_cache, key, value, slots)
        first = gather_blocks(self.kv_cache, blocks)[0].sum()
        write_kv(self.kv_cache, value, key, slots + 1)
        return first * gather_blocks(self.kv_cache, blocks)[1].sum()


def test_a_cache_written_once_a_pass_is_written_in_place():
    backend = StableHLOBackend()
    torch.compile(PassesThenRead(), backend=backend, fullgraph=True, dynamic=False)(*write_inputs())
    (write,) = hlo_text.cache_writes(backend.graphs[0].stablehlo)
    assert write.scatters == [(2 * KV_HEADS * TOKENS, HEAD_SIZE)] * 2
    assert write.problems == []


def test_a_whole_cache_write_is_named():
    backend, module, _ = lower_module(whole_cache_write)
    (write,) = hlo_text.cache_writes(backend.graphs[0].stablehlo)
    assert len(write.scatters) == 2
    assert any("a copy of a whole cache or half of one" in problem for problem in write.problems), (
        write.problems
    )
    eager = WriteThenRead(whole_cache_write)
    eager(*write_inputs())
    torch.testing.assert_close(module.kv_cache, eager.kv_cache)  # still right, only not in place


@pytest.mark.parametrize(
    ("op", "call"),
    [
        (torch.ops.aten.index_copy.default, lambda t, i, s: (t, 0, i, s)),
        (torch.ops.aten.index_put.default, lambda t, i, s: (t, [i], s)),
    ],
)
def test_scatter_decompositions_equal_torch(op, call):
    table = decomposition_table()
    target = torch.randn(10, 3, 4)
    index = torch.tensor([7, 2, 5])
    source = torch.randn(3, 3, 4)
    torch.testing.assert_close(table[op](*call(target, index, source)), op(*call(target, index, source)))


def test_as_strided_is_an_index_select_equal_to_torch():
    table = decomposition_table()
    source = torch.randn(6, 10)
    for size, stride, offset in [([6, 4], [10, 1], 0), ([6, 2, 3], [10, 3, 1], 4), ([3, 5], [20, 2], 1)]:
        expected = torch.as_strided(source, size, stride, offset)
        torch.testing.assert_close(
            table[torch.ops.aten.as_strided.default](source, size, stride, offset), expected
        )


def test_slice_scatter_to_the_end_is_clamped_and_equal_to_torch():
    table = decomposition_table()
    base, src = torch.randn(4, 16), torch.randn(4, 8)
    expected = torch.slice_scatter(base, src, 1, 8, 2**63 - 1)
    torch.testing.assert_close(
        table[torch.ops.aten.slice_scatter.default](base, src, 1, 8, 2**63 - 1), expected
    )
    assert table[torch.ops.aten.slice_scatter.default](base, src, 1, 8, 16) is NotImplemented


def test_as_strided_of_a_strided_view_is_an_index_select_equal_to_torch():
    """A chunk of a slice (MiniCPM3's rotary half of a projection): the strides address the base's storage."""
    table = decomposition_table()
    base = torch.randn(64, 24)
    view = base[:, 16:].view(64, 1, 8)  # strides (24, 8, 1), storage offset 16
    assert not view.is_contiguous()
    for size, stride, offset in [([64, 1, 4], [24, 8, 1], 16), ([64, 1, 4], [24, 8, 1], 20)]:
        expected = torch.as_strided(view, size, stride, offset)
        torch.testing.assert_close(
            table[torch.ops.aten.as_strided.default](view, size, stride, offset), expected
        )
    overlapping = torch.randn(8).as_strided([4, 4], [1, 1])
    assert table[torch.ops.aten.as_strided.default](overlapping, [2], [1], 0) is NotImplemented


def test_sdpa_lowers_as_the_neuron_dispatch_decomposes_it():
    table = decomposition_table()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    mask = torch.zeros(1, 1, 5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    out, _ = table[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default](
        q, k, v, attn_mask=mask
    )
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("tokens, window, flash", [(512, None, 1), (512, 100, 0), (64, None, 0)])
def test_a_fresh_chunk_lowers_to_the_attention_torchneurons_flash_kernel_takes(tokens, window, flash):
    """A fresh chunk's causal attention lowers (the causal flag's mask in the graph) and equals eager; the
    lowering counts it as TorchNeuron's flash kernel's where the kernel's rule holds (no window: no mask;
    lengths of whole 512-token tiles), and its [tokens, tokens] scores then are not the graph's largest
    intermediate: the kernel computes them in tiles."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(tokens, 4, 64, generator=gen)
    key, value = (torch.randn(tokens, 2, 64, generator=gen) for _ in range(2))

    def attend(query, key, value):
        return causal_attention(query, key, value, 0.125, window)

    backend = StableHLOBackend()
    out = torch.compile(attend, backend=backend, fullgraph=True, dynamic=False)(query, key, value)
    torch.testing.assert_close(out, attend(query, key, value), rtol=1e-5, atol=1e-5)
    (graph,) = backend.graphs
    assert graph.flash_attention == flash
    scores = [2, tokens * 2, tokens] if window else [4, tokens, tokens]  # as each form lays them out
    largest = list(graph.largest_tensor[0])
    assert (largest[-2:] != scores[-2:]) if flash else (largest[-2:] == scores[-2:])


def widening_dtype_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.float32) + 1  # bfloat16 [4, 6] as float32 [4, 3]: StableHLO has no such bitcast


def test_a_graph_that_does_not_lower_names_op_source_line_and_call():
    recorder = CompileRecorder("stablehlo")
    recorder.thread.call = Call.prefill(tokens=5, token_bucket=32, chunk_context=128)
    compiled = torch.compile(widening_dtype_view, backend=recorder, fullgraph=True, dynamic=False)
    with pytest.raises(Exception) as failure:
        compiled(torch.ones(4, 6, dtype=torch.bfloat16))
    message = str(failure.value)
    line = inspect.getsourcelines(widening_dtype_view)[1] + 1
    assert "does not lower to StableHLO" in message
    assert "view.dtype" in message
    assert f"test_lowering.py:{line} in widening_dtype_view" in message
    assert "prefill of 5 tokens at 0: tokens 32 x context 128" in message


@pytest.mark.slow
def test_every_warm_up_graph_of_the_engine_lowers_with_the_cache_in_place(llm):
    """The shared engine runs the stablehlo backend (conftest): its warm-up lowered each bucket's graph."""
    runner = model_runner(llm)
    graphs = runner.recorder.lowering.graphs
    assert len(graphs) == EXPECTED_GRAPHS
    calls = [graph.label for graph in graphs]
    assert sum(call.startswith("prefill") for call in calls) == 4
    assert sum(call.startswith("fresh prefill") for call in calls) == 1
    assert sum("with prefill" in call for call in calls) == 4  # the mixed calls
    layers, kv_heads = len(runner.kv_cache.tensors), runner.kv_cache.tensors[0].shape[0] // 2
    for graph in graphs:
        # neuronx-cc's rules hold (no sort wider than it takes, no argmax's reduce); XLA's preparation made
        # the sampler's sort and slice a top-k (compiler/top_k.py), as neuronx-cc does.
        assert graph.broken_rules == [], graph.label
        assert graph.xla_stablehlo.count("chlo.top_k") == graph.op_histogram["stablehlo.sort"] == 1, (
            graph.label
        )
        # Every cache (and the token slots) written in place, found by TorchNeuron's analysis.
        assert sorted(a.parameter for a in graph.aliases) == sorted(a.parameter for a in graph.written)
        writes = hlo_text.cache_writes(graph.stablehlo)
        assert len(writes) == layers, graph.label
        for write in writes:
            assert write.problems == [], (graph.label, write.problems)
            (updates,) = write.scatters
            # Only the call's new rows: at most a 64-token chunk and two decode rows (a mixed call).
            assert updates[0] <= 2 * kv_heads * (64 + 2), (graph.label, updates)
