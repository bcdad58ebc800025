"""What /health says at the two ends of the server's life, where vLLM alone would mislead a probe.

Start: vLLM binds its socket before starting the engine but listens only once the engine is ready, so during
a warm-up of minutes a probe would see "connection refused", the same as a dead server. `StartupResponder`
listens on the same socket meanwhile: /health answers 503 {"status": "starting"}, every other path a 503
OpenAI-style error with Retry-After. `server.launch` starts it; it stops, and hands the socket to vLLM's HTTP
server, when that server starts its app (the ASGI lifespan, seen by `server.middleware.HealthWhileDraining`):
/health then answers 200.

Death: when the engine process dies, vLLM fails the requests in flight, /health answers 503 and its watchdog
stops the HTTP server within seconds; `server.launch` then exits with status 1 (`engine_died`), so that an
orchestrator restarts the server rather than count a clean exit.

End: on SIGTERM vLLM drains the requests in flight (--shutdown-timeout) and refuses new ones, but its
/health still answers 200, so a load balancer would keep sending traffic. vLLM has no hook for the drain's
start: its SIGTERM handler (`serve_http`) starts the drain by calling the engine client's `shutdown`, so
`app_starting` wraps that method to set `app.state.neuron_draining`, and `HealthWhileDraining` answers 503
{"status": "draining"} from then on. tests/unit/test_upstream.py pins both vLLM behaviours relied on here (the
wrapping is vllm_neuron/upstream/vllm_server.py's).
"""

import contextlib
import json
import socket
import threading
import time

from vllm.logger import init_logger

from server import admission
from vllm_neuron import metrics
from vllm_neuron.upstream import vllm_server

logger = init_logger("vllm.vllm_neuron.startup")

RETRY_AFTER_SECONDS = 10
# Attributes of vLLM's parsed arguments (which vLLM keeps as app.state.args): the startup responder, from
# `server.launch` to the app's start; the app's state, from the app's start back to `server.launch`.
RESPONDER_ARG = "neuron_startup_responder"
APP_STATE_ARG = "neuron_app_state"


def app_starting(app) -> None:
    """The app's lifespan begins, just before vLLM's HTTP server listens: stop the startup responder (the
    socket is vLLM's from now on), answer overload with 429 (server/admission.py), and mark the drain when
    vLLM's SIGTERM handling starts it."""
    state = app.state
    args = getattr(state, "args", None)
    responder = getattr(args, RESPONDER_ARG, None)
    if responder is not None:
        responder.stop()
    if args is not None:
        setattr(args, APP_STATE_ARG, state)
    state.neuron_draining = False
    state.neuron_engine_died = False
    engine_client = getattr(state, "engine_client", None)
    if engine_client is None:
        return
    admission.answer_overload_with_429(engine_client)

    def mark_the_drain() -> None:
        if not state.neuron_draining:
            # The first call: a signal's drain, or the app's cleanup after vLLM's watchdog stopped the server
            # because the engine died.
            state.neuron_engine_died = engine_client.errored
            logger.info("Draining: /health answers 503 until the server exits")
        state.neuron_draining = True

    vllm_server.call_before_shutdown(engine_client, mark_the_drain)


def draining(app) -> bool:
    return getattr(getattr(app, "state", None), "neuron_draining", False)


def engine_died(args) -> bool:
    """After the HTTP server stopped: whether it stopped because the engine died (vLLM's watchdog stops the
    server then, and /health has answered 503), not because a signal drained it."""
    state = getattr(args, APP_STATE_ARG, None)
    engine_client = getattr(state, "engine_client", None)
    if engine_client is None:
        return False
    return state.neuron_engine_died or (engine_client.errored and not state.neuron_draining)


class StartupResponder:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="vllm-neuron-startup", daemon=True)

    def __enter__(self) -> "StartupResponder":
        self.sock.listen(128)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop answering (idempotent); the socket stays bound and listening, for vLLM's server."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    connection, _ = self.sock.accept()
                except (TimeoutError, BlockingIOError):
                    continue
                with connection:
                    self._answer(connection)
        finally:
            self.sock.settimeout(None)  # back to blocking, as vLLM's server expects it

    def _answer(self, connection: socket.socket) -> None:
        connection.settimeout(2)
        try:
            head = connection.recv(8192).decode("latin-1")
        except OSError:
            return
        parts = head.split(" ", 2)
        path = parts[1].split("?")[0] if len(parts) > 1 else ""
        seconds = round(time.monotonic() - self.started)
        if path == "/health":
            # Graphs compiled so far and still to compile, once warm-up has started.
            payload = {"status": "starting", "seconds": seconds, **metrics.graph_progress()}
        else:
            payload = {
                "error": {
                    "message": f"the server is starting (loading the model and compiling its buckets, "
                    f"{seconds} s so far); retry in a moment",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
            }
        body = json.dumps(payload).encode()
        response = (
            "HTTP/1.1 503 Service Unavailable\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"Retry-After: {RETRY_AFTER_SECONDS}\r\n"
            "Connection: close\r\n\r\n"
        ).encode() + body
        with contextlib.suppress(OSError):
            connection.sendall(response)
