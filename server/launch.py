"""Start one API server: vLLM's `run_server`, with the startup responder on the socket from its bind until
vLLM's HTTP server starts (see server.lifecycle).

vLLM has no hook between binding the socket and starting the engine, so the three steps of its `run_server`
(vllm.entrypoints.launchers.api_server.entry) before `run_server_worker` are repeated here; everything after
is vLLM's own `run_server_worker`. tests/test_server_lifecycle.py fails when vLLM's `run_server` changes.
"""

import signal
from argparse import Namespace

from vllm.entrypoints.launchers.api_server.entry import run_server_worker
from vllm.entrypoints.launchers.launcher import setup_server
from vllm.logger import init_logger
from vllm.utils.system_utils import decorate_logs

from server.lifecycle import RESPONDER_ARG, StartupResponder, engine_died

logger = init_logger("vllm.vllm_neuron.launch")


async def run_server(args: Namespace) -> None:
    decorate_logs("APIServer", skip_if_decorated=True)

    # Until vLLM's server installs its handlers, SIGTERM interrupts the start-up (as in vLLM).
    def interrupt_start_up(*_) -> None:
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt_start_up)
    listen_address, sock = setup_server(args, reuse_port=False)
    # Stopped at the app's start (server.lifecycle.app_starting), or here when the start-up fails.
    with StartupResponder(sock) as responder:
        setattr(args, RESPONDER_ARG, responder)
        await run_server_worker(listen_address, sock, args)
    if engine_died(args):
        logger.error("The engine process died: the server exits with status 1, to be restarted")
        raise SystemExit(1)
