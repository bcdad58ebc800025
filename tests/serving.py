"""A real `vllm-neuron serve` process on 127.0.0.1 for server tests, and small HTTP helpers."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import ENGINE_KWARGS, MAX_MODEL_LEN

MODEL_NAME = "tiny"
# The shared test server (tests/conftest.py: api_server) requires this key and caps request bodies.
API_KEY = "test-key"
MAX_REQUEST_BYTES = 1_000_000
# Test servers' ports start here, clear of the low ports that system services hold.
PORTS_FROM = 20_000
_PORTS = random.SystemRandom()  # each xdist worker its own draws


def free_port() -> int:
    """A free port outside the kernel's ephemeral range. A port the kernel picks itself (a bind to port 0, a
    client's source port) can go to another process between this probe and the server's own bind: CI saw a
    NIXL side channel fail with "Address already in use" that way. Outside the range only another probe like
    this one could take it, and each worker draws at random."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = range(PORTS_FROM, low) if low - PORTS_FROM >= 1000 else range(high + 1, 65536)
    for _ in range(100):
        port = _PORTS.choice(ports)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports}")


def http(
    method: str, url: str, body: bytes | None = None, *, key: str | None = None, timeout: float = 60
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def serve_command(model_dir: Path, port: int, *extra: str) -> list[str]:
    """The test engine's settings (tests/conftest.py) as `vllm-neuron serve` arguments."""
    return [
        str(Path(sys.executable).with_name("vllm-neuron")),
        "serve",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(ENGINE_KWARGS["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(ENGINE_KWARGS["max_num_batched_tokens"]),
        "--additional-config",
        json.dumps(ENGINE_KWARGS["additional_config"]),
        *extra,
    ]


class ServerProcess:
    """Start the server; `wait_healthy` records every /health status seen until the first 200."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *extra: str,
        step_trace: Path | None = None,
        env: dict[str, str | None] | None = None,
    ) -> None:
        """`env`: variables to set for the server (None: unset)."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.step_trace = step_trace
        # The CLI must pick CPU mode by itself, unless `env` says otherwise; the engine core runs in its own
        # (spawned) process.
        environment = {**os.environ}
        environment.pop("VLLM_NEURON_DEVICE", None)
        environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        for name, value in (env or {}).items():
            if value is None:
                environment.pop(name, None)
            else:
                environment[name] = value
        if step_trace is not None:
            environment["VLLM_NEURON_STEP_TRACE"] = str(step_trace)
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                serve_command(model_dir, self.port, *extra),
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.health_seen: list[int | str] = []
        self.terminated = False

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError("server exited:\n" + self.log()[-5000:])
            try:
                status = http("GET", self.base + "/health", timeout=5)[0]
            except OSError as error:
                status = type(error).__name__
            self.health_seen.append(status)
            if status == 200:
                return
            time.sleep(0.5)
        raise AssertionError("server did not become healthy:\n" + self.log()[-5000:])

    def log(self) -> str:
        return self.log_path.read_text()

    def terminate(self) -> None:
        """SIGTERM, once: the server drains and exits (`stop` waits for it)."""
        if self.process.poll() is None and not self.terminated:
            self.process.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float = 60) -> int:
        self.terminate()
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise


def stop_all(*servers: ServerProcess) -> None:
    """Stop servers together: their drains and workers' exits overlap. Each is waited for, even if one is
    not."""
    for server in servers:
        server.terminate()
    failures = []
    for server in servers:
        try:
            server.stop()
        except subprocess.TimeoutExpired as error:
            failures.append(error)
    if failures:
        raise failures[0]


def completion(
    server: ServerProcess,
    prompt: list[int],
    max_tokens: int,
    *,
    model: str = MODEL_NAME,
    timeout: float = 60,
    **fields: object,
) -> tuple[int, bytes]:
    """POST /v1/completions of token ids, greedy (temperature 0) and past EOS, with `fields` added (those
    None left out, so a caller passes an optional field on as it got it); the status and the raw body."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body |= {name: value for name, value in fields.items() if value is not None}
    return http("POST", server.base + "/v1/completions", json.dumps(body).encode(), timeout=timeout)


def complete(
    server: ServerProcess,
    prompt: list[int],
    max_tokens: int,
    *,
    model: str = MODEL_NAME,
    timeout: float = 60,
    **fields: object,
) -> dict:
    """A `completion` that must succeed: its JSON body."""
    status, raw = completion(server, prompt, max_tokens, model=model, timeout=timeout, **fields)
    assert status == 200, raw[-2000:]  # the end of an error body, where its message is
    return json.loads(raw)
