"""Start one API server: vLLM's `run_server`, with the startup responder on the socket from its bind until
vLLM's HTTP server starts (see server.lifecycle).

vLLM has no hook between binding the socket and starting the engine, so the three steps of its `run_server`
(vllm.entrypoints.launchers.api_server.entry) before `run_server_worker` are repeated here; everything after
is vLLM's own `run_server_worker` (each step: vllm_neuron/upstream/vllm_server.py).
tests/unit/test_upstream.py fails when vLLM's `run_server` changes."""

import signal
import threading
from argparse import Namespace

import psutil
from vllm.logger import init_logger

from server.lifecycle import RESPONDER_ARG, StartupResponder, engine_died
from vllm_neuron.processes import end_processes
from vllm_neuron.upstream import vllm_server

logger = init_logger("vllm.vllm_neuron.launch")


async def run_server(args: Namespace) -> None:
    vllm_server.decorate_api_server_logs()
    terminated = threading.Event()

    # Until vLLM's server installs its handlers, SIGTERM stops the start-up. vLLM raises KeyboardInterrupt
    # from the handler, but during warm-up the main thread waits in pyzmq's poll, which swallows exceptions
    # raised by signal handlers: the server went on and served. Ending the engine processes ends that wait
    # (vLLM sees them exit and raises); the server then exits 0.
    def stop_start_up(*_) -> None:
        if not terminated.is_set():
            terminated.set()
            logger.info("SIGTERM during start-up: stopping the engine processes")
            _terminate_children()

    signal.signal(signal.SIGTERM, stop_start_up)
    listen_address, sock = vllm_server.bind_api_server_socket(args)
    # Stopped at the app's start (server.lifecycle.app_starting), or here when the start-up fails.
    try:
        with StartupResponder(sock) as responder:
            setattr(args, RESPONDER_ARG, responder)
            await vllm_server.run_api_server_worker(listen_address, sock, args)
    except Exception:
        if not terminated.is_set():
            raise
        logger.info("Start-up stopped by SIGTERM")
        return
    if engine_died(args):
        logger.error("The engine process died: the server exits with status 1, to be restarted")
        raise SystemExit(1)


def _terminate_children(grace_seconds: float = 10.0) -> None:
    """SIGTERM to every process this one started (engine core, workers, compile processes), then SIGKILL to
    those still there after the grace period."""
    end_processes(psutil.Process().children(recursive=True), grace_seconds)
