"""The exact reference for FP8 weights and an FP8 KV cache: HF transformers running the weights an engine
computes with, dequantized (float32), with its keys and values rounded through FP8 by the engine's KV cache
scales, all taken from the engine's worker; and one engine serving a checkpoint's own KV cache scales."""

from pathlib import Path

import torch


def dequantized_weights(worker) -> dict[str, torch.Tensor]:
    """Run in the worker: each FP8 linear layer's weight as the kernel computes with it (W8 x scale), float32
    [out, in], by vLLM module name, and its static activation scale where it has one (NAME.input_scale); with
    an FP8 KV cache, each attention layer's key and value scales (NAME.k_scale, NAME.v_scale)."""
    from vllm_neuron.quantization.fp8 import dequantized_weight
    from vllm_neuron.upstream.vllm_runner import kv_cache_scales

    weights = {}
    for name, module in worker.model_runner.model.named_modules():
        if str(getattr(module, "kv_cache_dtype", "auto")).startswith("fp8"):
            k_scale, v_scale = kv_cache_scales(module)
            weights[f"{name}.k_scale"], weights[f"{name}.v_scale"] = (
                k_scale.float().clone(),
                v_scale.float().clone(),
            )
        weight = dequantized_weight(module)  # [in, out]: the kernel's layout
        if weight is not None:
            weights[name] = weight.t().contiguous()
            if getattr(module, "input_scale", None) is not None:
                weights[f"{name}.input_scale"] = module.input_scale.detach().float().clone()
    return weights


def hf_with_weights(
    model_dir: Path, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The HF model of `model_dir` in `dtype` with vLLM's dequantized linear weights in place of its own
    (vLLM's fused qkv_proj and gate_up_proj split back into HF's projections), each projection's input
    quantized to FP8 and back where vLLM's layer has a static activation scale, and each attention layer's
    keys and values (after the rotary embedding, as the cache holds them) where vLLM's has KV cache scales."""
    from transformers import AutoModelForCausalLM

    from vllm_neuron.quantization.fp8 import quantize_dequantize

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    parameters = dict(model.named_parameters())
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, weight in weights.items():
            if name.endswith((".k_scale", ".v_scale")):  # taken below
                continue
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
    by_layer = kv_scales_by_layer(weights)
    if by_layer:
        layers = {layer for layer, _ in by_layer}
        round_kv_through_fp8(model, {i: (by_layer[i, "k_scale"], by_layer[i, "v_scale"]) for i in layers})
    return model


def round_kv_through_fp8(model: torch.nn.Module, scales: dict[int, tuple[float, float]]) -> torch.nn.Module:
    """`model` (HF, or peft around it) with each attention layer's keys and values (after the rotary
    embedding, as the cache holds them) rounded through FP8 by its layer's (key, value) scales: what an FP8
    KV cache with those scales stores and attention reads back."""
    from transformers import AttentionInterface

    for module in model.modules():
        if type(module).__name__.endswith("Attention") and module.layer_idx in scales:
            module.fp8_kv_scales = tuple(torch.tensor(scale) for scale in scales[module.layer_idx])
    AttentionInterface.register("fp8_kv_cache", _fp8_kv_attention)
    model.set_attn_implementation("fp8_kv_cache")
    return model


def kv_scales_by_layer(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], float]:
    """The KV cache scales among `tensors`, by (layer index, "k_scale" or "v_scale"), whatever their names'
    form: vLLM's (SELF_ATTN.attn.k_scale), compressed-tensors' (SELF_ATTN.k_scale), ModelOpt's
    (SELF_ATTN.k_proj.k_scale)."""
    return {
        (int(name.split(".")[2]), name.rpartition(".")[2]): tensor.item()
        for name, tensor in tensors.items()
        if name.startswith("model.layers.") and name.endswith((".k_scale", ".v_scale"))
    }


def serve_with_the_checkpoints_kv_scales(
    checkpoint: Path, engine: dict, folder: Path, max_tokens: int, scale_dtype: torch.dtype
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Run `engine` on `checkpoint` (CPU, tests/helpers.py: run_engine) saving the weights it computes with
    (`dequantized_weights`, to `folder`), and check that its KV cache scales are the checkpoint's: one for
    the keys and one for the values of each of the 2 layers, calibrated (none is vLLM's default 1.0), as
    `scale_dtype` holds them (vLLM makes the scale parameters in the model's dtype). The engine's result
    and the dequantized weights, for the caller's checks."""
    from safetensors.torch import load_file

    from tests.helpers import run_engine

    weights_path = folder / "dequantized.pt"
    result = run_engine(
        checkpoint,
        engine,
        {"VLLM_NEURON_DEVICE": "cpu"},
        max_tokens=max_tokens,
        extra={"save_dequantized": str(weights_path)},
    )
    weights = torch.load(weights_path)
    calibrated = kv_scales_by_layer(load_file(checkpoint / "model.safetensors"))
    assert len(calibrated) == 2 * 2 and 1.0 not in calibrated.values()
    # In float16 the checkpoint's (float32) scales rounded; in float32 the same values exactly.
    assert kv_scales_by_layer(weights) == {
        key: torch.tensor(value).to(scale_dtype).item() for key, value in calibrated.items()
    }
    return result, weights


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention over keys and values rounded through the FP8 cache (kv_cache/fp8.py's own
    quantize and dequantize), for a layer that has scales. Rounding is idempotent, so HF's cache of the
    unrounded keys gives what the FP8 cache gives."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kv_cache.fp8 import dequantize, quantize

    if hasattr(module, "fp8_kv_scales"):
        k_scale, v_scale = module.fp8_kv_scales
        key = dequantize(quantize(key, k_scale), k_scale, key.dtype)
        value = dequantize(quantize(value, v_scale), v_scale, value.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def write_compressed_tensors_checkpoint(
    model_dir: Path, out: Path, preset: str = "FP8_DYNAMIC", kv_cache: bool = False
) -> Path:
    """`model_dir`'s model quantized offline with the compressed-tensors library (`preset`'s scheme on every
    Linear but lm_head; weight scales from the absolute maximum of each output channel or of the tensor;
    static input scales, where the scheme has them, of 4 / 448, with different values per layer) and saved
    to `out` as vLLM reads it, tokenizer included. With `kv_cache`, also its FP8 KV cache scheme (static,
    per tensor) with each layer's k_scale and v_scale calibrated as llm-compressor does: the absolute maximum
    of the layer's keys and values over a calibration text, / 448."""
    import shutil

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    kv_amax = _kv_amax(model) if kv_cache else {}
    scheme = {"group_0": preset_name_to_scheme(preset, ["Linear"])}
    kv_scheme = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    config = QuantizationConfig(
        config_groups=scheme,
        format="float-quantized",
        ignore=["lm_head"],
        kv_cache_scheme=kv_scheme if kv_cache else None,
    )
    apply_quantization_config(model, config)
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
        for name, amax in kv_amax.items():
            model.get_parameter(name).fill_(amax / fp8_max)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    # Attention holds no weight to compress (the library's kv scheme quantizes through hooks): its scales are
    # saved as they are, and the config taken above keeps the kv_cache_scheme.
    for attention in {name.rpartition(".")[0] for name in kv_amax}:
        del model.get_submodule(attention).quantization_scheme
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for path in model_dir.iterdir():
        if "token" in path.name:
            shutil.copy(path, out / path.name)
    return out


def _kv_amax(model: torch.nn.Module) -> dict[str, float]:
    """Each attention layer's largest |key| and |value| (its k_proj's and v_proj's outputs) over a fixed
    calibration text, named as compressed-tensors names the layer's KV scales (SELF_ATTN.k_scale)."""
    amax: dict[str, float] = {}

    def record(name: str):
        def hook(_module, _args, output):
            amax[name] = max(amax.get(name, 0.0), output.abs().max().item())

        return hook

    hooks = [
        module.register_forward_hook(record(name.replace("_proj", "_scale")))
        for name, module in model.named_modules()
        if name.endswith(("self_attn.k_proj", "self_attn.v_proj"))
    ]
    generator = torch.Generator().manual_seed(40)
    with torch.no_grad():
        model(torch.randint(model.config.vocab_size, (1, 96), generator=generator))
    for hook in hooks:
        hook.remove()
    return amax


def write_modelopt_checkpoint(model_dir: Path, out: Path) -> Path:
    """`model_dir`'s model as a ModelOpt FP8 checkpoint with an FP8 KV cache (quant_algo and
    kv_cache_quant_algo FP8, written by hand: ModelOpt is not installed): each projection's weight in FP8 with
    a per-tensor weight_scale and a static input_scale, each attention layer's k_proj.k_scale and
    v_proj.v_scale calibrated as for compressed-tensors, the other tensors as they were; lm_head excluded."""
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
    from transformers import AutoModelForCausalLM

    calibrated = _kv_amax(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    for name, amax in calibrated.items():  # SELF_ATTN.k_scale -> SELF_ATTN.k_proj.k_scale
        prefix, _, scale = name.rpartition(".")
        tensors[f"{prefix}.{scale[0]}_proj.{scale}"] = torch.tensor(amax / fp8_max)
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8",
        "ignore": ["lm_head"],
    }
    (out / "config.json").write_text(json.dumps(config))
    for path in model_dir.iterdir():
        if "token" in path.name or path.name == "generation_config.json":
            shutil.copy(path, out / path.name)
    return out
