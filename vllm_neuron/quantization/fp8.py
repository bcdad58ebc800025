"""FP8 weights on Neuron: the kernel vLLM's FP8 linear methods choose on this platform (online
`--quantization fp8`, FP8 checkpoints), and the plain-torch weight quantization they call at load.

vLLM hands the kernel e4m3fn weights and scales made for e4m3fn's +-448 (a checkpoint's, or its own online
quantization's, `scaled_fp8_quant` below). At load the kernel moves them to trn2's e4m3 (+-240,
fp8_format.py): each weight over `RESCALE`, rounded again, and its scale and any static activation scale
times `RESCALE`, as AWS's Neuron libraries rescale FP8 checkpoints. The weight then stays in device memory as
its bits (uint8: TorchNeuron has no torch dtype for an f8E4M3FN graph input) and enters each graph as such,
viewed as e4m3 and converted next to its matmul; the output is scaled per tensor or per output channel in
float32. Activations stay in the model's dtype, except where a checkpoint gives a static activation scale:
then each input is quantized to FP8 with it and dequantized before the matmul (W8A8's numbers). Dynamic
activation quantization is not applied: weight-only FP8, as vLLM serves FP8 on GPUs without FP8 compute (its
Marlin FP8 kernel). The exact reference is the model with the dequantized weights (and quantized inputs).
docs/research/issue-40-fp8.md.
"""

import torch

from kv_cache.fp8_format import FP8, OCP_MAX, RESCALE, to_fp8
from vllm_neuron.upstream.vllm_fp8 import (
    FP8ScaledMMLinearKernel,
    FP8ScaledMMLinearLayerConfig,
    GroupShape,
    register_fp8_kernel,
    replace_parameter,
    replace_scaled_fp8_quant,
)

# vLLM's floor on a dynamic scale (its quantization kernels'): an all-zero tensor still divides.
MIN_SCALE = 1.0 / (OCP_MAX * 512)


def scaled_fp8_quant(
    input: torch.Tensor,  # noqa: A002 (vLLM's argument names: callers pass them by keyword)
    scale: torch.Tensor | None = None,
    num_token_padding: int | None = None,
    scale_ub: torch.Tensor | None = None,
    use_per_token_if_dynamic: bool = False,
    output: torch.Tensor | None = None,
    group_shape: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`vllm._custom_ops.scaled_fp8_quant` in plain torch, with its arguments and results: `input` [M, N]
    quantized with `scale` (per tensor, or by `group_shape`), or with a scale from its absolute maximum (per
    tensor, or per row). vLLM's contract, e4m3fn's +-448, which the kernel moves to trn2's at load (vLLM
    requantizes a checkpoint's weights with the checkpoint's scales through it). Runs at weight load on the
    host, never in a graph."""
    values = input.to(torch.float32)
    if scale is None:
        if use_per_token_if_dynamic:
            amax = values.abs().amax(dim=1, keepdim=True)
            amax = amax if scale_ub is None else amax.clamp(max=scale_ub)
        else:
            amax = values.abs().amax().reshape(1)
        scale = (amax / OCP_MAX).clamp(min=MIN_SCALE)
    quantized = to_fp8(values, _spread(scale.to(torch.float32), values.shape, group_shape), OCP_MAX)
    if num_token_padding and num_token_padding > quantized.shape[0]:
        padding = torch.zeros(num_token_padding - quantized.shape[0], quantized.shape[1], dtype=FP8)
        quantized = torch.cat([quantized, padding.to(quantized.device)])
    if output is not None:
        output.copy_(quantized)
        quantized = output
    return quantized, scale


def _spread(scale: torch.Tensor, shape: torch.Size, group_shape: tuple[int, int] | None) -> torch.Tensor:
    """`scale` broadcast over a [M, N] tensor: one value; a 1-D scale laid out by `group_shape` ((-1, 1): per
    column, (1, -1): per row); or a 2-D one, a value per group of [M / its rows, N / its columns]."""
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.dim() == 1:
        if group_shape is None:
            raise ValueError("a 1-D FP8 scale needs group_shape: (-1, 1) per column or (1, -1) per row")
        return scale.reshape(1, -1) if tuple(group_shape) == (-1, 1) else scale.reshape(-1, 1)
    rows, cols = shape[0] // scale.shape[0], shape[1] // scale.shape[1]
    return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def quantize_dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as FP8 with a static scale (trn2's: made so at load) holds it, saturated at +-240 x scale, back in
    x's dtype: the activation a W8A8 checkpoint's matmul reads, so the product equals FP8 x FP8 with
    float32 accumulation."""
    return (to_fp8(x, scale).to(torch.float32) * scale).to(x.dtype)


def dequantized_weight(layer: torch.nn.Module) -> torch.Tensor | None:
    """An FP8 linear layer's weight as NeuronFp8Linear computes with it, float32 [in, out]: its trn2 e4m3 bits
    times its scale; None for a layer the kernel did not load."""
    weight, scale = getattr(layer, "weight", None), getattr(layer, "weight_scale", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8 or scale is None:
        return None
    return weight.view(FP8).float() * scale.float()


class NeuronFp8Linear(FP8ScaledMMLinearKernel):
    """x @ dequantize(W) in the graph: W trn2's e4m3 [in, out] as uint8 bits, row-major, viewed as e4m3 and
    converted to x's dtype next to the matmul; the float32 scale (one, or one per output channel) applied to
    the product."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return True, None

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        weight, activation = c.weight_quant_key.scale, c.activation_quant_key.scale
        if not weight.static or weight.group_shape not in (GroupShape.PER_TENSOR, GroupShape.PER_CHANNEL):
            return False, f"Neuron FP8 takes static per-tensor or per-channel weight scales, not {weight}"
        if activation.static and activation.group_shape != GroupShape.PER_TENSOR:
            return False, f"Neuron FP8 takes a static activation scale per tensor only, not {activation}"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # vLLM leaves the weight as a transposed view ([in, out] over [out, in] memory); XLA and neuronx-cc
        # take inputs row-major, so it is laid out once here, not copied at every call. e4m3fn's range moves
        # to trn2's: the weight over RESCALE, its scales times it (the module docstring). On the host: on the
        # device each op would be an eager kernel compiled per shape.
        device = layer.weight.device
        weight = to_fp8(layer.weight.data.cpu().to(torch.float32), RESCALE).contiguous()
        replace_parameter(layer, "weight", weight.view(torch.uint8).to(device))
        if getattr(layer, "input_scale", None) is not None:
            replace_parameter(layer, "input_scale", layer.input_scale.data.to(torch.float32) * RESCALE)
        scale = layer.weight_scale.data.to(torch.float32) * RESCALE
        # Per tensor: [1]; per output channel ([out, 1] from vLLM): one row across the output's columns.
        replace_parameter(
            layer, "weight_scale", scale.reshape(1, -1) if scale.numel() > 1 else scale.reshape(1)
        )

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = layer.weight
        if getattr(layer, "input_scale", None) is not None:  # a static activation scale (W8A8 checkpoints)
            x = quantize_dequantize(x, layer.input_scale)
        product = x.reshape(-1, x.shape[-1]) @ weight.view(FP8).to(x.dtype)
        out = (product.to(torch.float32) * layer.weight_scale).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[1])

    def apply_scaled_mm(self, **kwargs: object) -> torch.Tensor:
        # Abstract in vLLM's base; apply_weights above does the whole product, so nothing calls it.
        raise NotImplementedError("NeuronFp8Linear computes in apply_weights")


def install() -> None:
    """Make vLLM's FP8 linear methods use this kernel and this weight quantization (in the worker, before
    the model is built)."""
    register_fp8_kernel(NeuronFp8Linear)
    replace_scaled_fp8_quant(scaled_fp8_quant)
