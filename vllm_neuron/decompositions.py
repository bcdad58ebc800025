"""The decompositions TorchNeuron's `neuron` backend hands AOTAutograd (torch_neuronx.neuron_dynamo_backend
decompositions.py), for the ops the plugin's graphs can contain: the ATen graph that reaches torch-mlir is
then the one Neuron's compiler gets. Modelled on TorchNeuron's rules, not copied."""

import math

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten

# What TorchNeuron decomposes from PyTorch's own table (its decompositions.py), for ops that can reach an
# inference graph; the rest of its list is backward ops.
_TORCH_DECOMPOSED = [
    aten.logsumexp,
    aten.squeeze.dims,
    aten.nansum,
    aten.addr,
    aten._unsafe_index,
    aten._unsafe_index_put,
    aten.split,
    aten.split_with_sizes,
    aten.unbind,
    aten.embedding,
    aten.clamp_min,
    aten.clamp_max,
    aten._fused_rms_norm,
    aten.fill.Scalar,
    aten.fill.Tensor,
    aten.index_add,
    aten.lerp,
    aten.elu,
    aten.silu,
]


def _index_copy(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """TorchNeuron's rule: index_copy is a scatter whose index is expanded to the source's shape."""
    dim = dim % input.dim()
    shape = [1] * source.dim()
    shape[dim] = index.numel()
    return torch.scatter(input, dim, index.view(shape).expand(source.shape), source)


def _index_put(
    input: torch.Tensor, indices: list[torch.Tensor | None], values: torch.Tensor, accumulate: bool = False
) -> torch.Tensor:
    """TorchNeuron's rule for integer index_put: one 1-D scatter into the flattened input, at the flat index
    of every element the indices select (here for leading index tensors, the form the plugin writes)."""
    if any(index is None or index.dtype == torch.bool for index in indices):
        return NotImplemented
    leading = torch.broadcast_shapes(*(index.shape for index in indices))
    trailing = input.shape[len(indices) :]
    flat = torch.zeros(leading, dtype=torch.int64, device=input.device)
    for dim, index in enumerate(indices):
        index = torch.where(index < 0, index + input.shape[dim], index)
        flat = flat + index.expand(leading) * math.prod(input.shape[dim + 1 :])
    inner = torch.arange(math.prod(trailing), device=input.device)
    flat = (flat.reshape(-1, 1) + inner.view(1, -1)).reshape(-1)
    source = values.to(input.dtype).expand(*leading, *trailing).reshape(-1)
    scatter = torch.scatter_add if accumulate else torch.scatter
    return scatter(input.reshape(-1), 0, flat, source).view(input.shape)


def _sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention as TorchNeuron decomposes `_scaled_dot_product_fused_attention_overrideable` (the op a
    `neuron` device dispatches to) when its NKI kernel does not apply (an attention mask is given): scores,
    a max-subtracted softmax, and a matmul, in the inputs' dtype. Returns the output and the logsumexp."""
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if attn_mask is not None:
        scores = scores + attn_mask
    peak = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - peak)
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights / total, value)
    return out, (peak + torch.log(total)).squeeze(-1).float()


def _sdpa_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU dispatch of scaled_dot_product_attention, lowered as the Neuron dispatch is (see _sdpa_math):
    the same model code must give the same graph on either device."""
    if dropout_p or is_causal:
        return NotImplemented
    return _sdpa_math(query, key, value, attn_mask, scale)


def _as_strided(
    input: torch.Tensor, size: list[int], stride: list[int], storage_offset: int = 0
) -> torch.Tensor:
    """TorchNeuron's rule: as_strided (what PyTorch's split decompositions produce) is an index_select of the
    flattened input at the indices the strides address, computed in the graph. Without it torch-mlir
    materialises those indices as constants: 118 MB of int64 literals in one SmolLM2 graph."""
    if not input.is_contiguous():
        return NotImplemented
    index = torch.full(size, storage_offset - input.storage_offset(), dtype=torch.int64, device=input.device)
    for dim, (length, step) in enumerate(zip(size, stride, strict=True)):
        shape = [1] * len(size)
        shape[dim] = length
        index = index + torch.arange(length, device=input.device).view(shape) * step
    return input.reshape(-1).index_select(0, index.reshape(-1)).view(size)


def decomposition_table() -> dict:
    """TorchNeuron's decompositions, for the ops the plugin's graphs can contain."""
    table = get_decompositions(_TORCH_DECOMPOSED)
    table[aten.as_strided.default] = _as_strided
    table[aten.index_copy.default] = _index_copy
    table[aten.index_put.default] = _index_put
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = _sdpa_cpu
    return table
