"""Start one API server: vLLM's own start-up sequence, with the startup responder on the port until the
engine (and its warm-up) is ready, and the drain on SIGTERM visible on /health."""

import contextlib
import signal
from argparse import Namespace

from vllm.entrypoints.launchers.api_server.entry import build_and_serve, build_async_engine_client
from vllm.entrypoints.launchers.launcher import setup_server
from vllm.utils.system_utils import decorate_logs

from server.lifecycle import StartupResponder, watch_drain


async def run_server(args: Namespace) -> None:
    """vLLM's run_server and run_server_worker for a single API server, in the same order."""
    decorate_logs("APIServer", skip_if_decorated=True)

    # Until uvicorn installs its handlers, SIGTERM interrupts the start-up (as in vLLM).
    def interrupt_start_up(*_) -> None:
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt_start_up)
    listen_address, sock = setup_server(args, reuse_port=False)
    async with contextlib.AsyncExitStack() as stack:
        with StartupResponder(sock):
            engine_client = await stack.enter_async_context(build_async_engine_client(args))
        watch_drain(engine_client)
        shutdown_task = await build_and_serve(engine_client, listen_address, sock, args)
    try:
        await shutdown_task
    finally:
        sock.close()
