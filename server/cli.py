"""`vllm-neuron`: vLLM's OpenAI server with the Neuron plugin active, and an environment check.

vllm-neuron serve [MODEL] [any `vllm serve` option]
vllm-neuron check [MODEL] [any `vllm serve` option] [--json] [check options]
vllm-neuron info
vllm-neuron loadtest [options]
"""

import atexit
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING

from server.info_endpoint import ENDPOINT_PLUGIN_NAME
from server.serve_args import (
    parse_serve_args,
    platform_message,
    resolve_engine_config,
    serve_parser,
)
from vllm_neuron import device, envs, host_cpu, settings

if TYPE_CHECKING:
    pass

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
    elif command == "info":
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
        # CPU mode serves --dtype auto in a dtype this CPU computes natively (vllm_neuron/host_cpu.py)
        "host_cpu": host_cpu.describe(),
        "settings": {name: os.environ[name] for name in envs.names() if name in os.environ},
    }


def serve(argv: list[str]) -> None:
    # The device mode decides which platform vLLM resolves, and building vLLM's parser resolves it: both
    # must come first.
    device_flag = _flag_value(argv, str(settings.BY_ENV["VLLM_NEURON_DEVICE"].flag))
    if device_flag is not None:
        os.environ["VLLM_NEURON_DEVICE"] = device_flag
    _choose_device_mode()
    parser, command = serve_parser()
    parsed = parse_serve_args(parser, argv, ["Neuron"])
    parsed.middleware = [
        *parsed.middleware,
        "server.middleware.ApiKeyOnEveryRoute",
        "server.middleware.HealthWhileDraining",
        "server.middleware.RetryAfterOn429",
        "server.middleware.RequestChecks",
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


def _flag_value(args: list[str], flag: str) -> str | None:
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _check_engine_config(parser, parsed) -> None:
    """Resolve the engine configuration once here, where a bad setting costs seconds: the platform refuses
    what it cannot serve (buckets, dtype, unsupported features) with a message that says what to change."""
    try:
        resolve_engine_config(parsed)
    except (ValueError, NotImplementedError) as err:
        parser.error(platform_message(err))


def _single_api_server(parsed) -> bool:
    return (
        not parsed.headless
        and not getattr(parsed, "grpc", False)
        and (parsed.api_server_count or 1) == 1
        and parsed.data_parallel_size == 1
    )


if __name__ == "__main__":
    main()
