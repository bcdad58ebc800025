"""The kernel seam (kv_cache/kernels.py): the neuron_kv ops equal their torch references, their fakes agree
with them, a layer on TorchNeuron's route calls the references and TorchNeuron's aliasing analysis finds its
cache written (one aliased scatter), inductor keeps the ops and equals the direct calls, and `nki` is refused
by name while no NKI kernel is bound; on a trn2, the selected kernels against the references and naive
attention."""

from types import SimpleNamespace

import pytest
import torch

from kv_cache import kernels, ops
from kv_cache.layout import allocate
from vllm_neuron.compiler import hlo_text
from vllm_neuron.compiler.compile import CompileRecorder, compile_static

KV_HEADS, HEADS, BLOCKS, BLOCK_SIZE, HEAD_SIZE = 2, 4, 32, 4, 8
ROWS, CHUNK, PAGES, PAGE_BLOCKS = 2, 4, 4, 2
SCALE = HEAD_SIZE**-0.5


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """A step in miniature: a prefill chunk of ROWS rows and ROWS decode rows over PAGES pages."""
    gen = torch.Generator().manual_seed(seed)
    tokens = ROWS * CHUNK + ROWS
    positions = torch.arange(CHUNK).repeat(ROWS, 1) + 4
    return {
        "key": torch.randn(tokens, KV_HEADS, HEAD_SIZE, generator=gen),
        "value": torch.randn(tokens, KV_HEADS, HEAD_SIZE, generator=gen),
        "slots": torch.randperm(BLOCKS * BLOCK_SIZE - BLOCK_SIZE, generator=gen)[:tokens] + BLOCK_SIZE,
        "table_query": torch.randn(ROWS, CHUNK, HEADS, HEAD_SIZE, generator=gen),
        "block_table": torch.arange(1, 1 + ROWS * 3).view(ROWS, 3),
        "table_positions": positions,
        "page_query": torch.randn(ROWS, HEADS, HEAD_SIZE, generator=gen),
        "page_blocks": torch.arange(10, 10 + PAGES * PAGE_BLOCKS).view(PAGES, PAGE_BLOCKS),
        "page_rows": torch.tensor([0, 0, 1, 1]),
        "page_starts": torch.tensor([0, 8, 0, 8]),
        "page_positions": torch.tensor([11, 13]),
    }


class Layer(torch.nn.Module):
    """An attention layer's use of the cache: the write, then both attentions, through `calls`."""

    def __init__(self, calls: kernels.Kernels, soft_cap: float | None = None) -> None:
        super().__init__()
        self.calls, self.soft_cap = calls, soft_cap
        self.register_buffer(
            "kv_cache", allocate(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, torch.float32, "cpu")
        )

    def forward(
        self,
        key,
        value,
        slots,
        table_query,
        block_table,
        table_positions,
        page_query,
        page_blocks,
        page_rows,
        page_starts,
        page_positions,
    ):
        self.calls.write_kv(self.kv_cache, key, value, slots)
        mask = ops.context_mask(
            table_positions, block_table.shape[1] * BLOCK_SIZE, HEADS // KV_HEADS, key.dtype
        )
        table = self.calls.table_attention(
            table_query, self.kv_cache, block_table, table_positions, SCALE, mask, self.soft_cap
        )
        masks = ops.page_masks(page_rows, page_starts, page_positions, PAGE_BLOCKS * BLOCK_SIZE)
        paged = self.calls.page_attention(
            page_query,
            self.kv_cache,
            page_blocks,
            page_rows,
            page_starts,
            page_positions,
            SCALE,
            masks.hidden,
            masks.owner,
            masks.ownership,
            self.soft_cap,
        )
        return table, paged


DIRECT = kernels.REFERENCES
OPS = kernels.select("torch", torchneuron_route=False)


@pytest.mark.parametrize("soft_cap", [None, 30.0])
def test_the_ops_equal_their_references(soft_cap):
    expected = Layer(DIRECT, soft_cap)
    got = Layer(OPS, soft_cap)
    for left, right in zip(got(**inputs()), expected(**inputs()), strict=True):
        assert torch.equal(left, right)
    assert torch.equal(got.kv_cache, expected.kv_cache)


def test_the_ops_fakes_and_schemas_pass_opcheck():
    args = inputs()
    cache = allocate(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, torch.float32, "cpu")
    torch.library.opcheck(kernels.write_kv, (cache, args["key"], args["value"], args["slots"]))
    masks = ops.page_masks(args["page_rows"], args["page_starts"], args["page_positions"], 8)
    torch.library.opcheck(
        kernels.table_attention,
        (args["table_query"], cache, args["block_table"], args["table_positions"], SCALE, None, None),
    )
    torch.library.opcheck(
        kernels.page_attention,
        (
            args["page_query"],
            cache,
            args["page_blocks"],
            args["page_rows"],
            args["page_starts"],
            args["page_positions"],
            SCALE,
            masks.hidden,
            masks.owner,
            masks.ownership,
            None,
        ),
    )


def test_on_torchneuron_s_route_the_cache_write_is_seen_and_aliased():
    """The references, called directly, leave dynamo's graph the in-place calls TorchNeuron's analysis reads
    before AOTAutograd: the cache is aliased in the module, written by one scatter, and equal to the ops'."""
    calls = kernels.select("torch", torchneuron_route=True)
    assert calls is DIRECT
    recorder = CompileRecorder("stablehlo")
    layer, expected = Layer(calls), Layer(OPS)
    out = torch.compile(layer, backend=recorder, fullgraph=True, dynamic=False)(**inputs())
    (graph,) = recorder.lowering.graphs
    cache_input = next(alias.parameter for alias in graph.written)
    assert [alias.parameter for alias in graph.aliases] == [cache_input]
    (write,) = hlo_text.cache_writes(graph.stablehlo)
    assert write.problems == [] and len(write.scatters) == 1
    for left, right in zip(out, expected(**inputs()), strict=True):
        torch.testing.assert_close(left, right)
    assert torch.equal(layer.kv_cache, expected.kv_cache)


def test_the_write_op_itself_is_seen_by_its_schema():
    """An op left in dynamo's graph (an NKI kernel's, one day) is read by its schema: `Tensor(a!) kv_cache`
    marks the cache written, which TorchNeuron's analysis takes as an in-place write."""
    from vllm_neuron.compiler import aliasing

    gm = torch.fx.symbolic_trace(lambda cache, key, value, slots: kernels.write_kv(cache, key, value, slots))
    assert aliasing.analyse(gm) == [aliasing.Alias(parameter=0, output=0)]


def test_nki_is_refused_by_name_with_what_to_change():
    message = kernels.refusal("nki")
    assert "VLLM_NEURON_ATTENTION_KERNELS=nki" in message
    assert "set VLLM_NEURON_ATTENTION_KERNELS=torch" in message
    with pytest.raises(ValueError, match="no NKI kernel is bound"):
        kernels.select("nki", torchneuron_route=True)
    assert kernels.refusal("torch") is None


def test_nki_is_refused_at_start_up(monkeypatch):
    from vllm_neuron.platform import NeuronPlatform
    from vllm_neuron.refusals import UnsupportedConfigError

    monkeypatch.setenv("VLLM_NEURON_ATTENTION_KERNELS", "nki")
    with pytest.raises(UnsupportedConfigError, match="Neuron plugin: VLLM_NEURON_ATTENTION_KERNELS=nki"):
        NeuronPlatform.check_and_update_config(SimpleNamespace(model_config=object()))


@pytest.mark.slow
def test_inductor_keeps_the_ops_and_equals_the_direct_calls(tmp_path, monkeypatch):
    """Inductor compiles in other processes, which find the ops by name (vllm_neuron/compiler/compile_pool.py)
    and run their references as extern calls: the outputs and the cache are bit for bit the direct calls'."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    layer, expected = Layer(OPS), Layer(DIRECT)
    compiled, recorder = compile_static(layer, "inductor", expected_graphs=1, compile_workers=1)
    try:
        with torch.no_grad():
            got, want = compiled(**inputs()), expected(**inputs())
    finally:
        recorder.close()
    for left, right in zip(got, want, strict=True):
        assert torch.equal(left, right)
    assert torch.equal(layer.kv_cache, expected.kv_cache)


def naive(args: dict[str, torch.Tensor], cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both attentions by ops.reference_attention, per row over its context laid out contiguously."""

    def over(blocks: torch.Tensor, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        keys, values = ops.gather_blocks(cache, blocks.reshape(1, -1))  # [kv_heads, 1, context, d]
        return ops.reference_attention(
            query, keys[:, 0].transpose(0, 1), values[:, 0].transpose(0, 1), positions, SCALE
        )

    table = [
        over(args["block_table"][r], args["table_query"][r], args["table_positions"][r]) for r in range(ROWS)
    ]
    paged = [
        over(
            args["page_blocks"][args["page_rows"] == r],
            args["page_query"][r : r + 1],
            args["page_positions"][r : r + 1],
        )
        for r in range(ROWS)
    ]
    return torch.stack(table), torch.cat(paged)


def test_the_references_equal_naive_attention():
    layer = Layer(OPS)
    table, paged = layer(**inputs())
    expected_table, expected_paged = naive(inputs(), layer.kv_cache)
    torch.testing.assert_close(table, expected_table)
    torch.testing.assert_close(paged, expected_paged)


@pytest.mark.neuron
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_selected_kernels_on_neuron_equal_the_reference_and_naive_attention(dtype):
    """The first trn2 run's check of the seam: the implementation VLLM_NEURON_ATTENTION_KERNELS selects, on
    the device, against the references on the CPU and against naive attention."""
    from vllm_neuron import envs

    args = {name: value.to(dtype) if value.is_floating_point() else value for name, value in inputs().items()}
    reference = Layer(DIRECT).to(dtype)
    expected = reference(**args)
    device = Layer(kernels.select(envs.VLLM_NEURON_ATTENTION_KERNELS, False)).to(dtype).to("neuron")
    got = device(**{name: value.to("neuron") for name, value in args.items()})
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(device.kv_cache.cpu(), reference.kv_cache)
    for left, right, slow in zip(got, expected, naive(args, reference.kv_cache), strict=True):
        torch.testing.assert_close(left.cpu(), right, **tolerance)
        torch.testing.assert_close(right, slow, **tolerance)


def test_an_ops_result_has_the_strides_its_fake_promises():
    """A single-row prefill chunk's attention is a permuted view in plain torch; the op returns it dense, as
    its fake does: inductor checks the op's output strides against the fake's (a warm-up graph failed so)."""
    query = torch.randn(1, 64, HEADS, HEAD_SIZE)
    kv_cache = torch.randn(2 * KV_HEADS, 10, BLOCK_SIZE, HEAD_SIZE)
    block_table = torch.arange(1, 7).view(1, 6)
    positions = torch.arange(64).view(1, 64) % (6 * BLOCK_SIZE)
    direct = ops.table_attention(query, kv_cache, block_table, positions, SCALE)
    assert not direct.is_contiguous()  # what the op must not hand on
    out = kernels.table_attention(query, kv_cache, block_table, positions, SCALE, None, None)
    assert out.is_contiguous() and out.stride() == query.new_empty(query.shape).stride()
    assert torch.equal(out, direct)
