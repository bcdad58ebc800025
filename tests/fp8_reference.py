"""The exact reference for FP8 weights: HF transformers running the weights an engine computes with,
dequantized (float32), taken from the engine's worker."""

from pathlib import Path

import torch


def dequantized_weights(worker) -> dict[str, torch.Tensor]:
    """Run in the worker: each FP8 linear layer's weight as the kernel computes with it (W8 x scale), float32
    [out, in], by vLLM module name."""
    weights = {}
    for name, module in worker.model_runner.model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn:
            # [in, out] x ([1] or [1, out]): the kernel's layout (vllm_neuron/quantization/fp8.py)
            weights[name] = (weight.float() * module.weight_scale.float()).t().contiguous()
    return weights


def hf_with_weights(
    model_dir: Path, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The HF model of `model_dir` in `dtype` with vLLM's dequantized linear weights in place of its own:
    vLLM's fused qkv_proj and gate_up_proj split back into HF's projections."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    parameters = dict(model.named_parameters())
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    with torch.no_grad():
        for name, weight in weights.items():
            prefix, _, module = name.rpartition(".")
            parts = fused.get(module, (module,))
            sizes = [parameters[f"{prefix}.{part}.weight"].shape[0] for part in parts]
            for part, piece in zip(parts, weight.split(sizes), strict=True):
                parameters[f"{prefix}.{part}.weight"].copy_(piece)
    return model
