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


def write_compressed_tensors_checkpoint(model_dir: Path, out: Path, preset: str = "FP8_DYNAMIC") -> Path:
    """`model_dir`'s model quantized offline with the compressed-tensors library (`preset`'s scheme on every
    Linear but lm_head, weight scales from each output channel's absolute maximum) and saved to `out` as
    vLLM reads it, tokenizer included."""
    import shutil

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    scheme = {"group_0": preset_name_to_scheme(preset, ["Linear"])}
    config = QuantizationConfig(config_groups=scheme, format="float-quantized", ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "quantization_scheme") and hasattr(module, "weight_scale"):
                amax = module.weight.abs().amax(dim=1, keepdim=True).expand_as(module.weight_scale)
                module.weight_scale.copy_(amax / torch.finfo(torch.float8_e4m3fn).max)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for path in model_dir.iterdir():
        if "token" in path.name:
            shutil.copy(path, out / path.name)
    return out
