"""FP8 weights (issue 40): vLLM's FP8 linear methods on the plugin's kernel (vllm_neuron/quantization/fp8.py).
The weight quantization equals its definition (vLLM's, e4m3fn's +-448); the kernel moves weights and scales
to trn2's +-240 at load and computes x times the dequantized weight; the graph takes the weight's bits as a
uint8 argument, views them as e4m3 next to its matmul (StableHLO), and XLA runs it with eager's numbers; a
tiny model served with --quantization fp8 gives the greedy tokens of HF on the same dequantized weights; what
the kernel does not serve is refused by name."""

import json
import os
import re
import shutil

import pytest
import torch

from kv_cache.fp8_format import FP8, FP8_MAX, OCP_MAX, RESCALE
from tests.conftest import FEW_BUCKETS_ENGINE
from tests.fp8_reference import (
    hf_with_weights,
    serve_with_the_checkpoints_kv_scales,
    write_compressed_tensors_checkpoint,
    write_modelopt_checkpoint,
)
from tests.helpers import PROMPTS, engine_config, hf_greedy, run_engine
from vllm_neuron import trn2
from vllm_neuron.compiler import hlo_text
from vllm_neuron.compiler.stablehlo import StableHLOBackend
from vllm_neuron.quantization.fp8 import NeuronFp8Linear, dequantized_weight, scaled_fp8_quant

MAX_TOKENS = 12


def test_static_and_dynamic_quantization_equal_their_definition():
    """vLLM's contract, e4m3fn's range: vLLM requantizes a checkpoint's weights with its scales through it."""
    torch.manual_seed(0)
    x = torch.randn(6, 32) * 3
    scale = torch.tensor([0.02])
    q, s = scaled_fp8_quant(x, scale)
    assert q.dtype == FP8 and s is scale
    assert torch.equal(q.float(), (x / 0.02).clamp(-OCP_MAX, OCP_MAX).to(FP8).float())
    q, s = scaled_fp8_quant(x)  # dynamic per tensor: the absolute maximum maps to FP8's largest value
    assert s.shape == (1,) and q.float().abs().max() == OCP_MAX
    q, s = scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    assert s.shape == (6, 1) and torch.equal(q.float().abs().amax(1), torch.full((6,), OCP_MAX))
    columns = torch.rand(32) + 0.01
    q, _ = scaled_fp8_quant(x, columns, group_shape=(-1, 1))
    assert torch.equal(q.float(), (x / columns).clamp(-OCP_MAX, OCP_MAX).to(FP8).float())
    q, _ = scaled_fp8_quant(x, scale, num_token_padding=8)
    assert q.shape == (8, 32) and not q[6:].float().any()


class Fp8Layer(torch.nn.Module):
    """A linear layer as vLLM leaves it for the kernel: W8 [in, out] as a transposed view, its scale."""

    def __init__(self, weight: torch.Tensor, per_channel: bool, bias: bool) -> None:
        super().__init__()
        amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax().reshape(1)
        scale = amax / OCP_MAX
        quantized, _ = scaled_fp8_quant(weight, scale)
        self.weight = torch.nn.Parameter(quantized.t(), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = torch.nn.Parameter(torch.randn(weight.shape[0]), requires_grad=False) if bias else None
        NeuronFp8Linear.process_weights_after_loading(None, self)

    def dequantized(self) -> torch.Tensor:
        return dequantized_weight(self).double().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NeuronFp8Linear.apply_weights(None, self, x, self.bias)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per tensor", "per channel"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-1)])
@pytest.mark.parametrize("input_scale", [None, 0.01], ids=["weight only", "static input scale"])
def test_the_kernel_computes_x_times_the_dequantized_weight(per_channel, dtype, tol, input_scale):
    """Times x as FP8 holds it, where a static input scale is given (0.01 at load, for e4m3fn: x saturates at
    4.48, as on a GPU)."""
    torch.manual_seed(1)
    layer = Fp8Layer(torch.randn(48, 32), per_channel, bias=True)
    layer.bias.data = layer.bias.data.to(dtype)  # in the model's dtype, as vLLM creates it
    layer.input_scale = None if input_scale is None else torch.tensor(input_scale * RESCALE)  # loaded
    assert layer.weight.is_contiguous() and layer.weight.dtype == torch.uint8
    assert layer.weight.view(FP8).float().abs().max() <= FP8_MAX  # trn2's e4m3
    x = torch.randn(2, 5, 32).to(dtype) * 3
    seen = x.double()
    if input_scale is not None:
        unit = input_scale * RESCALE
        seen = (x.float() / unit).clamp(-FP8_MAX, FP8_MAX).to(FP8).double() * unit
        torch.testing.assert_close(seen.abs().max().item(), OCP_MAX * input_scale)  # some inputs saturate
    expected = seen @ layer.dequantized().t() + layer.bias.double()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 5, 48)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per tensor", "per channel"])
def test_the_fp8_weight_enters_the_graph_and_its_matmul_as_fp8(per_channel, monkeypatch):
    """TorchNeuron's route: the weight is a uint8 argument of the program (TorchNeuron has no torch dtype for
    an f8E4M3FN one), viewed as f8E4M3FN and converted where the dot reads it (no bf16 copy of it kept); XLA
    compiles and runs that program with eager's numbers. neuronx-cc's rules hold with its FP8 option."""
    monkeypatch.setenv("NEURON_CC_FLAGS", trn2.FP8_COMPILER_OPTION)
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
        assert "tensor<32x48xui8>" in signature.split("->")[0]  # a parameter of the program
        assert graph.broken_rules == []
        # converted where the dot reads it: the only bf16 tensor of the weight's shape is the dot's operand
        assert re.search(r"stablehlo.bitcast_convert %arg\d+ : \(tensor<32x48xui8>\)", text)
        convert = re.search(r"(%\d+) = stablehlo.convert %\d+ : \(tensor<32x48xf8E4M3FN>\)", text)
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
    # Every served graph (prefill, decode, mixed) takes each projection's weight as an FP8 argument (its bits)
    # straight into its dot: no graph reads a half-precision copy of a quantized weight.
    graphs = sorted(dumped.glob("*.stablehlo.mlir"))
    assert len(graphs) == stats["graphs"]
    for path in graphs:
        assert fp8_weights_into_dots(path.read_text()) == (len(weights), len(weights)), path.name
        rules = path.with_name(path.name.replace(".stablehlo.mlir", ".rules.txt")).read_text()
        assert rules.endswith("16 of neuronx-cc's 16 rules checked hold.\n"), rules


def fp8_weights_into_dots(text: str) -> tuple[int, int]:
    """A lowered program's FP8 weights (uint8 arguments viewed as f8E4M3FN), and how many of them are
    converted where a dot reads them."""
    module = hlo_text.parse(text)
    weights = into_dots = 0
    for index, (_, dtype) in enumerate(module.argument_types):
        value, names = f"%arg{index}", []
        while dtype == "ui8" and len(module.users(value)) == 1:
            user = module.users(value)[0]
            names.append(user.name)
            value = user.result
            if user.name not in ("stablehlo.bitcast_convert", "stablehlo.reshape"):
                break
        if names[:1] == ["stablehlo.bitcast_convert"]:
            weights += 1
            into_dots += names[-1] == "stablehlo.convert" and all(
                user.name == "stablehlo.dot_general" for user in module.users(value)
            )
    return weights, into_dots


# Logits this close to HF's largest are a near tie under FP8 activations: a last-bit difference of two
# implementations (RMSNorm, the order of a sum) turns an input's FP8 rounding a whole step now and then.
NEAR_TIE = 0.03


def assert_equal_where_the_reference_is_stable(tokens, model_dir, weights, dtype) -> None:
    """With static activation scales, rounding each input to FP8 (3 mantissa bits) turns the last-bit
    differences of two implementations into a whole FP8 step now and then, and a near tie then parts greedy
    tokens. So HF in `dtype` on the engine's own tokens (teacher-forced, no divergence carried on): every
    engine token is HF's largest logit or within NEAR_TIE of it, and most are HF's exactly; the kernel itself
    equals its definition exactly (the op tests above)."""
    model = hf_with_weights(model_dir, weights, dtype)
    exact = total = 0
    with torch.no_grad():
        for index, (prompt, generated) in enumerate(zip(PROMPTS, tokens, strict=True)):
            ids = list(prompt)
            for position, token in enumerate(generated):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                gap = float(logits.max() - logits[token])
                assert gap <= NEAR_TIE, (index, position, token, int(logits.argmax()), gap)
                exact += gap == 0
                total += 1
                ids.append(token)
    assert exact >= 0.75 * total, (exact, total)


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
    exactly, with its FP8 KV cache in tests/engine/test_fp8_kv.py."""
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


@pytest.mark.parametrize("options", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}])
def test_fp8_passes_neuronx_cc_its_fp8_option_beside_the_users_flags(tiny_model_dir, options, monkeypatch):
    """FP8 weights or an FP8 KV cache: the FP8 option in NEURON_CC_FLAGS (NCC_EVRF051), unquoted (TorchNeuron
    splits the flags on whitespace, no shell), the user's own flags kept, once however often it is set."""
    monkeypatch.setenv("NEURON_CC_FLAGS", "--enable-saturate-infinity")
    engine_config(tiny_model_dir, dtype="bfloat16", **options)
    engine_config(tiny_model_dir, dtype="bfloat16", **options)
    assert os.environ["NEURON_CC_FLAGS"].split() == ["--enable-saturate-infinity", trn2.FP8_COMPILER_OPTION]
    monkeypatch.delenv("NEURON_CC_FLAGS")
    engine_config(tiny_model_dir, dtype="bfloat16")
    assert "NEURON_CC_FLAGS" not in os.environ  # nothing without FP8


def test_another_hlo2tensorizer_option_beside_fp8_is_refused_by_name(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "--internal-hlo2tensorizer-options=--verify-hlo=true")
    with pytest.raises(ValueError, match="neuronx-cc would take only one --internal-hlo2tensorizer-options"):
        engine_config(tiny_model_dir, dtype="bfloat16", quantization="fp8")
