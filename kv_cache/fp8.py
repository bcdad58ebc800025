"""FP8 (e4m3) KV cache: a uint8 cache, as vLLM allocates it for `--kv-cache-dtype fp8`, that holds each
key/value element as the bits of an e4m3 scaled by its layer's per-tensor scale. The layer's scale (vLLM's
default 1.0, or a checkpoint's) is made for e4m3fn's +-448; the cache uses it as trn2's +-240 does
(fp8_format.for_trn2), so it holds the same range, +-448 x scale.

The cache stays uint8 because an FP8-typed cache does not update in place: torch's CPU scatter has no
float8 kernel, and XLA's CPU compiler converts such a cache around its write (docs/research/issue-40-fp8.md,
section 3). Same-width views (`bitcast_convert` in StableHLO) move the bits between the two types.
"""

import torch

from kv_cache.fp8_format import FP8, for_trn2, to_fp8

# vLLM's names for an e4m3 cache (`fp8` means e4m3). fp8_e5m2 is refused: vLLM refuses it with checkpoint
# scales, and nothing here checked it lowers.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x over the layer's scale rounded to e4m3 (saturating, not inf), as the uint8 bits the cache stores."""
    return to_fp8(x, for_trn2(scale)).view(torch.uint8)


def dequantize(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values in `dtype` of e4m3 bits read from the cache (quantize's inverse, up to rounding)."""
    return bits.view(FP8).to(dtype) * for_trn2(scale)


def dequantized(
    keys: torch.Tensor,
    values: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered keys and values as attention multiplies them: dequantized where the cache is FP8 (scales
    given), as they are otherwise. A Python-level choice, so a bf16/f32 cache's graph has no extra op."""
    if k_scale is None or v_scale is None:
        return keys, values
    return dequantize(keys, k_scale, dtype), dequantize(values, v_scale, dtype)
