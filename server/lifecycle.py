"""What /health says at the two ends of the server's life, where vLLM alone would mislead a probe.

Start: vLLM binds its socket before starting the engine but listens only once the engine is ready, so during
a warm-up of minutes a probe would see "connection refused", the same as a dead server. `StartupResponder`
listens on the same socket meanwhile: /health answers 503 {"status": "starting"}, every other path a 503
OpenAI-style error with Retry-After. It stops, and hands the socket to vLLM's HTTP server, once the engine
is ready; /health then answers 200.

End: on SIGTERM vLLM drains the requests in flight (--shutdown-timeout) and refuses new ones, but its
/health still answers 200, so a load balancer would keep sending traffic. `watch_drain` marks the drain's
start, and `server.middleware.HealthWhileDraining` answers 503 {"status": "draining"} from then on.
"""

import contextlib
import json
import socket
import threading
import time

from vllm.logger import init_logger

logger = init_logger("vllm.vllm_neuron.startup")

RETRY_AFTER_SECONDS = 10


class _State:
    draining = False


STATE = _State()


def watch_drain(engine_client) -> None:
    """vLLM's SIGTERM handling starts the drain by calling the engine client's shutdown: mark it there."""
    shutdown = engine_client.shutdown

    def shutdown_marking_the_drain(*args, **kwargs):
        STATE.draining = True
        logger.info("Draining: /health answers 503 until the server exits")
        return shutdown(*args, **kwargs)

    engine_client.shutdown = shutdown_marking_the_drain


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
        self._stop.set()
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
            payload = {"status": "starting", "seconds": seconds}
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
