"""`vllm-neuron serve` end to end on 127.0.0.1 with the official openai client: streaming chat, completions,
and bad requests that get a 4xx OpenAI-style error while the server keeps serving."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ENGINE_KWARGS, EXPECTED_GRAPHS, MAX_MODEL_LEN, hf_greedy

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ)
    # The CLI must pick CPU mode by itself here; the engine core runs in its own (spawned) process.
    env.pop("VLLM_NEURON_DEVICE", None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    buckets = ENGINE_KWARGS["additional_config"]
    command = [
        str(Path(sys.executable).with_name("vllm-neuron")),
        "serve",
        str(tiny_model_dir),
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
        json.dumps(buckets),
    ]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text()[-5000:]
            try:
                if http("GET", base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        else:
            pytest.fail("server did not become healthy:\n" + log_path.read_text()[-5000:])
        yield base, log_path
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_cpu_mode_was_chosen_and_logged(server):
    _, log_path = server
    assert "serving in CPU mode" in log_path.read_text()


def test_models_health_and_metrics(server, client):
    base, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert http("GET", base + "/health")[0] == 200
    status, body = http("GET", base + "/metrics")
    assert status == 200 and b"vllm:num_requests_running" in body


def test_streamed_chat_completion(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hello, who are you?"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert text and finish in (["length"], ["stop"])
    assert usage is not None and 0 < usage.completion_tokens <= 12


def test_completion_tokens_match_hf(client, hf_model):
    prompt = [11, 22, 33, 44, 55, 66, 77]
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = completion.choices[0]
    assert choice.token_ids == hf_greedy(hf_model, prompt, 10)
    assert completion.usage.completion_tokens == 10


BAD_REQUESTS = {
    "prompt longer than max_model_len": (
        "/v1/completions",
        {"prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 4},
    ),
    "max_tokens too large": ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}),
    "unknown model": ("/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
    "negative temperature": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    ),
    "prompt_logprobs": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 1}),
}


def test_bad_requests_get_4xx_while_a_stream_keeps_going(server, client):
    base, _ = server
    streamed: list[str] = []

    def long_stream() -> None:
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt="Once upon a time",
            max_tokens=60,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed.extend(c.choices[0].text for c in stream if c.choices)

    worker = threading.Thread(target=long_stream)
    worker.start()
    failures = []
    for name, (path, payload) in BAD_REQUESTS.items():
        status, body = http("POST", base + path, json.dumps({"model": MODEL_NAME, **payload}).encode())
        error = json.loads(body).get("error", {})
        if not (400 <= status < 500 and error.get("message")):
            failures.append((name, status, body[:300]))
    status, body = http("POST", base + "/v1/completions", b'{"model": "tiny", "prompt": ')
    if not (status == 400 and json.loads(body)["error"]["message"]):
        failures.append(("malformed JSON", status, body[:300]))
    worker.join(timeout=120)
    assert not failures
    assert not worker.is_alive() and len(streamed) >= 50  # one chunk per token (a few may merge)
    after = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, temperature=0)
    assert after.usage.completion_tokens >= 1


def metric_values(text: str, name: str) -> dict[str, float]:
    """{label set: value} of one series in Prometheus text format."""
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            values[labels[len(name) :]] = float(value)
    return values


def test_plugin_series_on_metrics_after_traffic(server, client):
    client.completions.create(model=MODEL_NAME, prompt=[7] * 100, max_tokens=5, temperature=0)
    status, body = http("GET", server[0] + "/metrics")
    text = body.decode()
    assert status == 200 and "vllm:generation_tokens_total" in text  # vLLM's own series are still there
    assert list(metric_values(text, "vllm_neuron:compiled_graphs").values()) == [EXPECTED_GRAPHS]
    assert list(metric_values(text, "vllm_neuron:unexpected_recompiles_total").values()) == [0.0]
    real = metric_values(text, "vllm_neuron:padding_real_tokens_total")
    slots = metric_values(text, "vllm_neuron:padding_slots_total")
    for phase in ("prefill", "decode"):
        label = f'{{phase="{phase}"}}'
        assert 0 < real[label] <= slots[label]
    buckets = metric_values(text, "vllm_neuron:bucket_calls_total")
    assert any('phase="prefill"' in k and 'bucket="64x128"' in k for k in buckets)
    assert set(metric_values(text, "vllm_neuron:warmup_seconds")) == {'{phase="decode"}', '{phase="prefill"}'}


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server, client):
    def generated() -> float:
        return sum(
            metric_values(
                http("GET", server[0] + "/metrics")[1].decode(), "vllm:generation_tokens_total"
            ).values()
        )

    before = generated()
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=240,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for received, _ in enumerate(stream):
        if received == 2:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = http("GET", server[0] + "/metrics")[1].decode()
        running = sum(metric_values(text, "vllm:num_requests_running").values())
        usage = sum(metric_values(text, "vllm:kv_cache_usage_perc").values())
        if running == 0 and usage == 0:
            break
        time.sleep(0.5)
    assert running == 0 and usage == 0, (running, usage)
    assert generated() - before < 240  # aborted, not run to max_tokens
