"""The kernel seam: the KV write and the two attentions of kv_cache/ops.py as torch custom ops (namespace
`neuron_kv`), so that a device kernel can stand behind each without the attention backend changing.

Each op's implementation is its reference, the plain torch of kv_cache/ops.py; its fake (meta)
implementation follows from the shapes alone: the write returns nothing (the cache is its mutated argument),
an attention returns a tensor of its query's shape and dtype. `VLLM_NEURON_ATTENTION_KERNELS` picks the
implementation when a layer is built: `torch` (the references) or `nki`, refused by `refusal` while no NKI
kernel is bound to these ops.

A graph on TorchNeuron's route (the `neuron` backend and its CPU rehearsals) calls the references directly
under `torch`: dynamo then traces the write as the in-place calls (`view`, `index_copy_`) that TorchNeuron's
aliasing analysis reads before AOTAutograd, so the NEFF keeps each cache in place. An op left in that graph
would have to be lowered by TorchNeuron itself (an NKI kernel's op; its schema declares the cache it writes).
Other backends (eager, inductor) call the ops (docs/lowering.md, "The kernel seam").
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_cache import ops

IMPLEMENTATIONS = ("torch", "nki")


def _page_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    page_blocks: torch.Tensor,
    page_rows: torch.Tensor,
    page_starts: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    hidden: torch.Tensor,
    owner: torch.Tensor,
    ownership: torch.Tensor,
    soft_cap: float | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """ops.page_attention with its PageMasks as tensors: a custom op's arguments are tensors and scalars."""
    masks = ops.PageMasks(hidden, owner, ownership)
    return ops.page_attention(
        query,
        kv_cache,
        page_blocks,
        page_rows,
        page_starts,
        positions,
        scale,
        masks,
        soft_cap,
        k_scale,
        v_scale,
    )


def _table_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    soft_cap: float | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """ops.table_attention as the op runs it: a dense result, the strides its fake promises (its own is a
    permuted view, which inductor's stride check of the op's output refuses)."""
    out = ops.table_attention(
        query, kv_cache, block_table, query_positions, scale, mask, soft_cap, k_scale, v_scale
    )
    return out.contiguous()


def _like_query(query: torch.Tensor, *_: object) -> torch.Tensor:
    return query.new_empty(query.shape)


def _nothing(*_: object) -> None:
    return None


def _define(name: str, reference: Callable, fake: Callable, mutates: tuple[str, ...] = ()) -> Callable:
    op = torch.library.custom_op(f"neuron_kv::{name}", reference, mutates_args=mutates)
    op.register_fake(fake)
    return getattr(torch.ops.neuron_kv, name).default


write_kv = _define("write_kv", ops.write_kv, _nothing, mutates=("kv_cache",))
table_attention = _define("table_attention", _table_attention, _like_query)
page_attention = _define("page_attention", _page_attention, _like_query)


@dataclass(frozen=True)
class Kernels:
    """What an attention layer calls: the KV write and the two attentions."""

    write_kv: Callable[..., None]
    table_attention: Callable[..., torch.Tensor]
    page_attention: Callable[..., torch.Tensor]


def refusal(implementation: str) -> str | None:
    """Why `implementation` cannot serve here, with what to change; None where it can."""
    if implementation == "torch":
        return None
    if implementation == "nki":
        sdk = "installed" if importlib.util.find_spec("neuronxcc") is not None else "not installed"
        return (
            "VLLM_NEURON_ATTENTION_KERNELS=nki: no NKI kernel is bound to the neuron_kv ops in this build "
            f"(the Neuron SDK's compiler, neuronxcc, is {sdk}); set VLLM_NEURON_ATTENTION_KERNELS=torch"
        )
    return f"VLLM_NEURON_ATTENTION_KERNELS={implementation!r}: use one of {', '.join(IMPLEMENTATIONS)}"


# The plain torch each op stands for.
REFERENCES = Kernels(ops.write_kv, ops.table_attention, _page_attention)


def select(implementation: str, torchneuron_route: bool) -> Kernels:
    """What a layer calls under `implementation`: the references themselves on TorchNeuron's route
    (`torchneuron_route`, see the module docstring), the ops elsewhere; raises ValueError with refusal's
    message."""
    message = refusal(implementation)
    if message is not None:
        raise ValueError(message)
    return REFERENCES if torchneuron_route else Kernels(write_kv, table_attention, page_attention)
