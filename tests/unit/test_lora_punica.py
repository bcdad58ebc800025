"""The Neuron punica wrapper (vllm_neuron/lora/punica.py) against a per-token reference: mixed slots with the
base model among them, ranks below the maximum, one to three slices, logits rows and the embedding; then the
ops in one static graph on the `stablehlo` backend, the slots an input and the slot weights written in place
without a recompile. tests/unit/test_upstream.py pins the vLLM 0.32 seam the wrapper relies on."""

import pytest
import torch
from vllm.forward_context import ForwardContext
from vllm.utils.import_utils import resolve_obj_by_qualname

from vllm_neuron.compiler.stablehlo import StableHLOBackend
from vllm_neuron.lora.punica import LORA_ROWS, LORA_SLOTS, NeuronPunicaWrapper
from vllm_neuron.platform import NeuronPlatform
from vllm_neuron.upstream.vllm_runner import override_forward_context

NUM_SLOTS, MAX_RANK, HIDDEN, SCALE = 3, 4, 16, 0.5
SLOTS = torch.tensor([0, 1, 2, 3, 0, 2, 1, 3, 0])  # 0 = base; padding tokens are 0 too
RANKS = (
    4,
    2,
    3,
)  # slot k's adapter rank; the stacked weights are zero past it, as vLLM's set_lora leaves them
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)]


def context(slots: torch.Tensor, rows: torch.Tensor | None = None) -> ForwardContext:
    kwargs = {LORA_SLOTS: slots, LORA_ROWS: slots if rows is None else rows}
    return ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}, additional_kwargs=kwargs)


def stacked(out: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One slice's A [S, 1, r, in] and B [S, 1, out, r], each slot's rank zero-padded to MAX_RANK."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(NUM_SLOTS, 1, MAX_RANK, HIDDEN, generator=gen) * 0.3
    b = torch.randn(NUM_SLOTS, 1, out, MAX_RANK, generator=gen) * 0.3
    for slot, rank in enumerate(RANKS):
        a[slot, :, rank:] = 0
        b[slot, :, :, rank:] = 0
    return a.to(dtype), b.to(dtype)


def reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """scale * B[slot] A[slot] x per token in float64, nothing for slot 0."""
    out = torch.zeros(x.shape[0], b.shape[2], dtype=torch.float64)
    for t, slot in enumerate(slots.tolist()):
        if slot:
            out[t] = SCALE * b[slot - 1, 0].double() @ (a[slot - 1, 0].double() @ x[t].double())
    return out


def inputs(rows: int, out: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(rows, HIDDEN, generator=gen).to(dtype), torch.randn(rows, out, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("output_slices", [(8,), (8, 8), (8, 4, 4)])
def test_add_lora_linear_matches_the_per_token_reference(dtype, tol, output_slices):
    weights = [stacked(out, dtype, seed) for seed, out in enumerate(output_slices)]
    x, y = inputs(len(SLOTS), sum(output_slices), dtype)
    expected = y.double() + torch.cat([reference(x, a, b, SLOTS) for a, b in weights], dim=1)
    with override_forward_context(context(SLOTS)):
        NeuronPunicaWrapper(64, 4, "cpu").add_lora_linear(
            y, x, tuple(a for a, _ in weights), tuple(b for _, b in weights), SCALE, output_slices
        )
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_shrink_then_expand_matches_the_reference(dtype, tol):
    output_slices = (8, 4)
    weights = [stacked(out, dtype, seed) for seed, out in enumerate(output_slices)]
    x, y = inputs(len(SLOTS), sum(output_slices) + 3, dtype)
    expected = y.double().clone()
    expected[:, 3:] += torch.cat([reference(x, a, b, SLOTS) for a, b in weights], dim=1)
    buffers = tuple(torch.full((len(SLOTS), MAX_RANK), 9.0) for _ in output_slices)
    wrapper = NeuronPunicaWrapper(64, 4, "cpu")
    with override_forward_context(context(SLOTS)):
        wrapper.add_shrink(buffers, x, tuple(a for a, _ in weights), SCALE)
        wrapper.add_expand(y, buffers, tuple(b for _, b in weights), output_slices, offset_start=3)
    # The base tokens' buffer rows are written to zero, not left as they were.
    assert all(buffer[SLOTS == 0].eq(0).all() for buffer in buffers)
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_add_lora_logits_uses_the_logits_rows_slots(dtype, tol):
    vocab, rows = 24, torch.tensor([2, 0, 3, 1])
    a, b = stacked(vocab + 4, dtype, 3)  # vLLM's B can be wider than the logits: the extra columns drop
    x, y = inputs(len(rows), vocab, dtype)
    expected = y.double() + reference(x, a, b, rows)[:, :vocab]
    with override_forward_context(context(SLOTS, rows)):
        NeuronPunicaWrapper(64, 4, "cpu").add_lora_logits(y, x, a, b, SCALE)
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_embedding_offsets_and_expand(dtype, tol):
    vocab, dim = 10, 12
    _, b = stacked(dim, dtype, 4)
    wrapper = NeuronPunicaWrapper(64, 4, "cpu")
    wrapper.update_metadata(None, [None] * NUM_SLOTS, NUM_SLOTS + 1, vocab)
    gen = torch.Generator().manual_seed(5)
    lora_a = torch.randn(len(SLOTS), MAX_RANK, generator=gen).to(dtype)  # the rows the layer looked up
    y = torch.randn(len(SLOTS), dim, generator=gen).to(dtype)
    expected = y.double().clone()
    for t, slot in enumerate(SLOTS.tolist()):
        if slot:
            expected[t] += b[slot - 1, 0].double() @ lora_a[t].double()
    with override_forward_context(context(SLOTS)):
        offsets = wrapper._embeddings_indices
        wrapper.add_lora_embedding(y, lora_a, b)
    # A base token looks up slot 0's table (its row is then masked), never an index past the table.
    assert offsets.tolist() == [max(slot - 1, 0) * vocab for slot in SLOTS.tolist()]
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)


def test_a_base_only_call_leaves_the_output_exactly_as_it_was():
    weights = [stacked(8, torch.bfloat16, 0)]
    slots = torch.zeros(len(SLOTS), dtype=torch.long)
    x, y = inputs(len(slots), 8, torch.bfloat16)
    before = y.clone()
    with override_forward_context(context(slots)):
        NeuronPunicaWrapper(64, 4, "cpu").add_lora_linear(
            y, x, (weights[0][0],), (weights[0][1],), SCALE, (8,)
        )
    assert torch.equal(y, before)


class LoRALinear(torch.nn.Module):
    """A base linear with a 2-slice LoRA, as vLLM's layers call the wrapper; the stacked weights are plain
    attributes, as vLLM keeps them."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(12, HIDDEN).to(dtype), requires_grad=False)
        pairs = [stacked(6, dtype, seed) for seed in range(2)]
        self.lora_a_stacked = tuple(a for a, _ in pairs)
        self.lora_b_stacked = tuple(b for _, b in pairs)
        self.punica = NeuronPunicaWrapper(64, 4, "cpu")

    def forward(self, x: torch.Tensor, forward_context: ForwardContext) -> torch.Tensor:
        with override_forward_context(forward_context):
            y = x @ self.weight.T
            self.punica.add_lora_linear(y, x, self.lora_a_stacked, self.lora_b_stacked, SCALE, (6, 6))
        return y


def eager_expected(layer: LoRALinear, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    deltas = [
        reference(x, a, b, slots) for a, b in zip(layer.lora_a_stacked, layer.lora_b_stacked, strict=True)
    ]
    return x.double() @ layer.weight.double().T + torch.cat(deltas, dim=1)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_one_static_graph_serves_any_slots_and_in_place_slot_writes(dtype, tol):
    layer, backend = LoRALinear(dtype), StableHLOBackend()
    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)
    x = inputs(len(SLOTS), 1, dtype)[0]
    torch.testing.assert_close(
        compiled(x, context(SLOTS)).double(), eager_expected(layer, x, SLOTS), rtol=tol, atol=tol
    )
    # Other slots for the same tokens, then a new adapter copied into slot 2 (vLLM's set_lora): same graph.
    other = SLOTS.flip(0)
    torch.testing.assert_close(
        compiled(x, context(other)).double(), eager_expected(layer, x, other), rtol=tol, atol=tol
    )
    before = compiled(x, context(SLOTS))
    for lora_a, lora_b in zip(layer.lora_a_stacked, layer.lora_b_stacked, strict=True):
        lora_a[1].copy_(torch.randn_like(lora_a[1]))
        lora_b[1].copy_(torch.randn_like(lora_b[1]))
    after = compiled(x, context(SLOTS))
    torch.testing.assert_close(after.double(), eager_expected(layer, x, SLOTS), rtol=tol, atol=tol)
    changed = (after != before).any(dim=1)
    assert changed.tolist() == (SLOTS == 2).tolist()
    (graph,) = backend.graphs
    # Dense over the slots: dots and a mask, no per-token gather of the adapter weights.
    assert "gather" not in graph.stablehlo and graph.stablehlo.count("dot_general") == 5


def test_the_platform_names_this_wrapper():
    assert resolve_obj_by_qualname(NeuronPlatform.get_punica_wrapper()) is NeuronPunicaWrapper
