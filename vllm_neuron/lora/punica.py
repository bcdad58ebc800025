"""The punica wrapper vLLM's LoRA layers call on Neuron (`NeuronPlatform.get_punica_wrapper`).

vLLM's wrappers keep per-step metadata on the wrapper (sorted segments, `.item()` lengths, a `no_lora` flag)
that a static-shape graph cannot hold: each would be a data-dependent shape or a recompile. Here the only
per-call state is the adapter slot of each token (`lora_slots`) and of each logits row (`lora_rows`), call
inputs the model runner puts in the forward context's `additional_kwargs` (0 = the base model, k = vLLM's slot
k - 1). Every op runs dense over all slots and masks by a one-hot of the slot, so the graph depends on the
stacked weights' shapes only: loading an adapter is an in-place copy into its slot, never a compile, and a
base or padding token gets an exact zero delta (no zero slot is stored). docs/research/issue-39-lora.md.
"""

from typing import TYPE_CHECKING, Any

import torch

from vllm_neuron.upstream.vllm_lora import PunicaWrapperBase, get_forward_context

if TYPE_CHECKING:
    from vllm.lora.layers import LoRAMapping

# The forward context's additional_kwargs keys: the slot per token, and per logits row.
LORA_SLOTS = "lora_slots"
LORA_ROWS = "lora_rows"


def call_slots(key: str) -> torch.Tensor:
    """This call's slot input `key` ([tokens] or [rows], int64), set by the runner."""
    return get_forward_context().additional_kwargs[key]


def slot_mask(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[T, num_slots] float32: row t is the one-hot of slot slots[t] - 1, all zero for slot 0 (the base)."""
    return (slots[:, None] == torch.arange(1, num_slots + 1, device=slots.device)).to(torch.float32)


def shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """[T, r] float32: scale * A[slot] x per token, zero for the base. `lora_a` is [S, 1, r, in]; every slot
    is multiplied and the mask keeps each token's own, so no gather and no data-dependent shape."""
    a = lora_a[:, 0].to(torch.float32)
    per_slot = torch.einsum("ti,sri->tsr", x.to(torch.float32), a)
    return (per_slot * slot_mask(slots, a.shape[0])[:, :, None]).sum(1) * scale


def expand(z: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, out] in `dtype`: B[slot] z per token. `lora_b` is [S, 1, out, r]; z is spread to its token's slot
    column and contracted over (slot, rank) in one dot."""
    b = lora_b[:, 0].to(dtype)
    spread = z.to(dtype)[:, None, :] * slot_mask(slots, b.shape[0]).to(dtype)[:, :, None]
    return torch.einsum("tsr,sor->to", spread, b)


class NeuronPunicaWrapper(PunicaWrapperBase):
    """vLLM's punica ops over fixed slots, the slot per token read from the call's inputs. The host side
    (`update_metadata`) only keeps vLLM's slot layout; the runner turns it into the call's slot arrays."""

    def __init__(
        self, max_num_batched_tokens: int, max_batches: int, device: torch.device | str, **kwargs: Any
    ) -> None:
        # No per-token buffers: the slots are call inputs, sized by the call's bucket.
        self.device = torch.device(device)
        self.lora_index_to_id: list[int | None] = []
        self.vocab_size: int | None = None

    def update_metadata(
        self,
        mapping: "LoRAMapping",
        lora_index_to_id: list[int | None],
        max_loras: int,
        vocab_size: int,
        **kwargs: Any,
    ) -> None:
        self.lora_index_to_id = list(lora_index_to_id)
        self.vocab_size = vocab_size

    # ---- the indices vLLM's layers and wrappers name (-1 = no adapter) ----

    @property
    def token_lora_indices(self) -> torch.Tensor:
        return call_slots(LORA_SLOTS) - 1

    @property
    def sampler_indices(self) -> torch.Tensor:
        return call_slots(LORA_ROWS) - 1

    @property
    def sampler_indices_padded(self) -> torch.Tensor:
        raise NotImplementedError("sampler_indices_padded: no vLLM 0.32 layer reads it on this wrapper")

    @property
    def _embeddings_indices(self) -> torch.Tensor:
        # VocabParallelEmbeddingWithLoRA looks up `token + this` in its [S * vocab, r] table: a base token
        # reads slot 0's row, which add_lora_embedding masks out.
        if self.vocab_size is None:
            raise RuntimeError("the LoRA vocab size is unset: update_metadata runs before the first forward")
        return (call_slots(LORA_SLOTS) - 1).clamp(min=0) * self.vocab_size

    # ---- the ops ----

    def add_shrink(
        self,
        y: tuple[torch.Tensor, ...] | torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        scale: float,
        **kwargs: Any,
    ) -> None:
        slots = call_slots(LORA_SLOTS)
        x = x.view(-1, x.shape[-1])
        # Written, not added, as vLLM's bgmv_shrink does: the buffer holds this slice's [T, r].
        for out, lora_a in zip(y, lora_a_stacked, strict=True):
            out[:, : lora_a.shape[2]] = shrink(x, lora_a, slots, scale)

    def add_expand(
        self,
        y: torch.Tensor,
        x: tuple[torch.Tensor, ...] | torch.Tensor,
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        offset_start: int = 0,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        slots = call_slots(LORA_SLOTS)
        y2d = y.view(-1, y.shape[-1])
        offset = offset_start
        for z, lora_b, size in zip(x, lora_b_stacked, output_slices, strict=True):
            delta = expand(z, lora_b, slots, y.dtype)[:, :size]
            if add_inputs:
                y2d[:, offset : offset + size] += delta
            else:
                y2d[:, offset : offset + size] = delta
            offset += size

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        delta = expand(x, lora_b_stacked, call_slots(LORA_SLOTS), y.dtype)
        y2d = y.view(-1, y.shape[-1])
        if add_inputs:
            y2d += delta
        else:
            y2d.copy_(delta)

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        slots = call_slots(LORA_SLOTS)
        x = x.view(-1, x.shape[-1])
        y2d = y.view(-1, y.shape[-1])
        offset = 0
        # No shrink buffer: each slice's [T, r] is a graph value; `buffer` is accepted and unused.
        for lora_a, lora_b, size in zip(lora_a_stacked, lora_b_stacked, output_slices, strict=True):
            y2d[:, offset : offset + size] += expand(shrink(x, lora_a, slots, scale), lora_b, slots, y.dtype)[
                :, :size
            ]
            offset += size

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: float,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        rows = call_slots(LORA_ROWS)
        x = x.view(-1, x.shape[-1])
        y2d = y.view(-1, y.shape[-1])
        # vLLM's logits B may be wider than the (padded) logits: add over the common width.
        delta = expand(shrink(x, lora_a_stacked, rows, scale), lora_b_stacked, rows, y.dtype)
        width = min(delta.shape[1], y2d.shape[1])
        y2d[:, :width] += delta[:, :width]

    def apply_lora_full_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        weight_stacked: torch.Tensor,
        bias_stacked: torch.Tensor,
        module_enabled: torch.Tensor,
    ) -> None:
        raise NotImplementedError("LoRA on classification heads: only text generation is served")
