"""FP8 weights (issue 40): vLLM's FP8 linear methods on the plugin's kernel (vllm_neuron/quantization/fp8.py).
The weight quantization equals its definition; the kernel computes x times the dequantized weight; the graph
takes the weight as float8_e4m3fn into its matmul (StableHLO), and XLA runs it with eager's numbers; a tiny
model served with --quantization fp8 gives the greedy tokens of HF on the same dequantized weights; what the
kernel does not serve is refused by name."""

import json
import re
import shutil

import pytest
import torch

from tests.conftest import FEW_BUCKETS_ENGINE
from tests.fp8_reference import (
    hf_with_weights,
    serve_with_the_checkpoints_kv_scales,
    write_compressed_tensors_checkpoint,
    write_modelopt_checkpoint,
)
from tests.helpers import PROMPTS, engine_config, hf_greedy, run_engine
from vllm_neuron.compiler.stablehlo import StableHLOBackend
from vllm_neuron.quantization.fp8 import NeuronFp8Linear, scaled_fp8_quant
from vllm_neuron.quantization.fp8_format import FP8, FP8_MAX

MAX_TOKENS = 12


def test_static_and_dynamic_quantization_equal_their_definition():
    torch.manual_seed(0)
    x = torch.randn(6, 32) * 3
    scale = torch.tensor([0.02])
    q, s = scaled_fp8_quant(x, scale)
    assert q.dtype == FP8 and s is scale
    assert torch.equal(q.float(), (x / 0.02).clamp(-FP8_MAX, FP8_MAX).to(FP8).float())
    q, s = scaled_fp8_quant(x)  # dynamic per tensor: the absolute maximum maps to FP8's largest value
    assert s.shape == (1,) and q.float().abs().max() == FP8_MAX
    q, s = scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    assert s.shape == (6, 1) and torch.equal(q.float().abs().amax(1), torch.full((6,), FP8_MAX))
    columns = torch.rand(32) + 0.01
    q, _ = scaled_fp8_quant(x, columns, group_shape=(-1, 1))
    assert torch.equal(q.float(), (x / columns).clamp(-FP8_MAX, FP8_MAX).to(FP8).float())
    q, _ = scaled_fp8_quant(x, scale, num_token_padding=8)
    assert q.shape == (8, 32) and not q[6:].float().any()


class Fp8Layer(torch.nn.Module):
    """A linear layer as vLLM leaves it for the kernel: W8 [in, out] as a transposed view, its scale."""

    def __init__(self, weight: torch.Tensor, per_channel: bool, bias: bool) -> None:
        super().__init__()
        amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax().reshape(1)
        scale = amax / FP8_MAX
        quantized, _ = scaled_fp8_quant(weight, scale)
        self.weight = torch.nn.Parameter(quantized.t(), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = torch.nn.Parameter(torch.randn(weight.shape[0]), requires_grad=False) if bias else None
        NeuronFp8Linear.process_weights_after_loading(None, self)

    def dequantized(self) -> torch.Tensor:
        return (self.weight.double() * self.weight_scale.double()).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NeuronFp8Linear.apply_weights(None, self, x, self.bias)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per tensor", "per channel"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-1)])
@pytest.mark.parametrize("input_scale", [None, 0.01], ids=["weight only", "static input scale"])
def test_the_kernel_computes_x_times_the_dequantized_weight(per_channel, dtype, tol, input_scale):
    """Times x as FP8 holds it, where a static input scale is given (0.01: x saturates at 4.48)."""
    torch.manual_seed(1)
    layer = Fp8Layer(torch.randn(48, 32), per_channel, bias=True)
    layer.bias.data = layer.bias.data.to(dtype)  # in the model's dtype, as vLLM creates it
    layer.input_scale = None if input_scale is None else torch.tensor(input_scale)
    assert layer.weight.is_contiguous() and layer.weight.dtype == FP8
    x = torch.randn(2, 5, 32).to(dtype) * 3
    seen = x.double()
    if input_scale is not None:
        seen = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).double() * input_scale
        assert seen.abs().max() == FP8_MAX * input_scale  # some inputs saturate
    expected = seen @ layer.dequantized().t() + layer.bias.double()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 5, 48)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per tensor", "per channel"])
def test_the_fp8_weight_enters_the_graph_and_its_matmul_as_fp8(per_channel):
    """TorchNeuron's route: the weight is an f8E4M3FN argument of the program, converted where the dot reads
    it (no bf16 copy of it kept); XLA compiles and runs that program with eager's numbers."""
    torch.manual_seed(2)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    for execute in ("fx", "xla"):
        layer = Fp8Layer(torch.randn(48, 32), per_channel, bias=False)
        backend = StableHLOBackend(execute=execute)
        out = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)(x)
        torch.testing.assert_close(out, layer(x))
        (graph,) = backend.graphs
        text = graph.stablehlo
        signature = next(line for line in text.splitlines() if "func.func @main" in line)
        assert "tensor<32x48xf8E4M3FN>" in signature.split("->")[0]  # a parameter of the program
        # converted where the dot reads it: the only bf16 tensor of the weight's shape is the dot's operand
        convert = re.search(r"(%\d+) = stablehlo.convert %arg\d+ : \(tensor<32x48xf8E4M3FN>\)", text)
        assert convert and re.search(rf"dot_general %\d+, {convert.group(1)},", text)


def with_quantization_config(source, target, quantization_config: dict):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))
    return target


def test_fp8_the_kernel_does_not_serve_is_refused_by_name(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="fp8_per_block quantization is currently not supported"):
        engine_config(tiny_model_dir, quantization="fp8_per_block")
    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    model_dir = with_quantization_config(tiny_model_dir, tmp_path / "block", block)
    refused = "block-scaled FP8 \\(weight_block_size, ModelOpt FP8_PB_WO\\) is not supported"
    with pytest.raises(ValueError, match=refused):
        engine_config(model_dir, dtype="bfloat16")
    with pytest.raises(ValueError, match="awq quantization is currently not supported"):
        engine_config(tiny_model_dir, quantization="awq")


@pytest.mark.slow
def test_online_fp8_gives_hf_tokens_on_the_same_dequantized_weights(tiny_model_dir, tmp_path):
    """vLLM serves online FP8 with half-precision activations only: float16, HF in float16 too."""
    weights_path, dumped = tmp_path / "dequantized.pt", tmp_path / "graphs"
    result = run_engine(
        tiny_model_dir,
        FEW_BUCKETS_ENGINE | {"quantization": "fp8", "dtype": "float16"},
        {"VLLM_NEURON_DEVICE": "cpu", "VLLM_NEURON_DUMP_GRAPHS": str(dumped)},
        max_tokens=MAX_TOKENS,
        extra={"save_dequantized": str(weights_path)},
    )
    weights = torch.load(weights_path)
    # Every projection of both layers: q, k and v in one tensor, gate and up in one (vLLM's fused layers).
    assert len(weights) == 2 * 4
    reference = hf_with_weights(tiny_model_dir, weights, torch.float16)
    assert result["tokens"] == [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in PROMPTS]
    [stats] = result["compile_stats"]
    assert stats["unexpected_recompiles"] == 0
    # Every served graph (prefill, decode, mixed) takes each projection's weight as an f8 argument straight
    # into its dot: no graph reads a half-precision copy of a quantized weight.
    graphs = sorted(dumped.glob("*.stablehlo.mlir"))
    assert len(graphs) == stats["graphs"]
    for path in graphs:
        assert fp8_weights_into_dots(path.read_text()) == (len(weights), len(weights)), path.name


def fp8_weights_into_dots(text: str) -> tuple[int, int]:
    """A lowered program's f8E4M3FN arguments, and how many of them are converted where a dot reads them."""
    signature = next(line for line in text.splitlines() if "func.func @main" in line).split("->")[0]
    arguments = re.findall(r"(%arg\d+): tensor<[0-9x]+xf8E4M3FN>", signature)
    into_dots = 0
    for argument in arguments:
        convert = re.search(rf"(%\d+) = stablehlo.convert {argument} : ", text)
        into_dots += bool(convert and re.search(rf"dot_general [^\n]*{convert.group(1)}\b", text))
    return len(arguments), into_dots


def assert_equal_where_the_reference_is_stable(tokens, model_dir, weights, dtype) -> None:
    """With static activation scales, rounding each input to FP8 (3 mantissa bits) turns the last-bit
    differences of two implementations (RMSNorm, the order of a sum) into a whole FP8 step now and then, and
    a near tie then parts greedy tokens. So HF's tokens in `dtype` are the reference as far as HF computes
    them alike in float32 and float16 (at least MAX_TOKENS positions over the prompts); the kernel itself
    equals its definition exactly (the op tests above)."""
    runs = {
        kind: [hf_greedy(hf_with_weights(model_dir, weights, kind), prompt, MAX_TOKENS) for prompt in PROMPTS]
        for kind in (torch.float32, torch.float16)
    }
    stable = [
        next((i for i, (a, b) in enumerate(zip(full, half, strict=True)) if a != b), MAX_TOKENS)
        for full, half in zip(*runs.values(), strict=True)
    ]
    assert sum(stable) >= MAX_TOKENS, runs
    assert [t[:n] for t, n in zip(tokens, stable, strict=True)] == [
        t[:n] for t, n in zip(runs[dtype], stable, strict=True)
    ]


@pytest.fixture(scope="module")
def fp8_dynamic_checkpoint(tiny_model_dir, tmp_path_factory):
    return write_compressed_tensors_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("ct") / "fp8-dynamic")


@pytest.mark.slow
def test_a_static_compressed_tensors_checkpoint_gives_hf_tokens_on_its_dequantized_weights(
    tiny_model_dir, tmp_path
):
    """Written offline with the compressed-tensors library (the FP8 preset), served in float32
    (compressed-tensors allows it), HF in float32 on the weights the engine computes with: per-tensor weight
    scales (vLLM requantizes a fused layer's shards to their largest), static per-tensor input scales (the
    largest of a fused layer's), applied in the graph and by hooks on HF's projections. The FP8_DYNAMIC
    preset (per-channel weight scales, dynamic activations served weight-only) is served, equal to HF
    exactly, with its FP8 KV cache in tests/test_fp8_kv.py."""
    checkpoint = write_compressed_tensors_checkpoint(tiny_model_dir, tmp_path / "FP8", "FP8")
    weights_path = tmp_path / "dequantized.pt"
    result = run_engine(
        checkpoint,
        FEW_BUCKETS_ENGINE,
        {"VLLM_NEURON_DEVICE": "cpu"},
        max_tokens=MAX_TOKENS,
        extra={"save_dequantized": str(weights_path)},
    )
    weights = torch.load(weights_path)
    assert len(weights) == 2 * 4 * 2  # each projection's weight and input scale
    assert_equal_where_the_reference_is_stable(result["tokens"], tiny_model_dir, weights, torch.float32)
    [stats] = result["compile_stats"]
    assert stats["unexpected_recompiles"] == 0


@pytest.mark.slow
def test_a_modelopt_fp8_checkpoint_serves_with_its_weight_input_and_kv_cache_scales(tiny_model_dir, tmp_path):
    """ModelOpt FP8 with an FP8 KV cache (kv_cache_quant_algo), in float16 as vLLM requires for it, with
    --kv-cache-dtype left at auto: the cache is FP8 by the checkpoint's word, its scales are the
    checkpoint's, and the tokens are HF's in float16 on the engine's weights, input scales and KV scales
    (as far as HF is stable, as for the FP8 preset above)."""
    checkpoint = write_modelopt_checkpoint(tiny_model_dir, tmp_path / "modelopt")
    engine = FEW_BUCKETS_ENGINE | {"dtype": "float16"}
    result, weights = serve_with_the_checkpoints_kv_scales(
        checkpoint, engine, tmp_path, MAX_TOKENS, torch.float16
    )
    assert result["compile_stats"][0]["kv_cache_dtype"] == "uint8"
    assert_equal_where_the_reference_is_stable(result["tokens"], tiny_model_dir, weights, torch.float16)


@pytest.mark.parametrize(
    "group, refused",
    [
        (
            {
                "format": "int-quantized",
                "weights": {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True},
            },
            "group 'group_0' is not FP8 with per-tensor or per-channel weight scales \\(weights int 8-bit",
        ),
        (
            {
                "weights": {
                    "type": "float",
                    "num_bits": 8,
                    "strategy": "block",
                    "block_structure": [64, 64],
                    "symmetric": True,
                },
            },
            "is not FP8 with per-tensor or per-channel weight scales \\(weights float 8-bit, block\\)",
        ),
    ],
    ids=["int8 weights", "block-scaled weights"],
)
def test_compressed_tensors_schemes_the_kernel_does_not_serve_are_refused(
    fp8_dynamic_checkpoint, tmp_path, group, refused
):
    config = json.loads((fp8_dynamic_checkpoint / "config.json").read_text())["quantization_config"]
    config["config_groups"] = {
        "group_0": {**config["config_groups"]["group_0"], **group} | {"targets": ["Linear"]}
    }
    model_dir = with_quantization_config(fp8_dynamic_checkpoint, tmp_path / "refused", config)
    with pytest.raises(ValueError, match=refused):
        engine_config(model_dir)


def test_per_head_kv_cache_scales_are_refused_with_an_fp8_cache(fp8_dynamic_checkpoint, tmp_path):
    config = json.loads((fp8_dynamic_checkpoint / "config.json").read_text())["quantization_config"]
    config["kv_cache_scheme"] = {"type": "float", "num_bits": 8, "strategy": "attn_head", "symmetric": True}
    model_dir = with_quantization_config(fp8_dynamic_checkpoint, tmp_path / "per-head", config)
    with pytest.raises(ValueError, match="per-head FP8 KV cache scales .* are not supported"):
        engine_config(model_dir, kv_cache_dtype="fp8")
    engine_config(model_dir)  # an unquantized cache reads no scale
