"""vLLM 0.32's FP8 linear seam as the plugin reaches it: the scaled-mm kernel base class its FP8 linear
methods call, the public registry that adds a kernel for out-of-tree platforms, the quantization keys a kernel
is asked to implement, and `vllm._custom_ops.scaled_fp8_quant`, the C op its weight processing calls (absent
from the CPU and Neuron builds), which the plugin replaces with plain torch. tests/unit/test_upstream.py pins
what the plugin relies on; docs/maintaining.md says what to do when one moves."""

from collections.abc import Callable

from vllm import _custom_ops
from vllm.model_executor.kernels.linear import register_linear_kernel
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    FP8ScaledMMLinearKernel,
    FP8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers.quantization.utils.layer_utils import replace_parameter
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
from vllm.platforms.interface import PlatformEnum


def register_fp8_kernel(kernel: type[FP8ScaledMMLinearKernel]) -> None:
    """Make `kernel` the FP8 scaled-mm kernel vLLM chooses on an out-of-tree platform (once)."""
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_KERNELS

    if kernel not in _POSSIBLE_FP8_KERNELS.get(PlatformEnum.OOT, []):
        register_linear_kernel(kernel, PlatformEnum.OOT, "fp8")


def replace_scaled_fp8_quant(quantize: Callable) -> None:
    """vLLM's FP8 weight processing calls `ops.scaled_fp8_quant` by attribute of `vllm._custom_ops`."""
    _custom_ops.scaled_fp8_quant = quantize


__all__ = [
    "FP8ScaledMMLinearKernel",
    "FP8ScaledMMLinearLayerConfig",
    "GroupShape",
    "register_fp8_kernel",
    "replace_parameter",
    "replace_scaled_fp8_quant",
]
