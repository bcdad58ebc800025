"""Overload and a dead engine, against a `vllm-neuron serve` of its own.

Past the admission bound a request gets 429 at once, with Retry-After, in OpenAI's error shape, and is counted
on /metrics; a client that leaves while its request waits frees its place at once. When the engine process
dies, the requests in flight end with an error, /health turns non-200 and the server exits non-zero.
The engine is paused with vLLM's /pause?mode=keep (VLLM_SERVER_DEV_MODE) so that requests stay queued
for as long as the test needs, whatever the machine's speed."""

import json
import os
import signal
import time

import httpx
import openai
import psutil
import pytest

from tests.conftest import FEW_BUCKETS
from tests.engine.test_server import metric_values
from tests.serving import MODEL_NAME, ServerProcess, http

pytestmark = pytest.mark.slow

MAX_IN_FLIGHT = 6
REJECTIONS = "vllm:admission_rejections_total"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("overload")
    process = ServerProcess(
        tiny_model_dir,
        folder / "server.log",
        "--max-num-queued-reqs",
        str(MAX_IN_FLIGHT),
        "--additional-config",  # after the test plan's: one bucket of each kind (admission is bucket-blind)
        json.dumps(FEW_BUCKETS),
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        process.wait_healthy()
        yield process
    finally:
        process.stop()


def admission(server) -> dict:
    status, body = http("GET", server.base + "/v1/neuron/info")
    assert status == 200, body
    return json.loads(body)["admission"]


def rejections(server) -> float:
    text = http("GET", server.base + "/metrics")[1].decode()
    return sum(metric_values(text, REJECTIONS).values())


def wait_until(condition, timeout: float, what: str) -> float:
    """Seconds until `condition()` held (polled every 20 ms)."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def open_stream(client: httpx.Client, index: int, max_tokens: int = 8) -> httpx.Response:
    """A streaming chat completion, its response headers read (the body streams later)."""
    request = client.build_request(
        "POST",
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"request {index}"}],
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        },
    )
    return client.send(request, stream=True)


def test_past_the_bound_requests_get_429_and_a_client_that_leaves_frees_its_place(server):
    assert admission(server)["max_requests_in_flight"] == MAX_IN_FLIGHT
    api = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    with httpx.Client(base_url=server.base, timeout=60) as client:
        assert http("POST", server.base + "/pause?mode=keep")[0] == 200
        streams = []
        try:
            streams = [open_stream(client, index) for index in range(MAX_IN_FLIGHT)]
            assert [stream.status_code for stream in streams] == [200] * MAX_IN_FLIGHT
            wait_until(lambda: admission(server)["requests_in_flight"] == MAX_IN_FLIGHT, 30, "all admitted")
            before = rejections(server)
            refused = [
                lambda: api.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": "one more"}], max_tokens=4
                ),
                lambda: list(
                    api.completions.create(model=MODEL_NAME, prompt="one more", max_tokens=4, stream=True)
                ),
                lambda: api.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": "n"}], max_tokens=4, n=2
                ),
            ]
            for call in refused:
                with pytest.raises(openai.RateLimitError) as caught:
                    call()
                error = caught.value
                assert error.status_code == 429 and error.response.headers["retry-after"] == "1"
                body = error.response.json()["error"]
                assert body["code"] == 429 and "--max-num-queued-reqs" in body["message"], body
            assert rejections(server) == before + len(refused)
            assert admission(server)["requests_in_flight"] == MAX_IN_FLIGHT  # nothing refused was queued

            # Two waiting clients leave: their places free at once, and new requests get them.
            for stream in streams[:2]:
                stream.close()
            seconds = wait_until(
                lambda: admission(server)["requests_in_flight"] == MAX_IN_FLIGHT - 2, 5, "places freed"
            )
            assert seconds < 2
            streams = streams[2:] + [open_stream(client, index) for index in (10, 11)]
            assert [stream.status_code for stream in streams[-2:]] == [200, 200]
        finally:
            assert http("POST", server.base + "/resume")[0] == 200
        # Every admitted request completes once the engine runs again.
        for stream in streams:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert not any('"error"' in event for event in events), events
            stream.close()
    wait_until(lambda: admission(server)["requests_in_flight"] == 0, 30, "all finished")


def test_a_dead_engine_fails_requests_in_flight_turns_health_red_and_exits_non_zero(server):
    """Runs last in this module: it ends the server."""
    engine = [
        child
        for child in psutil.Process(server.process.pid).children(recursive=True)
        if "EngineCore" in " ".join(child.cmdline()) or child.name().startswith("VLLM::EngineCor")
    ]
    assert engine, [child.cmdline() for child in psutil.Process(server.process.pid).children(recursive=True)]
    with httpx.Client(base_url=server.base, timeout=60) as client:
        streams = [open_stream(client, index, max_tokens=200) for index in range(2)]
        lines = [stream.iter_lines() for stream in streams]
        assert all(next(line for line in each if line).startswith("data: ") for each in lines)  # generating
        for process in engine:
            os.kill(process.pid, signal.SIGKILL)
        for each in lines:
            try:
                rest = [line for line in each if line]
            except httpx.HTTPError:  # the connection broke: an error too
                continue
            assert not rest or rest[-1] != "data: [DONE]" or any('"error"' in line for line in rest), rest[
                -3:
            ]
    wait_until(lambda: health(server) != 200, 15, "/health non-200")
    code = server.process.wait(timeout=60)
    assert code != 0
    assert "The engine process died" in server.log()


def health(server) -> int | str:
    try:
        return http("GET", server.base + "/health", timeout=5)[0]
    except OSError as error:
        return type(error).__name__
