"""The e4m3 format and its one rounding rule, shared by FP8 weights, static activation scales and the FP8
KV cache (plain torch: it runs at load on the host and inside graphs)."""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float32, saturated at +-448 (e4m3 has no inf: an unclamped overflow would be NaN), then
    rounded to e4m3. `scale` broadcasts over x."""
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
