"""`--kv-cache-dtype fp8`: a uint8 cache of e4m3 bits scaled per layer (kv_cache/fp8.py). Quantize and
dequantize, the write and read lowered (`stablehlo`) and run (`xla`) with the cache in place, the attention
backend's paths, and one engine serving the tiny model. The ops against naive attention over the same
dequantized K/V are tests/unit/test_paged_attention.py's decode and prefill references, kv_dtype "fp8"."""

import pytest
import torch
from vllm.model_executor.layers.attention.attention import set_default_quant_scales

from kv_cache import fp8
from kv_cache.fp8_format import RESCALE
from kv_cache.layout import allocate
from kv_cache.ops import gather_blocks, table_attention, write_kv
from server.info_endpoint import describe
from tests.conftest import ENGINE_KWARGS, FEW_BUCKETS_ENGINE, FEW_BUCKETS_GRAPHS
from tests.engine.test_lowering import BLOCK_SIZE, BLOCKS, KV_HEADS, write_inputs
from tests.engine.test_speculative import SPEC_COUNTERS, SPECULATIVE, copy_friendly_prompt
from tests.fp8_reference import (
    hf_with_weights,
    round_kv_through_fp8,
    serve_with_the_checkpoints_kv_scales,
    write_compressed_tensors_checkpoint,
)
from tests.helpers import MAX_TOKENS, PROMPTS, engine_config, hf_greedy, random_prompt, run_engine
from tests.unit.test_paged_attention import (
    FP8_KV,
    HEAD_SIZE,
    K_SCALE,
    SCALE,
    V_SCALE,
    Sequence,
    assert_close,
    expected_attention,
    randn,
)
from vllm_neuron import trn2
from vllm_neuron.attention_backend import NeuronAttentionImpl, NeuronAttentionMetadata, TableQueries
from vllm_neuron.compiler import hlo_text, xla
from vllm_neuron.compiler.stablehlo import StableHLOBackend
from vllm_neuron.upstream.vllm_runner import kv_cache_scales

# ---- quantize / dequantize -------------------------------------------------------------------------


def test_quantize_stores_trn2_e4m3_bits_and_dequantize_inverts_it():
    """The layer's scale is made for e4m3fn's +-448; trn2's e4m3 holds +-240, so one unit of the cache is
    worth scale x 448/240: the same range, +-448 x scale, in bits both formats read alike."""
    scale = torch.tensor(0.5)
    unit = scale * RESCALE
    exact = torch.tensor([0.0, 1.0, -1.5, 3.25, 240.0, -0.015625]) * unit  # e4m3 values, in units
    bits = fp8.quantize(exact, scale)
    assert bits.dtype == torch.uint8 and bits.shape == exact.shape
    assert torch.equal(fp8.dequantize(bits, scale, torch.float32), exact)
    assert int(bits[1]) == 0x38  # 1.0 in e4m3: exponent 7 (bias 7), mantissa 0
    # Out of range saturates to +-240 units, 448 x scale (not NaN, not e4m3fn's 256-448, which trn2's e4m3
    # reads as inf or NaN: no exponent of 15).
    big = fp8.quantize(torch.tensor([1e4, -1e4]), scale)
    assert big.tolist() == [0x77, 0xF7]
    torch.testing.assert_close(fp8.dequantize(big, scale, torch.float32), torch.tensor([224.0, -224.0]))
    x = torch.randn(100000, generator=torch.Generator().manual_seed(0)) * 1000
    assert not ((fp8.quantize(x, scale) & 0x78) == 0x78).any()
    # Anything else rounds to the nearest of 3 mantissa bits: relative error at most 2**-4.
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    back = fp8.dequantize(fp8.quantize(x, scale), scale, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert ((back.float() - x).abs() <= x.abs() * 2**-4 + 2**-9).all()
    assert not torch.equal(back.float(), x)


# ---- the attention backend: the write quantizes, every path reads the same values ------------------


def fp8_layer() -> torch.nn.Module:
    """An attention layer's scale buffers as vLLM registers them, set as a checkpoint's would be."""
    layer = torch.nn.Module()
    set_default_quant_scales(layer, register_buffer=True)
    for buffer, value in zip(kv_cache_scales(layer), (K_SCALE, V_SCALE), strict=True):
        buffer.fill_(value)
    return layer


def test_the_backend_accepts_fp8_and_refuses_e5m2_by_name():
    assert NeuronAttentionImpl(4, HEAD_SIZE, SCALE, 2, kv_cache_dtype="fp8_e4m3").fp8
    assert not NeuronAttentionImpl(4, HEAD_SIZE, SCALE, 2).fp8
    with pytest.raises(NotImplementedError, match="kv_cache_dtype fp8_e5m2 .*use auto, or fp8"):
        NeuronAttentionImpl(4, HEAD_SIZE, SCALE, 2, kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_only_an_fp8_cache_adds_ops_to_the_traced_layer(kv_cache_dtype):
    """The choice is made per engine in Python: an "auto" layer traces exactly as before, no FP8 op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    tokens, heads, kv_heads, block_size = 4, 4, 2, 4
    impl = NeuronAttentionImpl(heads, HEAD_SIZE, SCALE, kv_heads, kv_cache_dtype=kv_cache_dtype)
    cache_dtype = torch.uint8 if impl.fp8 else torch.float32
    kv_cache = allocate(4, block_size, kv_heads, HEAD_SIZE, cache_dtype, torch.device("cpu"))
    layer = fp8_layer()
    positions = torch.arange(tokens).view(1, -1)

    def step(query, key, value, slots):
        table = TableQueries(positions, torch.zeros_like(positions), torch.tensor([[1]]))
        metadata = NeuronAttentionMetadata(slots, table=table)
        return impl.forward(layer, query, key, value, kv_cache, metadata, torch.empty_like(query))

    graph = make_fx(step)(
        torch.randn(tokens, heads * HEAD_SIZE),
        torch.randn(tokens, kv_heads * HEAD_SIZE),
        torch.randn(tokens, kv_heads * HEAD_SIZE),
        torch.arange(tokens) + block_size,
    )
    assert ("float8_e4m3fn" in graph.code) == impl.fp8


def test_a_fresh_chunk_and_the_table_path_give_the_same_rows_over_fp8():
    """The fresh-prefill form attends over the chunk's own K/V, quantized and dequantized as the cache holds
    them: a token's result does not depend on which path its chunk took."""
    gen = torch.Generator().manual_seed(13)
    tokens, heads, kv_heads, block_size = 12, 4, 2, 4
    impl = NeuronAttentionImpl(heads, HEAD_SIZE, SCALE, kv_heads, kv_cache_dtype="fp8")
    layer = fp8_layer()
    query = randn(gen, tokens, heads * HEAD_SIZE, dtype=torch.float32)
    key = randn(gen, tokens, kv_heads * HEAD_SIZE, dtype=torch.float32)
    value = randn(gen, tokens, kv_heads * HEAD_SIZE, dtype=torch.float32)
    blocks = torch.tensor([5, 2, 7])
    slots = (blocks.repeat_interleave(block_size) * block_size) + torch.arange(tokens) % block_size
    outputs, caches = [], []
    for fresh_prefill in (True, False):
        kv_cache = allocate(9, block_size, kv_heads, HEAD_SIZE, torch.uint8, torch.device("cpu"))
        positions = torch.arange(tokens).view(1, -1)
        table = TableQueries(positions, torch.zeros_like(positions), blocks.view(1, -1))
        metadata = NeuronAttentionMetadata(
            slots, table=None if fresh_prefill else table, fresh_prefill=fresh_prefill
        )
        output = torch.empty(tokens, heads * HEAD_SIZE)
        outputs.append(impl.forward(layer, query, key, value, kv_cache, metadata, output))
        caches.append(kv_cache)
    assert torch.equal(caches[0], caches[1]) and caches[0].any()
    torch.testing.assert_close(outputs[0], outputs[1])
    # And both are attention over the dequantized K/V.
    seq = Sequence(key.view(tokens, kv_heads, -1), value.view(tokens, kv_heads, -1), blocks)
    back = FP8_KV.read_back(seq)
    expected = expected_attention(query.view(tokens, heads, -1), back, torch.arange(tokens), torch.float32)
    assert_close(outputs[0].view(tokens, heads, -1), expected, torch.float32)
    keys, _ = gather_blocks(caches[0], blocks.view(1, -1))
    key_bits, _ = FP8_KV.stored(seq.keys, seq.values)
    assert torch.equal(keys[:, 0], key_bits.transpose(0, 1))


# ---- lowering: stablehlo, and xla with the cache in place --------------------------------------------


class Fp8WriteThenRead(torch.nn.Module):
    """tests/engine/test_lowering.py's WriteThenRead over a uint8 cache: quantize and write the step's rows,
    then attend over blocks that hold them. The scales are buffers, as on vLLM's Attention layer."""

    def __init__(self, zeros=None) -> None:
        super().__init__()
        self.register_buffer(
            "kv_cache", allocate(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, torch.uint8, "cpu", zeros)
        )
        self.register_buffer("k_scale", torch.tensor(K_SCALE))
        self.register_buffer("v_scale", torch.tensor(V_SCALE))

    def forward(self, key, value, slots, blocks):
        write_kv(self.kv_cache, fp8.quantize(key, self.k_scale), fp8.quantize(value, self.v_scale), slots)
        query = key.new_ones(blocks.shape[0], 2, 2 * KV_HEADS, HEAD_SIZE)
        positions = torch.full((blocks.shape[0], 2), blocks.shape[1] * BLOCK_SIZE - 1)
        return table_attention(
            query, self.kv_cache, blocks, positions, SCALE, None, None, self.k_scale, self.v_scale
        )


def _xla_zeros(shape, dtype, device):
    return xla.allocate_zeros(shape, dtype)


@pytest.mark.parametrize("execute", [None, "xla"])
def test_the_fp8_write_and_read_lower_and_run_with_the_cache_in_place(execute, monkeypatch):
    """StableHLO: a clamp at +-240, a convert to f8E4M3FN and a bitcast to ui8 before the one aliased scatter,
    a bitcast back and a convert after the gather; neuronx-cc's rules hold with its FP8 option (as the
    platform passes it). Under `xla` the uint8 cache is updated where it lies (an f8-typed cache is not:
    docs/research/issue-40-fp8.md, section 3)."""
    monkeypatch.setenv("NEURON_CC_FLAGS", trn2.FP8_COMPILER_OPTION)
    backend = StableHLOBackend() if execute is None else StableHLOBackend(execute="xla")
    module = Fp8WriteThenRead(_xla_zeros if execute else None)
    address = module.kv_cache.data_ptr()
    out = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(*write_inputs())
    eager = Fp8WriteThenRead()
    expected = eager(*write_inputs())
    torch.testing.assert_close(out, expected)
    assert torch.equal(module.kv_cache, eager.kv_cache) and eager.kv_cache.any()
    assert module.kv_cache.data_ptr() == address
    (graph,) = backend.graphs
    text = graph.stablehlo
    assert "f8E4M3FN" in text and text.count("stablehlo.bitcast_convert") >= 2
    assert graph.broken_rules == []
    (write,) = hlo_text.cache_writes(text)
    assert write.problems == [] and write.scatters == [(2 * KV_HEADS * 6, HEAD_SIZE)]
    # The scales enter as arguments (f32 scalars), not constants: a checkpoint's values change no graph.
    main = next(line for line in text.splitlines() if "func.func @main" in line)
    assert main.count(": tensor<f32>") == 2 and "e-02" not in text
    if execute == "xla":
        assert graph.compiled is not None and graph.compiled.problems == []
        assert graph.summary()["caches_in_place"] is True


# ---- the engine ------------------------------------------------------------------------------------


def test_the_info_endpoint_names_the_cache_dtype(tiny_model_dir):
    assert describe(engine_config(tiny_model_dir))["kv_cache"]["dtype"] == "float32"
    assert describe(engine_config(tiny_model_dir, kv_cache_dtype="fp8"))["kv_cache"]["dtype"] == "fp8"


# A float32 block of the tiny model: K and V, 32 tokens, 2 KV heads of 32, 4 bytes, 2 layers.
F32_BLOCK_BYTES = 2 * 32 * 2 * 32 * 4 * 2


# HF with each layer's keys and values rounded through FP8 at vLLM's default scales: what an FP8 cache
# without checkpoint scales stores (tests/fp8_reference.py).
UNIT_SCALES = {0: (1.0, 1.0), 1: (1.0, 1.0)}


@pytest.mark.slow
def test_the_tiny_model_serves_with_an_fp8_cache(tiny_model_dir):
    """One engine with `kv_cache_dtype="fp8"`: uint8 caches, a byte per element (four times the float32
    cache's blocks in the same memory), no recompile after warm-up, and HF's greedy tokens over the same
    FP8-rounded keys and values. A prefix-cache hit gives the tokens of the same prompt without one, since
    every path reads the same quantized K/V."""
    engine = {
        **FEW_BUCKETS_ENGINE,
        "kv_cache_dtype": "fp8",
        "kv_cache_memory_bytes": 40 * F32_BLOCK_BYTES,
        "disable_log_stats": False,  # the prefix-cache hit counter
    }
    again = {"prompt": PROMPTS[2], "params": {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
    extra = {"sampling": [again], "metrics": ["vllm:prefix_cache_hits"]}
    result = run_engine(tiny_model_dir, engine, {"VLLM_NEURON_DEVICE": "cpu"}, extra=extra)
    [stats] = result["compile_stats"]
    assert (stats["graphs"], stats["unexpected_recompiles"]) == (FEW_BUCKETS_GRAPHS, 0)
    assert stats["kv_cache_dtype"] == "uint8"
    assert stats["kv_cache_shape"] == [2 * 2, 4 * 40, 32, 32]
    # The prefix-cache hit: the whole blocks of the 120-token prompt, then the same tokens.
    assert result["metrics"]["vllm:prefix_cache_hits"] >= 96
    assert result["sampled_tokens"] == [result["tokens"][2]]
    reference = round_kv_through_fp8(hf_with_weights(tiny_model_dir, {}), UNIT_SCALES)
    assert result["tokens"] == [hf_greedy(reference, prompt, 12) for prompt in PROMPTS]


@pytest.mark.slow
def test_a_checkpoints_kv_scales_are_served_and_give_hf_tokens_over_the_same_fp8_keys(
    tiny_model_dir, tmp_path
):
    """A compressed-tensors checkpoint with FP8 weights and an FP8 KV cache scheme (static per-tensor scales,
    calibrated per layer), written offline with the library and served in float32 with --kv-cache-dtype fp8:
    each layer's scales are the checkpoint's (not vLLM's default 1.0), and the greedy tokens equal HF's on
    the engine's dequantized weights with each layer's keys and values rounded through FP8 by those scales
    (the exact reference: the cache stores those values, attention reads them back)."""
    checkpoint = write_compressed_tensors_checkpoint(tiny_model_dir, tmp_path / "fp8-kv", kv_cache=True)
    engine = FEW_BUCKETS_ENGINE | {"kv_cache_dtype": "fp8"}
    result, weights = serve_with_the_checkpoints_kv_scales(
        checkpoint, engine, tmp_path, MAX_TOKENS, torch.float32
    )
    [stats] = result["compile_stats"]
    assert (stats["kv_cache_dtype"], stats["unexpected_recompiles"]) == ("uint8", 0)
    reference = hf_with_weights(tiny_model_dir, weights)
    assert result["tokens"] == [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in PROMPTS]


@pytest.mark.slow
def test_speculation_and_preemption_over_fp8_give_hf_tokens_over_the_same_fp8_keys(tiny_model_dir):
    """n-gram verify rows (several queries a row over the quantized pages) and preempted requests recomputed
    into a small FP8 cache give HF's greedy tokens over the same FP8-rounded keys and values."""
    prompts = [copy_friendly_prompt(8 + (29 * i) % 150, seed=700 + i) for i in range(8)]
    prompts += [random_prompt(5 + (41 * i) % 120, seed=800 + i) for i in range(4)]
    engine = {
        **ENGINE_KWARGS,
        "kv_cache_dtype": "fp8",
        "max_num_seqs": 8,
        "kv_cache_memory_bytes": 4 * F32_BLOCK_BYTES,  # 16 FP8 blocks: 8 requests want up to 48
        "disable_log_stats": False,
        "speculative_config": SPECULATIVE,
        "additional_config": {
            "prefill_buckets": [64],
            "decode_batch_buckets": [2, 8],
            "context_buckets": [256],
        },
    }
    speculating = run_engine(
        tiny_model_dir,
        engine,
        {"VLLM_NEURON_DEVICE": "cpu"},
        prompts=prompts,
        max_tokens=16,
        extra={"metrics": SPEC_COUNTERS},
    )
    reference = round_kv_through_fp8(hf_with_weights(tiny_model_dir, {}), UNIT_SCALES)
    assert speculating["tokens"] == [hf_greedy(reference, prompt, 16) for prompt in prompts]
    assert speculating["compile_stats"][0]["kv_cache_shape"][1] == 16
    assert speculating["preemptions"] > 0
    assert speculating["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
