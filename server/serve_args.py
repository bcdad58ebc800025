"""`serve`'s command line as vLLM reads it, shared by `vllm-neuron serve` and `vllm-neuron check`: vLLM's
parser with the plugin's options, the plugin's defaults, the embedded default model, and the engine
configuration those arguments resolve to (with the platform's refusal as one sentence)."""

import contextlib
from typing import TYPE_CHECKING

from server import default_model
from server.options import add_neuron_options, apply_neuron_options
from vllm_neuron.upstream import vllm_server

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Applied when the user does not give them: a small number of compiled graphs (one per bucket), and on
# SIGTERM a drain of the requests in flight (Kubernetes' terminationGracePeriodSeconds must exceed it).
SERVE_DEFAULTS = {"--max-num-seqs": "32", "--shutdown-timeout": "30"}
DEFAULT_MODEL_MAX_LEN = 2048


def has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _with_default(args: list[str], flag: str, value: str) -> list[str]:
    return args if has_flag(args, flag) else [*args, flag, value]


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
    if parsed.model_tag is None and not has_flag(argv, "--model"):
        try:
            _use_default_model(parsed, argv)
        except default_model.MissingRequirementError as err:
            parser.error(str(err))
    if parsed.model_tag is not None:
        parsed.model = parsed.model_tag
    return parsed


def serve_parser(usage: str = "vllm-neuron serve [MODEL] [options]", add_options=add_neuron_options):
    # vLLM's parser and `serve` command; only vLLM's top-level `vllm` script is bypassed.
    parser, serve_parser, command = vllm_server.serve_command_parser(
        prog="vllm-neuron", description="vLLM on AWS Trainium through TorchNeuron"
    )
    serve_parser.usage = usage
    add_options(serve_parser)
    return parser, command


def _use_default_model(parsed, argv: list[str]) -> None:
    """No MODEL and no --model: the embedded default model, prepared once in the cache."""
    parsed.model_tag = str(default_model.ensure_default_model())
    if not has_flag(argv, "--served-model-name"):
        parsed.served_model_name = [default_model.DEFAULT_MODEL_NAME]
    if not has_flag(argv, "--max-model-len"):
        parsed.max_model_len = DEFAULT_MODEL_MAX_LEN


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
