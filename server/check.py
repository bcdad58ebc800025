"""`vllm-neuron check [MODEL] [serve options]`: would `vllm-neuron serve` with these options serve MODEL on
trn2, and how well? Runs on any machine, in CPU mode:

1. resolves the configuration exactly as `serve` does (vLLM's parser and ours, the same defaults, the
   platform's checks), with the defaults of a Trainium server (VLLM_NEURON_TARGET=neuron): its refusals,
   its bucket plan;
2. starts the engine with fewer layers and random weights of the real shapes (server/check_engine.py), whose
   warm-up traces and lowers every graph of the plan through TorchNeuron's route to StableHLO;
3. measures the model vLLM built, and reports memory and capacity per TP, decode tokens/s on the roofline
   and $ per million output tokens on trn2 (server/check_report.py), as a table or as JSON.

The exit code is 0 only when the model would serve: 1 when it would not (the verdict says why), 2 for a bad
invocation.
"""

import argparse
import contextlib
import os
import sys
import tempfile
from dataclasses import replace

from server import check_engine
from server.check_report import (
    SERVES,
    CacheFolder,
    CacheReport,
    Lowering,
    Plan,
    Report,
    Verdict,
    assess,
    price,
    to_json,
)
from server.options import add_neuron_options
from server.serve_args import parse_serve_args, platform_message, resolve_engine_config, serve_parser
from vllm_neuron import envs, trn2
from vllm_neuron.buckets import ceil_div
from vllm_neuron.compiler import compile_cache, graph_memory
from vllm_neuron.config import NeuronConfig, NeuronConfigError, engine_limits
from vllm_neuron.graph_plan import copy_buckets, max_copy_blocks
from vllm_neuron.planning.capacity import ModelFigures
from vllm_neuron.refusals import NIXL_CONNECTORS, speculative_method

USAGE = "vllm-neuron check [MODEL] [any `vllm serve` option] [--json] [check options]"
DEFAULT_LAYERS = 2


def add_check_options(parser: argparse.ArgumentParser) -> None:
    add_neuron_options(parser)
    group = parser.add_argument_group(
        "Check",
        "Options of `vllm-neuron check`; every other option means what it means to `serve` (docs/check.md).",
    )
    group.add_argument("--json", dest="check_json", action="store_true", help="print the report as JSON")
    group.add_argument(
        "--check-layers",
        dest="check_layers",
        type=_at_least_two,
        default=DEFAULT_LAYERS,
        metavar="N",
        help="build the model with its first N layers (all if it has fewer); sizes per layer are "
        "extrapolated to the model's layer count. At least 2: with one, what the layers share (vLLM's "
        "rotary table) could not be told from what each holds",
    )
    group.add_argument(
        "--load-weights",
        dest="check_load_weights",
        action="store_true",
        help="load the checkpoint's weights, into every layer (without it: random weights of the real "
        "shapes, nothing read but the config)",
    )
    group.add_argument(
        "--price-per-hour",
        dest="check_price_per_hour",
        type=float,
        metavar="DOLLARS",
        help="$ per hour of a whole trn2.48xlarge (unset: its documented price, docs/benchmarks.md#prices)",
    )


def _at_least_two(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


def check(argv: list[str]) -> int:
    # The report goes to stdout; vLLM's logs go to stderr. CPU mode, planning for Neuron, one process: all
    # before vLLM is imported (building its parser resolves the platform).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.update(
        VLLM_NEURON_DEVICE="cpu", VLLM_NEURON_TARGET="neuron", VLLM_ENABLE_V1_MULTIPROCESSING="0"
    )
    parser, command = serve_parser(USAGE, add_check_options)
    parsed = parse_serve_args(parser, argv, ["Neuron", "Check"])
    # Whatever the serve options said: this machine lowers without running (and never has a Neuron device).
    os.environ.update(
        VLLM_NEURON_DEVICE="cpu", VLLM_NEURON_COMPILE_BACKEND="lower-only", VLLM_NEURON_READINESS="full"
    )
    command.validate(parsed)
    # What the engine's libraries print goes to stderr too (NIXL's logger writes to stdout).
    with contextlib.redirect_stdout(sys.stderr):
        report = run(parsed)
    if parsed.check_json:
        import json

        print(json.dumps(to_json(report), indent=2))
    else:
        from server.check_table import render

        print(render(report))
    return report.exit_code


def run(parsed: argparse.Namespace) -> Report:
    try:
        vllm_config = resolve_engine_config(parsed)
    except (ValueError, NotImplementedError) as err:
        return Report(model=parsed.model, dtype=str(parsed.dtype), verdict=Verdict("refused", _brief(err)))
    model_config = vllm_config.model_config
    report = Report(
        model=model_config.model,
        dtype=str(model_config.dtype).removeprefix("torch."),
        verdict=Verdict(SERVES),
        plan=plan_of(vllm_config),
        cache=_cache(vllm_config),
        price=price(parsed.check_price_per_hour),
    )
    layers = model_config.get_total_num_hidden_layers()
    # vLLM's loaders refuse a checkpoint's layers the model does not have: real weights need every layer.
    checked_layers = layers if parsed.check_load_weights else min(parsed.check_layers, layers)
    engine_args = check_engine.check_engine_args(
        _fresh_engine_args(parsed), vllm_config, checked_layers, parsed.check_load_weights
    )
    cache_root = os.environ.get("VLLM_NEURON_CACHE_ROOT")
    try:
        # The check's own graphs are nobody's compile cache.
        with tempfile.TemporaryDirectory(prefix="vllm-neuron-check-") as scratch:
            os.environ["VLLM_NEURON_CACHE_ROOT"] = scratch
            checked = check_engine.run(engine_args)
    except Exception as err:  # noqa: BLE001 - the verdict names whatever stopped the start-up
        report.verdict = check_engine.verdict_of(err)
        return report
    finally:
        _restore("VLLM_NEURON_CACHE_ROOT", cache_root)
    weights = "loaded" if parsed.check_load_weights else "random"
    report.lowering = Lowering(checked_layers, layers, weights, checked.graphs, checked.seconds)
    heads = model_config.model_arch_config.total_num_attention_heads
    report.figures = checked.model.figures(model_config.served_model_name, layers, heads)
    report.plan = replace(report.plan, copy_buckets=_copy_buckets(vllm_config, report.figures))
    report.reserve = _graph_reserve(vllm_config, checked.graphs)
    report.settings = trn2.KVSettings(
        kv_cache_fraction=envs.VLLM_NEURON_KV_CACHE_FRACTION,
        gpu_memory_utilization=vllm_config.cache_config.gpu_memory_utilization,
        graph_reserve_bytes=report.reserve.bytes,
        kv_cache_bytes=vllm_config.cache_config.kv_cache_memory_bytes,
    )
    report.suggested_buckets = _fewer_graphs(vllm_config, report.plan)
    assess(report, max_ranks=report.price.instance_chips * trn2.RANKS_PER_CHIP)
    return report


def _graph_reserve(vllm_config, graphs: list[dict[str, object]]) -> graph_memory.Reserve:
    """The reserve the lowered graphs need, recorded in the compile cache root for `serve`'s start-up on trn2
    (the check lowers one rank's graphs at TP=1: at a larger TP each rank's intermediates are smaller, so the
    figure errs high), with the NEFFs' size where a trn2 start measured them; VLLM_NEURON_GRAPH_RESERVE_BYTES,
    where set, is what the fit uses. The trn2 host's compile workers are not known here:
    VLLM_NEURON_COMPILE_WORKERS, else the most it starts by default."""
    workers = envs.VLLM_NEURON_COMPILE_WORKERS or graph_memory.DEFAULT_COMPILE_WORKERS
    fields = compile_cache.key_fields(vllm_config, NeuronConfig.of(vllm_config))
    derived = graph_memory.record(fields, graph_memory.derive_for(vllm_config, graphs, workers))
    explicit = envs.VLLM_NEURON_GRAPH_RESERVE_BYTES
    if explicit is not None:
        return graph_memory.Reserve(explicit, graph_memory.EXPLICIT, derived)
    return graph_memory.Reserve(derived.total, "derived", derived)


def _copy_buckets(vllm_config, figures: ModelFigures) -> tuple[int, ...]:
    """NIXL's block-copy buckets on a rank at the TP given (worker/kv/nixl_blocks.py): a block's pages of
    every layer are its KV bytes per token on the rank, block_size times; () without NIXL."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None or transfer.kv_connector not in NIXL_CONNECTORS:
        return ()
    block_size = vllm_config.cache_config.block_size
    tp = vllm_config.parallel_config.tensor_parallel_size
    blocks = ceil_div(vllm_config.model_config.max_model_len, block_size)
    return tuple(copy_buckets(max_copy_blocks(blocks, figures.kv_bytes_per_token(tp) * block_size)))


def _fresh_engine_args(parsed: argparse.Namespace):
    """Engine arguments of their own for the check's engine (resolving a configuration fills in and shares
    parts of the arguments it came from)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(parsed)


def plan_of(vllm_config) -> Plan:
    """The limits and the graphs `serve` would run with this configuration."""
    scheduler_config = vllm_config.scheduler_config
    return Plan(
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        neuron=NeuronConfig.of(vllm_config),
        draft_model=speculative_method(vllm_config) == "draft_model",
        head=speculative_method(vllm_config) == "eagle3",
    )


def _fewer_graphs(vllm_config, plan: Plan) -> NeuronConfig | None:
    """The automatic bucket policy's choice (default traffic, default graph budget) where it compiles fewer
    graphs than the plan."""
    try:
        auto = NeuronConfig.resolve({"bucket_policy": "auto"}, engine_limits(vllm_config))
    except NeuronConfigError:  # no choice within the budget: nothing to suggest
        return None
    return auto if auto.buckets.num_graphs < plan.neuron.buckets.num_graphs else None


def _cache(vllm_config) -> CacheReport:
    """What the compile cache `serve` would use holds for this configuration, as far as a CPU can tell."""
    root = compile_cache.cache_root()
    fields = compile_cache.key_fields(vllm_config, NeuronConfig.of(vllm_config))
    folders = [
        CacheFolder(
            path=str(path),
            tensor_parallel_rank=int(recorded.get("tensor_parallel_rank", 0)),
            artefacts=compile_cache.artefact_count(path),
            versions=dict(recorded.get("versions", {})),
        )
        for path, recorded in compile_cache.neuron_folders(root, fields)
    ]
    if not folders:
        note = "no folder compiled on Trainium for this configuration: warm-up compiles every graph"
    else:
        note = (
            "folders compiled on Trainium for this configuration: warm-up skips the compiles they hold where "
            "the host has the same software versions. Which of the plan's graphs they hold cannot be told on "
            "a CPU: TorchNeuron names each NEFF by a hash of the graph it compiled (the whole model's), and "
            "eager device operations add NEFFs of their own"
        )
    return CacheReport(root=str(root), folders=folders, note=note)


def _brief(err: Exception) -> str:
    """The platform's or vLLM's sentence, without the wrapper or a list of every supported architecture."""
    text = platform_message(err)
    return text.split(" Supported architectures:")[0].strip()


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
