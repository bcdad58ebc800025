"""The exact reference for FP8 weights: HF transformers running the weights an engine computes with,
dequantized (float32), taken from the engine's worker."""

from pathlib import Path

import torch


def dequantized_weights(worker) -> dict[str, torch.Tensor]:
    """Run in the worker: each FP8 linear layer's weight as the kernel computes with it (W8 x scale), float32
    [out, in], by vLLM module name, and its static activation scale where it has one (NAME.input_scale)."""
    weights = {}
    for name, module in worker.model_runner.model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn:
            # [in, out] x ([1] or [1, out]): the kernel's layout (vllm_neuron/quantization/fp8.py)
            weights[name] = (weight.float() * module.weight_scale.float()).t().contiguous()
            if getattr(module, "input_scale", None) is not None:
                weights[f"{name}.input_scale"] = module.input_scale.detach().float().clone()
    return weights


def hf_with_weights(
    model_dir: Path, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The HF model of `model_dir` in `dtype` with vLLM's dequantized linear weights in place of its own
    (vLLM's fused qkv_proj and gate_up_proj split back into HF's projections), each projection's input
    quantized to FP8 and back where vLLM's layer has a static activation scale."""
    from transformers import AutoModelForCausalLM

    from vllm_neuron.quantization.fp8 import quantize_dequantize

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    parameters = dict(model.named_parameters())
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, weight in weights.items():
            if name.endswith(".input_scale"):
                prefix, _, module = name.removesuffix(".input_scale").rpartition(".")
                for part in fused.get(module, (module,)):
                    modules[f"{prefix}.{part}"].register_forward_pre_hook(
                        lambda _, args, scale=weight: (quantize_dequantize(args[0], scale),)
                    )
                continue
            prefix, _, module = name.rpartition(".")
            parts = fused.get(module, (module,))
            sizes = [parameters[f"{prefix}.{part}.weight"].shape[0] for part in parts]
            for part, piece in zip(parts, weight.split(sizes), strict=True):
                parameters[f"{prefix}.{part}.weight"].copy_(piece)
    return model


def write_compressed_tensors_checkpoint(model_dir: Path, out: Path, preset: str = "FP8_DYNAMIC") -> Path:
    """`model_dir`'s model quantized offline with the compressed-tensors library (`preset`'s scheme on every
    Linear but lm_head; weight scales from the absolute maximum of each output channel or of the tensor;
    static input scales, where the scheme has them, of 4 / 448, with different values per layer) and saved
    to `out` as vLLM reads it, tokenizer included."""
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
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    with torch.no_grad():
        for index, module in enumerate(model.modules()):
            if hasattr(module, "quantization_scheme") and hasattr(module, "weight_scale"):
                per_channel = module.weight_scale.numel() > 1
                amax = (
                    module.weight.abs().amax(dim=1, keepdim=True)
                    if per_channel
                    else module.weight.abs().amax()
                )
                module.weight_scale.copy_(amax.expand_as(module.weight_scale) / fp8_max)
            if hasattr(module, "quantization_scheme") and hasattr(module, "input_scale"):
                module.input_scale.fill_((4.0 + index % 3) / fp8_max)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for path in model_dir.iterdir():
        if "token" in path.name:
            shutil.copy(path, out / path.name)
    return out


def write_modelopt_checkpoint(model_dir: Path, out: Path) -> Path:
    """`model_dir`'s model as a ModelOpt FP8 checkpoint (quant_algo FP8, written by hand: ModelOpt is not
    installed): each projection's weight in FP8 with a per-tensor weight_scale and a static input_scale, the
    other tensors as they were; lm_head excluded."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    tensors = load_file(model_dir / "model.safetensors")
    for index, name in enumerate(sorted(tensors)):
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            weight = tensors[name].float()
            scale = weight.abs().amax() / fp8_max
            tensors[name] = (weight / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
            prefix = name.removesuffix(".weight")
            tensors[f"{prefix}.weight_scale"] = scale.reshape(())
            tensors[f"{prefix}.input_scale"] = torch.tensor((4.0 + index % 3) / fp8_max)
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "ignore": ["lm_head"],
    }
    (out / "config.json").write_text(json.dumps(config))
    for path in model_dir.iterdir():
        if "token" in path.name or path.name == "generation_config.json":
            shutil.copy(path, out / path.name)
    return out
