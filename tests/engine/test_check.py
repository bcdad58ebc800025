"""`vllm-neuron check`, run as a user runs it (`python -m server.cli check MODEL ... --json`): a supported
model (exit 0, every figure present and equal to what the capacity model gives for its config), a refused
architecture (MLA) and a model whose graph cannot lower (both exit 1 and say why); the table for people."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_llama
from vllm_neuron.compiler import graph_memory
from vllm_neuron.planning import capacity
from vllm_neuron.planning.capacity import ModelFigures
from vllm_neuron.planning.pricing import DEFAULT_INSTANCE, INSTANCES
from vllm_neuron.trn2 import GIB, KVSettings

ROOT = Path(__file__).resolve().parents[2]
REMOTE_CODE = Path(__file__).parents[1] / "remote_code" / "modeling_complex_llama.py"


def check(*args: str, json_out: bool = True) -> tuple[int, dict | str, str]:
    """Exit code, report (JSON, or the table's text) and stderr of `vllm-neuron check`."""
    command = [sys.executable, "-m", "server.cli", "check", *args, *(["--json"] if json_out else [])]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = json.loads(done.stdout) if json_out and done.stdout.strip() else done.stdout
    return done.returncode, report, done.stderr[-3000:]


# ---- the command --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_layer_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-3", num_layers=3)


@pytest.mark.slow
def test_a_supported_model_serves_with_every_figure(three_layer_llama):
    """3 layers checked as 2 (the default): per-layer sizes are extrapolated, exactly for Llama."""
    code, report, stderr = check(
        str(three_layer_llama),
        *("--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "2"),
        *("--gpu-memory-utilization", "0.9", "--price-per-hour", "10"),
    )
    assert code == 0, stderr
    assert report["verdict"]["status"] == "serves" and report["verdict"]["exit_code"] == 0

    # The plan serve resolves for trn2 (VLLM_NEURON_TARGET=neuron: mixed calls take 128-token chunks), every
    # graph of it lowered.
    plan, lowering = report["plan"], report["lowering"]
    buckets = plan["buckets"]
    assert buckets["prefill_tokens_while_decoding"] == 128
    assert plan["graphs"] == {
        "prefill": 2,  # tokens 128 and 256 over the one context bucket 256
        "decode": len(buckets["decode_batch_buckets"]),
        "mixed": len(buckets["mixed_batch_buckets"]),
        "verify": 0,  # no --speculative-config
        "total": 2 + len(buckets["decode_batch_buckets"]) + len(buckets["mixed_batch_buckets"]),
    }
    assert lowering["graphs_lowered"] == len(lowering["graphs"]) == plan["graphs"]["total"]
    assert (lowering["layers_checked"], lowering["layers"], lowering["weights"]) == (2, 3, "random")
    assert all(graph["stablehlo_ops"] > 0 and graph["aliased_inputs"] for graph in lowering["graphs"])
    assert all(graph["neuronx_cc_rules"]["broken"] == [] for graph in lowering["graphs"])
    low, high = capacity.COMPILE_SECONDS_PER_LAYER
    sampler_low, sampler_high = capacity.SAMPLER_COMPILE_SECONDS
    estimate = report["compile_estimate"]
    graphs = plan["graphs"]["total"]
    assert (estimate["seconds_low"], estimate["seconds_high"]) == pytest.approx(
        (graphs * (3 * low + sampler_low), graphs * (3 * high + sampler_high))
    )
    assert report["compile_cache"]["root"] == os.environ["VLLM_NEURON_CACHE_ROOT"]
    assert report["compile_cache"]["folders"] == []

    # The model's figures from its config: vLLM pads the vocabulary to a multiple of 64, and beside the
    # weights keeps one rotary cos/sin table (the layers share it) and four scale scalars per attention
    # layer.
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.model_executor.layers.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE

    config = AutoConfig.from_pretrained(three_layer_llama)
    hf_parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    padding = -config.vocab_size % DEFAULT_VOCAB_PADDING_SIZE
    parameters = hf_parameters + 2 * padding * config.hidden_size
    head_dim = config.hidden_size // config.num_attention_heads
    buffers = config.max_position_embeddings * head_dim * 4 + config.num_hidden_layers * 4 * 4
    expected = ModelFigures(
        name=str(three_layer_llama),
        parameters=parameters,
        weight_bytes=parameters * 4 + buffers,
        layers=3,
        heads=4,
        kv_heads=2,
        head_dim=head_dim,
        kv_dtype_bytes=4,
    )
    figures = report["model_figures"]
    assert {key: figures[key] for key in vars(expected)} == vars(expected)
    assert figures["kv_bytes_per_token"] == 2 * 3 * 2 * head_dim * 4

    # Every TP row, the suggestion, the roofline and the cost, as the capacity model gives them.
    # The graph reserve derived from the lowered graphs (docs/check.md#graph-reserve), recorded for serve.
    reserve = report["graph_reserve"]
    # Each of --max-num-seqs 2 requests a call, the tokens beyond them in calls of the smallest prefill
    # bucket; every graph's inputs staged for the engine and device threads and 8 compile workers (trn2's
    # most by default: the check cannot know the host's).
    tokens = plan["max_num_batched_tokens"]
    calls = 2 + (tokens - 2) // buckets["prefill_buckets"][0]
    derived = graph_memory.derive(lowering["graphs"], calls, compile_workers=8)
    assert reserve == {"bytes": derived.total, "source": "derived", "derived": derived.as_dict()}
    assert derived.calls_per_step == calls and derived.calling_threads == 10 and derived.compiled == 0
    # Every call returns one row's float32 logits at least, and is handed inputs of its own.
    assert all(graph["output_bytes"] >= config.vocab_size * 4 for graph in lowering["graphs"])
    assert all(graph["input_bytes"] > 0 for graph in lowering["graphs"])
    assert report["trn2"]["graph_reserve_bytes"] == derived.total < 4 * GIB
    settings = KVSettings(
        kv_cache_fraction=0.3, gpu_memory_utilization=0.9, graph_reserve_bytes=derived.total
    )
    batch, context = buckets["decode_batch_buckets"][-1], buckets["context_buckets"][-1]
    instance = INSTANCES[DEFAULT_INSTANCE]
    assert report["price"]["dollars_per_hour"] == 10 and report["price"]["instance"] == instance.name

    def dollars(tokens_per_s: float, tp: int) -> float:
        return 10 * capacity.chips(tp) / instance.chips / (tokens_per_s * 3600) * 1e6

    options = []
    rows = report["tensor_parallel"]
    assert [row["tp"] for row in rows] == [1, 2, 4]  # powers of two the 4 heads over 2 KV heads split into
    for row in rows:
        rank = capacity.rank_capacity(expected, row["tp"], settings)
        rate = capacity.throughput(expected, rank, batch, 256, context)
        options.append((rank, rate))
        assert row["chips"] == rank.chips == 1
        assert row["weight_bytes"] == pytest.approx(rank.weight_bytes)
        assert row["kv_bytes_per_token"] == rank.kv_bytes_per_token
        assert row["kv_tokens"] == rank.kv_tokens > 0
        assert row["requests_of_max_model_len"] == rank.kv_tokens // 256
        assert row["decode"]["rows"] == batch
        assert row["decode"]["tokens_per_s"] == pytest.approx(rate.tokens_per_s)
        assert row["dollars_per_million_output_tokens"] == pytest.approx(
            dollars(rate.tokens_per_s, row["tp"])
        )
    suggested = capacity.suggest_tensor_parallel(options)
    assert report["suggested"]["tensor_parallel_size"] == suggested
    rank = next(rank for rank, _ in options if rank.tp == suggested)
    (throughput,) = report["throughput"]  # one decode context bucket
    full = capacity.throughput(expected, rank, batch, context, context)
    one = capacity.throughput(expected, rank, 1, context, context)
    assert throughput["full_batch"]["tokens_per_s"] == pytest.approx(full.tokens_per_s)
    assert throughput["one_request"]["tokens_per_s"] == pytest.approx(one.tokens_per_s)
    assert throughput["dollars_per_million_output_tokens"] == pytest.approx(
        dollars(full.tokens_per_s, suggested)
    )


@pytest.mark.slow
def test_a_refused_architecture_exits_non_zero_naming_the_reason(tmp_path):
    from tests.architectures import ARCHITECTURES, build

    deepseek = next(arch for arch in ARCHITECTURES if arch.name == "DeepSeek-V2")
    code, table, stderr = check(str(build(deepseek, tmp_path / "deepseek")), json_out=False)
    assert code == 1, stderr
    assert "refused: Neuron plugin: MLA (multi-head latent attention) is not supported" in table
    assert "exit code 1" in table and "Traceback" not in table + stderr


@pytest.mark.slow
def test_a_graph_that_cannot_lower_exits_non_zero_naming_the_op_and_line(tmp_path, monkeypatch):
    """Remote code whose rotary angles are complex numbers, served through vLLM's Transformers backend."""
    model = build_tiny_llama(tmp_path / "complex-llama")
    shutil.copy(REMOTE_CODE, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["ComplexLlamaForCausalLM"]
    config["auto_map"] = {  # vLLM's Transformers backend builds the base model
        "AutoModel": f"{REMOTE_CODE.stem}.ComplexLlamaModel",
        "AutoModelForCausalLM": f"{REMOTE_CODE.stem}.ComplexLlamaForCausalLM",
    }
    (model / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))

    code, report, stderr = check(
        str(model), "--trust-remote-code", "--max-model-len", "256", "--max-num-seqs", "2"
    )
    assert code == 1, stderr
    verdict = report["verdict"]
    line = next(n for n, text in enumerate(REMOTE_CODE.read_text().splitlines(), 1) if ".real" in text)
    assert verdict["status"] == "does not lower" and not verdict["serves"]
    assert verdict["op"] == "torch.aten.view_as_real"
    assert verdict["source"].endswith(f"{REMOTE_CODE.name}:{line} in forward")
    assert verdict["call"].startswith("prefill of")
    assert report["plan"]["graphs"]["total"] > 0 and "model_figures" not in report


@pytest.mark.slow
def test_nixl_block_copies_are_in_the_plan_and_lowered_under_their_names(three_layer_llama, monkeypatch):
    """With a NixlConnector, the plan counts its gather and scatter graphs as the worker compiles them, and
    the report stays JSON on stdout (NIXL's logger writes to stdout)."""
    from tests.serving import free_port

    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port()))
    transfer = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    code, report, stderr = check(
        str(three_layer_llama),
        *("--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "2"),
        *("--kv-transfer-config", transfer),
    )
    assert code == 0, stderr
    plan, lowering = report["plan"], report["lowering"]
    # A request's 8 blocks of 32 tokens, far within a copy's 256 MiB: buckets of 1, 2, 4 and 8 blocks.
    buckets = (1, 2, 4, 8)
    assert plan["graphs"]["nixl"] == 2 * len(buckets)
    assert lowering["graphs_lowered"] == plan["graphs"]["total"] == report["compile_estimate"]["graphs"]
    labels = [graph["call"] for graph in lowering["graphs"]]
    copies = [f"NIXL {graph} of {n} blocks: bucket {n}" for n in buckets for graph in ("gather", "scatter")]
    assert labels[: len(copies)] == copies
    assert not [label for label in labels if label.startswith("graph ")]


# ---- the table ----------------------------------------------------------------------------------------


def test_the_table_shows_verdict_graphs_capacity_and_cost(monkeypatch):
    """The report of Llama-3.1-8B's figures with the plan serve resolves for trn2 at max_model_len 8192."""
    from benchmarks.capacity import LLAMA_8B
    from server.check_report import Lowering, Plan, Report, Verdict, assess, price
    from server.check_table import render
    from vllm_neuron.config import NeuronConfig

    monkeypatch.setenv("VLLM_NEURON_TARGET", "neuron")
    limits = dict(max_model_len=8192, max_num_seqs=32, max_num_batched_tokens=2048, block_size=32)
    neuron = NeuronConfig.resolve({}, limits)
    plan = Plan(max_model_len=8192, max_num_batched_tokens=2048, tensor_parallel_size=4, neuron=neuron)
    graph = {
        "call": "decode of 1 request: batch 1 x context 8192",
        "stablehlo_ops": 500,
        "largest_tensor": {"shape": [2, 3], "dtype": "bfloat16", "bytes": 12},
        "neuronx_cc_rules": {"checked": 16, "broken": ["warns: variadic reduce (...): stablehlo.reduce"]},
    }
    report = Report(
        model="Llama-3.1-8B",
        dtype="bfloat16",
        verdict=Verdict("serves"),
        plan=plan,
        lowering=Lowering(2, 32, "random", [graph] * neuron.buckets.num_graphs, 60.0),
        figures=LLAMA_8B.figures(),
        price=price(None),
    )
    assess(report, max_ranks=64)
    text = render(report)
    assert report.suggested_tp == 8 and report.exit_code == 0
    assert "lowers and fits at --tensor-parallel-size 4 (exit code 0)" in text and "only a trn2 tells" in text
    assert f"-> {neuron.buckets.num_graphs} graphs" in text
    warnings = neuron.buckets.num_graphs
    assert f"neuronx-cc's rules: 16 checked on every graph, {warnings} warnings" in text
    assert "    decode of 1 request: batch 1 x context 8192: warns: variadic reduce" in text
    assert "| 4 | 1 | 3.74 GiB | 32 KiB | 235,929 | 28 |" in text  # docs/performance.md's row
    assert "suggested: --tensor-parallel-size 8" in text
    assert "DECODE THROUGHPUT AND COST AT TP 8" in text and "$35.76/h" in text
    model = LLAMA_8B.figures()
    step_ms = capacity.step_seconds(model, 8, 32, 8192) * 1e3
    rate = capacity.decode_tokens_per_s(model, 8, 32, 32, 8192)
    assert f"| 8192 | 32 | {step_ms:.2f} | {rate:,.0f} |" in text
    assert not math.isnan(report.contexts[-1].dollars_per_million)


def test_adapter_slots_count_with_the_weights_of_each_rank():
    """--enable-lora: the slots' bytes each rank holds whole, and those tensor parallelism splits."""
    from benchmarks.capacity import LLAMA_8B
    from vllm_neuron.planning.capacity import AdapterSlots

    plain = LLAMA_8B.figures()
    slots = AdapterSlots(slots=4, rank=16, whole_bytes=100 * 2**20, split_bytes=300 * 2**20)
    figures = dataclasses.replace(plain, adapters=slots)
    assert slots.bytes_per_slot(4) == (100 + 75) * 2**20 / 4
    for tp in (1, 4):
        assert figures.weight_bytes_per_rank(tp) == plain.weight_bytes_per_rank(tp) + slots.bytes_per_rank(tp)
