"""The e4m3 format as trn2 holds it, and its one rounding rule, shared by FP8 weights, static activation
scales (vllm_neuron/quantization) and the FP8 KV cache (kv_cache/fp8.py). Plain torch, in kv_cache, the
bottom layer, so that both import it downward; it runs at load on the host and inside graphs.

Tensors keep torch's float8_e4m3fn as the bits' container; neuronx-cc reads them as trn2's own e4m3 (the
option `trn2.FP8_COMPILER_OPTION`, which the platform passes whenever FP8 is on: NCC_EVRF051). The two
formats agree up to +-240, trn2's largest e4m3 value, so every value is saturated there (`FP8_MAX`), in CPU
mode too: CPU mode rounds to the values a trn2's FP8 holds. Scales made for e4m3fn's +-448 (a
checkpoint's, vLLM's own quantization, vLLM's default KV cache scale 1.0) are used times `RESCALE`, as AWS's
Neuron libraries rescale FP8 checkpoints: the same values fit (docs/fp8.md).
"""

import torch

FP8 = torch.float8_e4m3fn
# trn2's FP8 e4m3 is the IEEE-like kind: its largest value is 240, where float8_e4m3fn's is 448, and beyond
# it values may become NaN (AWS neuronx-distributed's FP8 rescaling README).
FP8_MAX = 240.0
OCP_MAX = torch.finfo(FP8).max  # 448: e4m3fn's, which checkpoints' and vLLM's scales are made for
RESCALE = OCP_MAX / FP8_MAX


def to_fp8(x: torch.Tensor, scale: torch.Tensor | float, limit: float = FP8_MAX) -> torch.Tensor:
    """x / scale in float32, saturated at +-limit (an unclamped overflow would be NaN, or beyond trn2's
    range), then rounded to e4m3. `scale` broadcasts over x. limit: trn2's, but where vLLM's own contract
    is e4m3fn's (vllm_neuron/quantization/fp8.py scaled_fp8_quant)."""
    return (x.to(torch.float32) / scale).clamp(-limit, limit).to(FP8)


def for_trn2(scale: torch.Tensor) -> torch.Tensor:
    """A scale made for e4m3fn's +-448, as trn2's +-240 uses it (in float32, whatever the scale's dtype):
    the same values fit."""
    return scale.to(torch.float32) * RESCALE
