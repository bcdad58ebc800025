"""`vllm-neuron check`'s report as text for people: verdict, graphs, memory and capacity per TP, throughput
and cost. Every figure here is also in the JSON (server/check_report.py's to_json)."""

import json

from server.check_report import Report
from vllm_neuron import trn2
from vllm_neuron.config import NeuronConfig
from vllm_neuron.planning import capacity
from vllm_neuron.trn2 import GIB


def render(report: Report) -> str:
    lines = [f"vllm-neuron check: {report.model} ({report.dtype})"]
    if report.plan is not None:
        plan = report.plan
        lines.append(
            f"  max_model_len {plan.max_model_len}, max_num_seqs {plan.max_num_seqs}, max_num_batched_tokens "
            f"{plan.max_num_batched_tokens}, --tensor-parallel-size {plan.tensor_parallel_size}"
        )
    lines += ["", "VERDICT", *_verdict(report)]
    if report.plan is not None:
        lines += ["", "GRAPHS (the bucket plan serve resolves for trn2)", *_graphs(report)]
    if report.figures is not None:
        lines += ["", "MEMORY AND CAPACITY PER TENSOR-PARALLEL SIZE ON TRN2", *_capacity(report)]
        if report.contexts:
            lines += ["", f"DECODE THROUGHPUT AND COST AT TP {report.suggested_tp}", *_throughput(report)]
    return "\n".join(lines)


def _verdict(report: Report) -> list[str]:
    verdict = report.verdict
    if verdict.serves:
        tp = report.plan.tensor_parallel_size
        return [
            f"  lowers and fits at --tensor-parallel-size {tp} (exit code 0): every graph lowered on",
            "  TorchNeuron's route as modelled here and meets neuronx-cc's written rules, and the weights,",
            "  KV cache and graph reserve fit trn2's memory on paper; only a trn2 tells whether neuronx-cc",
            "  accepts each graph, how long it compiles, the NEFF sizes and the runtime's memory",
        ]
    lines = [f"  {verdict.status}: {verdict.reason} (exit code {report.exit_code})"]
    if verdict.call:
        lines.append(f"  in the graph of: {verdict.call}")
    return lines


def _graphs(report: Report) -> list[str]:
    plan = report.plan
    graphs = plan.graphs
    total = sum(graphs.values())
    lines = [
        f"  {plan.neuron.buckets.describe()}",
        "  per phase: "
        + ", ".join(f"{phase} {count}" for phase, count in graphs.items())
        + f"; {total} in all",
    ]
    lowering = report.lowering
    if lowering is not None:
        lines.append(
            f"  lowered to StableHLO: {len(lowering.graphs)} of {total}, no graph breaks, no unsupported ops "
            f"(one rank at TP=1 with {lowering.layers_checked} of {lowering.layers} layers, "
            f"{lowering.weights} weights, {lowering.seconds:.0f} s here)"
        )
        ops = [graph["stablehlo_ops"] for graph in lowering.graphs]
        largest = max(lowering.graphs, key=lambda graph: graph["largest_tensor"]["bytes"])["largest_tensor"]
        layers = _plural(lowering.layers_checked, "layer")
        flash = sum(1 for graph in lowering.graphs if graph.get("flash_attention"))
        kernel = f" outside TorchNeuron's flash attention kernel (which {flash} graphs call)" if flash else ""
        lines.append(
            f"  StableHLO ops per graph of {layers}: {min(ops)}-{max(ops)}; largest intermediate{kernel} "
            f"{largest['dtype']} {largest['shape']} ({largest['bytes'] / 2**20:.1f} MiB)"
        )
        lines += _rules(lowering.graphs)
        lines += _compiled(lowering.graphs, layers)
    if report.reserve is not None:
        lines.append(f"  graph reserve per rank: {report.reserve.describe()}")
    if report.figures is not None:
        lines.append(f"  trn2 warm-up compile, estimate: {_compile(total, report)} per rank")
        lines.append(f"    basis: {capacity.COMPILE_BASIS}")
    if report.cache is not None:
        cache = report.cache
        ranks = sorted(folder.tensor_parallel_rank for folder in cache.folders)
        held = f"{len(cache.folders)} folders (ranks {ranks}): " if cache.folders else ""
        lines.append(f"  compile cache {cache.root}: {held}{cache.note}")
    if report.suggested_buckets is not None:
        lines += _fewer_graphs(report.suggested_buckets, report)
    return lines


def _rules(graphs: list[dict[str, object]]) -> list[str]:
    """neuronx-cc's written rules on each graph (vllm_neuron/compiler/neuronx_cc_rules.py): a graph that broke
    one it refuses for failed the check before this; what is left are the warnings."""
    checked = graphs[0]["neuronx_cc_rules"]["checked"]
    warned = [(graph["call"], note) for graph in graphs for note in graph["neuronx_cc_rules"]["broken"]]
    lines = [f"  neuronx-cc's rules: {checked} checked on every graph, {len(warned)} warnings"]
    return lines + [f"    {call}: {note}" for call, note in warned[:3]]


def _compiled(graphs: list[dict[str, object]], layers: str) -> list[str]:
    """What XLA's CPU compiler (neuronx-cc's closest public stand-in) made of each graph, where it ran."""
    compiled = [graph for graph in graphs if "flops" in graph]
    if not compiled:
        return []
    not_in_place = [graph for graph in compiled if graph["cache_problems"]]
    in_place = len(compiled) - len(not_in_place)
    temp = max(graph["temp_bytes"] for graph in compiled)
    lines = [
        f"  XLA (CPU) compiled {len(compiled)} graphs: {in_place} keep every KV cache in place (aliased, no "
        f"copy), temporaries up to {temp / 2**20:.1f} MiB",
        *[f"    {graph['call']}: {graph['cache_problems'][0]}" for graph in not_in_place[:1]],
        f"  per call on one trn2 core, graphs of {layers}: estimate from XLA's flops and bytes, and what "
        "bounds it | minimum (its weights and attended KV read once, its writes) | XLA's bytes over those",
    ]
    for graph in compiled:
        minimum, ratio = graph["minimum_ms"], graph["bytes_over_minimum"]
        floor = f"{minimum:.3f} ms | {ratio:.1f}x" if minimum else "unknown"
        lines.append(
            f"    {graph['call']}: {graph['trn2_estimate_ms']:.3f} ms {graph['trn2_bound']} | {floor}"
        )
    return lines


def _fewer_graphs(suggested: NeuronConfig, report: Report) -> list[str]:
    graphs = suggested.buckets.num_graphs
    return [
        f"  fewer graphs: --additional-config '{json.dumps({'bucket_policy': 'auto'})}' (the automatic "
        "policy, default traffic and graph budget) chooses",
        f"    {suggested.buckets.describe()}; compile estimate {_compile(graphs, report)} per rank",
    ]


def _compile(graphs: int, report: Report) -> str:
    low, high = capacity.compile_seconds(graphs, report.lowering.layers)
    return f"{graphs} graphs, {_duration(low)} to {_duration(high)}"


def _duration(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _capacity(report: Report) -> list[str]:
    figures, settings, plan = report.figures, report.settings, report.plan
    share = (
        f"a KV cache of {settings.kv_cache_bytes / GIB:.1f} GiB"
        if settings.kv_cache_bytes
        else f"KV share {settings.kv_cache_fraction}"
    )
    lines = [
        f"  a rank is a logical core (LNC={trn2.LNC}, {trn2.RANKS_PER_CHIP} per chip): "
        f"{trn2.RANK_HBM_BYTES / GIB:.0f} GiB HBM at {trn2.RANK_HBM_BW / 1e12:.3f} TB/s; {share}, "
        f"graph reserve {settings.graph_reserve_bytes / GIB:.2f} GiB, --gpu-memory-utilization "
        f"{settings.gpu_memory_utilization}",
        f"  model: {_count(figures.parameters)} parameters, {_bytes(figures.weight_bytes)} of weights and "
        f"buffers, KV {_kib(figures.kv_bytes_per_token())} per token ({figures.layers} layers x "
        f"{figures.kv_heads} KV heads x {figures.head_dim} x {figures.kv_dtype_bytes} bytes x K and V)",
    ]
    adapters = figures.adapters
    if adapters is not None:
        whole, split = (
            _bytes(part / adapters.slots) for part in (adapters.whole_bytes, adapters.split_bytes)
        )
        lines.append(
            f"  LoRA adapter slots: {adapters.slots} of rank {adapters.rank}, "
            f"{_bytes(adapters.bytes_per_slot())} per slot (whole model; at TP t a rank holds {whole} + "
            f"{split} / t of it), counted in weights / rank"
        )
    lowering = report.lowering
    if lowering.layers_checked < lowering.layers:
        lines.append(
            f"    measured on the model vLLM built with {lowering.layers_checked} of {lowering.layers} "
            "layers, per-layer sizes extrapolated"
        )
    batch, context = plan.largest_batch, plan.decode_contexts[-1]
    lines += [
        f"  | TP | chips | weights / rank | KV / token / rank | KV tokens | requests of {plan.max_model_len} "
        f"| decode tok/s, batch {batch} x context {context} | $ / M output tokens |",
        "  |---|---|---|---|---|---|---|---|",
    ]
    for row in report.rows:
        rank, rate = row.capacity, row.full_length
        tokens = f"{rank.kv_tokens:,}" if rank.kv_tokens else "0 (does not fit)"
        lines.append(
            f"  | {rank.tp} | {rank.chips} | {rank.weight_bytes / GIB:.2f} GiB | "
            f"{_kib(rank.kv_bytes_per_token)} | {tokens} | {rank.requests(plan.max_model_len):,} | "
            f"{_rate(rate.tokens_per_s, rate.rows)} | {_dollars(row.dollars_per_million)} |"
        )
    if report.suggested_tp is None:
        lines.append("  no tensor-parallel size on one instance holds a request of max_model_len")
    else:
        lines.append(
            f"  suggested: --tensor-parallel-size {report.suggested_tp} (the most decode tokens/s per chip "
            "with requests of max_model_len)"
        )
    return lines


def _throughput(report: Report) -> list[str]:
    plan, price = report.plan, report.price
    share = price.share(report.suggested_tp)
    chips = capacity.chips(report.suggested_tp)
    lines = [
        f"  roofline (upper bounds: collectives and host work are not modelled; docs/performance.md), "
        f"decode batch bucket {plan.largest_batch}, requests filling each context bucket",
        f"  price: {price.instance} ${price.dollars_per_hour:.2f}/h ({price.basis}), {chips} of "
        f"{price.instance_chips} chips" + (f" = ${price.dollars_per_hour * share:.2f}/h" if share else ""),
        "  | context bucket | rows | step ms | decode tok/s | one request tok/s | $ / M output tokens |",
        "  |---|---|---|---|---|---|",
    ]
    for row in report.contexts:
        full = row.full_batch
        lines.append(
            f"  | {full.context_bucket} | {full.rows} | {full.step_seconds * 1e3:.2f} | "
            f"{_rate(full.tokens_per_s, full.rows)} | {_rate(row.single.tokens_per_s, row.single.rows)} | "
            f"{_dollars(row.dollars_per_million)} |"
        )
    return lines


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _count(value: float) -> str:
    """8.03 B, 134.5 M, 1.2 k."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.{2 if unit == 'B' else 1}f} {unit}"
    return f"{value:.0f}"


def _bytes(value: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} bytes"


def _kib(value: int) -> str:
    return f"{value / 1024:.0f} KiB" if value >= 1024 else f"{value} bytes"


def _rate(tokens_per_s: float, rows: int) -> str:
    return f"{tokens_per_s:,.0f}" if rows else "-"


def _dollars(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.3f}"  # NaN: no token made
