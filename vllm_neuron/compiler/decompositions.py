"""The decompositions TorchNeuron's `neuron` backend hands AOTAutograd (torch_neuronx.neuron_dynamo_backend
decompositions.py), for the ops the plugin's graphs can contain: the ATen graph that reaches torch-mlir is
then the one Neuron's compiler gets. Modelled on TorchNeuron's rules, not copied."""

import itertools
import math
import threading

import torch

from vllm_neuron.buckets import FLASH_TOKENS
from vllm_neuron.upstream import torch_compile

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


def flash_kernel_takes(query: torch.Tensor, key: torch.Tensor, attn_mask: object, dropout_p: float) -> bool:
    """TorchNeuron's rule for handing an attention to its NKI flash kernel (its SDPA decomposition, with
    TORCH_NEURONX_ENABLE_NKI_SDPA on, the default): no mask, no dropout, query and key lengths multiples of
    128, keys in whole sequence tiles (512 at the least) and a head size of at most 128."""
    length, keys, head_size = query.shape[-2], key.shape[-2], key.shape[-1]
    return (
        attn_mask is None
        and not dropout_p
        and length % 128 == 0
        and keys % FLASH_TOKENS == 0
        and head_size <= 128
    )


class _FlashCalls(threading.local):
    """The attentions of the graph being traced, as (query length, key length, flash kernel takes it): what
    the report of its largest intermediate leaves to the kernel (stablehlo._largest_tensor)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []


FLASH_CALLS = _FlashCalls()


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
    the same model code must give the same graph on either device. A causal attention is what TorchNeuron
    gives its flash kernel where the kernel takes it (flash_kernel_takes); here it lowers to the same math
    with the causal mask, and FLASH_CALLS records which it was."""
    if dropout_p or (is_causal and attn_mask is not None):
        return NotImplemented
    length, keys = query.shape[-2], key.shape[-2]
    FLASH_CALLS.calls.append((length, keys, flash_kernel_takes(query, key, attn_mask, dropout_p)))
    if is_causal:
        rows = torch.arange(length, device=query.device).view(-1, 1)
        columns = torch.arange(keys, device=query.device).view(1, -1)
        attn_mask = torch.zeros((length, keys), dtype=query.dtype, device=query.device).masked_fill(
            columns > rows, float("-inf")
        )
    return _sdpa_math(query, key, value, attn_mask, scale)


def _as_strided(
    input: torch.Tensor, size: list[int], stride: list[int], storage_offset: int = 0
) -> torch.Tensor:
    """TorchNeuron's rule: as_strided (what PyTorch's split decompositions produce) is an index_select of the
    flattened input at the indices the strides address, computed in the graph. Without it torch-mlir
    materialises those indices as constants: 118 MB of int64 literals in one SmolLM2 graph, and for a strided
    view (a chunk of a slice: MiniCPM3's rotary half of a projection) an index over several dimensions that
    grew past 18 GB in torch-mlir before failing."""
    dims = _storage_order(input)
    if dims is None:
        return NotImplemented
    # Storage positions the view addresses, relative to the input's first element.
    position = torch.full(
        size, storage_offset - input.storage_offset(), dtype=torch.int64, device=input.device
    )
    for dim, (length, step) in enumerate(zip(size, stride, strict=True)):
        shape = [1] * len(size)
        shape[dim] = length
        position = position + torch.arange(length, device=input.device).view(shape) * step
    if not input.is_contiguous():
        # Each position back to the input's coordinates (dimensions by decreasing stride), then to its index
        # in the input's contiguous copy.
        flat, remainder = torch.zeros_like(position), position
        for dim in dims:
            flat = flat + torch.div(remainder, input.stride(dim), rounding_mode="floor") * _row_major(
                input, dim
            )
            remainder = torch.remainder(remainder, input.stride(dim))
        position = flat
    return input.reshape(-1).index_select(0, position.reshape(-1)).view(size)


def _storage_order(input: torch.Tensor) -> list[int] | None:
    """The dimensions of size > 1 by decreasing stride, when each element of the input has its own storage
    position and those positions tell its coordinates apart; None otherwise (an overlapping view)."""
    dims = sorted((d for d in range(input.dim()) if input.shape[d] > 1), key=input.stride, reverse=True)
    for outer, inner in itertools.pairwise(dims):
        if input.stride(outer) < input.stride(inner) * input.shape[inner]:
            return None
    return dims if all(input.stride(d) > 0 for d in dims) else None


def _row_major(input: torch.Tensor, dim: int) -> int:
    """The stride of dim in a contiguous tensor of the input's shape."""
    stride = 1
    for later in input.shape[dim + 1 :]:
        stride *= later
    return stride


def _slice_scatter(
    input: torch.Tensor,
    src: torch.Tensor,
    dim: int = 0,
    start: int | None = None,
    end: int | None = None,
    step: int = 1,
) -> torch.Tensor:
    """Our rule, not TorchNeuron's: `x[..., a:] = y` ends its slice_scatter at INT64_MAX, whose StableHLO
    lowering in torch-mlir grew past 18 GB before failing (MiniCPM3). The same op with the end clamped to the
    dimension; the call below comes back here and is then traced as it is."""
    size = input.shape[dim]
    if end is None or end <= size:
        return NotImplemented
    return aten.slice_scatter.default(input, src, dim, start, size, step)


def decomposition_table() -> dict:
    """TorchNeuron's decompositions, for the ops the plugin's graphs can contain."""
    table = torch_compile.get_decompositions(_TORCH_DECOMPOSED)
    table[aten.as_strided.default] = _as_strided
    table[aten.slice_scatter.default] = _slice_scatter
    table[aten.index_copy.default] = _index_copy
    table[aten.index_put.default] = _index_put
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = _sdpa_cpu
    return table
