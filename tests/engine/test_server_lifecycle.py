"""The server's life for operators: --help, bad configuration refused at start-up, "starting" distinguishable
from "broken" while it warms up, and a SIGTERM that drains the requests in flight and exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.conftest import FEW_BUCKETS, FEW_BUCKETS_GRAPHS
from tests.serving import MODEL_NAME, ServerProcess, free_port, http, serve_command
from vllm_neuron import settings

BAD_CONFIGURATIONS = {
    ("--context-buckets", "100,256"): "not multiples of the KV block size",
    ("--context-buckets", "128,lots"): "VLLM_NEURON_CONTEXT_BUCKETS",
    ("--decode-batch-buckets", "1,64"): "exceeds max_num_seqs=4",
    ("--additional-config", '{"prefill_bucket": [64]}'): "unknown --additional-config keys",
    ("--tensor-parallel-size", "3"): "must be divisible by tensor parallel size (3)",
    ("--compile-backend", "stablehl"): "'stablehl' is not a compile backend",
}
HELP = (("serve", "--help"), ("serve", "--help=all"))


class CliRun(NamedTuple):
    code: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def cli_runs(tiny_model_dir) -> dict[tuple[str, ...], CliRun]:
    """`vllm-neuron serve --help` and each bad configuration's `serve`, each by its arguments: runs that end
    before an engine starts, all in one process (tests/cli_runs.py), which imports vLLM once."""
    runs = {}
    for args in BAD_CONFIGURATIONS:
        command = serve_command(tiny_model_dir, free_port())[1:]
        if args[0] == "--additional-config":
            index = command.index("--additional-config")
            del command[index : index + 2]
        runs[args] = [*command, *args]
    runs |= {args: list(args) for args in HELP}
    env = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_DEVICE"}
    script = Path(__file__).parents[1] / "cli_runs.py"
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(list(runs.values()))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    results = json.loads(line.removeprefix("RESULT "))
    return {args: CliRun(**result) for args, result in zip(runs, results, strict=True)}


def test_serve_help_shows_vllm_groups_and_every_neuron_option(cli_runs):
    result = cli_runs[HELP[0]]
    assert result.code == 0, result.stderr
    assert "ModelConfig" in result.stdout and "--help=all" in result.stdout  # vLLM's overview
    for flag, setting in settings.BY_FLAG.items():
        assert flag in result.stdout and str(setting.env) in result.stdout
    every = cli_runs[HELP[1]]
    for option in ("--max-model-len", "--api-key", "--shutdown-timeout", "--prefill-buckets"):
        assert option in every.stdout


@pytest.mark.parametrize(("args", "message"), list(BAD_CONFIGURATIONS.items()))
def test_bad_configuration_fails_at_start_up_with_what_to_change(cli_runs, args, message):
    returncode, stdout, stderr = cli_runs[args]
    assert returncode == 2, stderr[-3000:]
    assert message in stderr
    assert "Traceback" not in stderr and "pydantic" not in stderr
    assert "Warm-up" not in stderr + stdout  # refused before the engine started


def wait_for_starting_answer(server: ServerProcess) -> bytes:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            status, body = http("GET", server.base + "/health", timeout=5)
        except OSError:  # the CLI has not bound the port yet
            time.sleep(0.2)
            continue
        if status == 503:
            return body
        raise AssertionError(f"/health answered {status} before warm-up ended")
    raise AssertionError("no answer on the port:\n" + server.log()[-3000:])


def wait_for_graph_progress(server: ServerProcess) -> dict:
    """The first start-up /health answer that counts graphs (warm-up has begun)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, body = http("GET", server.base + "/health", timeout=5)
        assert status == 503, "ready before any answer counted the graphs"
        answer = json.loads(body)
        if "graphs_pending" in answer:
            return answer
        time.sleep(0.1)
    raise AssertionError("no start-up answer counted the graphs:\n" + server.log()[-3000:])


def http_status(url: str) -> int | str:
    try:
        return http("GET", url, timeout=10)[0]
    except OSError as error:
        return type(error).__name__


def late_request_status(server: ServerProcess) -> int | str:
    body = json.dumps({"model": MODEL_NAME, "prompt": "late", "max_tokens": 2}).encode()
    try:
        return http("POST", server.base + "/v1/completions", body, timeout=10)[0]
    except OSError as error:
        return type(error).__name__


@pytest.mark.slow
def test_starting_then_ready_then_sigterm_drains_in_flight_requests(tiny_model_dir, tmp_path):
    from openai import OpenAI

    # One graph per phase (the last --additional-config wins): staged, the minimal ones first.
    few = ("--additional-config", json.dumps(FEW_BUCKETS))
    server = ServerProcess(
        tiny_model_dir, tmp_path / "server.log", "--shutdown-timeout", "60", "--readiness", "staged", *few
    )
    try:
        # While it warms up, a probe or a client reads 503 with a reason: not a hang, not a refusal.
        starting = wait_for_starting_answer(server)
        assert json.loads(starting)["status"] == "starting"
        status, body = http("POST", server.base + "/v1/completions", b"{}", timeout=5)
        assert status == 503 and "starting" in json.loads(body)["error"]["message"]
        # Once warm-up has begun, the answer counts the graphs compiled and still to compile.
        progress = wait_for_graph_progress(server)
        assert progress["graphs_ready"] + progress["graphs_pending"] == FEW_BUCKETS_GRAPHS, progress
        server.wait_healthy()
        assert server.health_seen[-1] == 200
        # Staged readiness: serving began on the minimal graphs; /v1/neuron/info says what is compiled.
        compile_info = json.loads(http("GET", server.base + "/v1/neuron/info")[1])["compile"]
        assert compile_info["readiness"] == "staged" and compile_info["graphs_total"] == FEW_BUCKETS_GRAPHS
        assert compile_info["graphs_ready"] + compile_info["graphs_pending"] == FEW_BUCKETS_GRAPHS
        assert compile_info["graphs_ready"] >= 2 and compile_info["seconds_to_ready"] > 0

        client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        first_token, tokens = threading.Event(), []

        def stream() -> None:
            for chunk in client.completions.create(
                model=MODEL_NAME,
                prompt="Once upon a time",
                max_tokens=120,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
                stream_options={"include_usage": True},
            ):
                if chunk.choices:
                    first_token.set()
                if chunk.usage is not None:
                    tokens.append(chunk.usage.completion_tokens)

        worker = threading.Thread(target=stream)
        worker.start()
        assert first_token.wait(60)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(1)
        # Draining: no new work is accepted (load balancers see /health fail), the stream goes on.
        assert late_request_status(server) != 200
        assert http_status(server.base + "/health") == 503
        worker.join(timeout=120)
        assert server.process.wait(timeout=120) == 0, server.log()[-3000:]
        assert tokens == [120]  # the stream in flight ran to its end
    finally:
        if server.process.poll() is None:
            server.stop()
    assert "shutdown" in server.log().lower()


@pytest.mark.slow
def test_sigterm_during_warm_up_stops_the_server_and_its_engine(tiny_model_dir, tmp_path):
    """vLLM's start-up handler raises KeyboardInterrupt, which pyzmq's poll swallows while the engine warms
    up: the server used to go on and serve. It ends the engine processes instead, and exits 0."""
    import psutil

    server = ServerProcess(
        tiny_model_dir,
        tmp_path / "server.log",
        "--readiness",
        "full",
        # A warm-up long enough to interrupt: nothing compiled before, not even the run's XLA executables.
        env={"VLLM_NEURON_CACHE_ROOT": str(tmp_path / "cold-cache"), "VLLM_NEURON_XLA_CACHE_DIR": None},
    )
    try:
        wait_for_starting_answer(server)
        progress = wait_for_graph_progress(server)
        assert progress["graphs_pending"] > 2, progress
        children = psutil.Process(server.process.pid).children(recursive=True)
        assert children
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=90) == 0, server.log()[-3000:]
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive
        assert "Start-up stopped by SIGTERM" in server.log()
    finally:
        if server.process.poll() is None:
            server.stop()


# The vLLM behaviours server/launch.py, server/lifecycle.py and server/admission.py rely on are pinned in
# tests/unit/test_upstream.py.


class FakeEngineClient:
    """What server.lifecycle uses of vLLM's engine client."""

    def __init__(self, errored: bool = False) -> None:
        self.shutdowns: list[float] = []
        self.errored = errored
        self.vllm_config = Namespace(
            scheduler_config=Namespace(max_num_queued_reqs=6, max_num_queued_tokens=None)
        )

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    def shutdown(self, timeout: float | None = None) -> None:
        self.shutdowns.append(timeout)
        self.errored = True  # as vLLM's client once shut down


@pytest.mark.parametrize("died", [False, True], ids=["drained", "engine-died"])
def test_the_server_tells_a_dead_engine_from_a_drain(died):
    """A signal drains a live engine (exit 0); vLLM's watchdog stops the server after the engine died, and
    the app's cleanup then shuts the client down (exit 1)."""
    from server import lifecycle

    app = Namespace(state=Namespace(args=Namespace(), engine_client=FakeEngineClient(errored=died)))
    lifecycle.app_starting(app)
    app.state.engine_client.shutdown(timeout=30)
    app.state.engine_client.shutdown(timeout=30)  # the app's cleanup, after a drain
    assert lifecycle.engine_died(app.state.args) is died


def test_app_start_stops_the_responder_and_drain_turns_health_to_503():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server.lifecycle import RESPONDER_ARG, StartupResponder
    from server.middleware import HealthWhileDraining

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        responder = StartupResponder(sock).__enter__()
        app = FastAPI()
        app.state.args = Namespace(**{RESPONDER_ARG: responder})
        app.state.engine_client = engine_client = FakeEngineClient()
        app.get("/health")(lambda: {})
        app.add_middleware(HealthWhileDraining)
        with TestClient(app) as client:  # runs the app's lifespan
            assert not responder._thread.is_alive()
            assert client.get("/health").status_code == 200
            engine_client.shutdown(timeout=30)  # what vLLM's SIGTERM handler calls
            assert engine_client.shutdowns == [30]
            draining = client.get("/health")
            assert (draining.status_code, draining.json()) == (503, {"status": "draining"})
            assert client.get("/other").status_code == 404  # only /health changes
