"""`vllm-neuron serve` end to end on 127.0.0.1 with the official openai client: the OpenAI API features users
rely on, bad requests that get a 4xx OpenAI-style error while the server keeps serving, the API key, the
request size limit, /v1/neuron/info and the plugin's /metrics series."""

import contextlib
import itertools
import json
import socket
import threading
import time

import pytest

from tests.conftest import ENGINE_KWARGS, EVERY_FORM, EVERY_FORM_GRAPHS, MAX_MODEL_LEN
from tests.helpers import hf_greedy
from tests.serving import API_KEY, MAX_REQUEST_BYTES, MODEL_NAME, http
from vllm_neuron import host_cpu

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server, path: str, payload: dict | bytes, key: str | None = API_KEY) -> tuple[int, dict]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    status, raw = http("POST", server.base + path, body, key=key)
    return status, json.loads(raw) if raw else {}


def test_cpu_mode_was_chosen_and_the_configuration_logged(server):
    log = server.log()
    assert "serving in CPU mode" in log
    assert f"Ready: cpu mode, {EVERY_FORM_GRAPHS} graphs, KV cache" in log


# ---- the OpenAI API ---------------------------------------------------------------------------------


def test_streamed_chat_completion_with_usage(client):
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
    assert usage is not None and 0 < usage.completion_tokens <= 12 and usage.prompt_tokens > 0


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


def test_completion_logprobs(client):
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="The sky is",
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0 and len(top) >= 3
        # Greedy: the chosen token is the most likely one.
        assert logprob == pytest.approx(max(top.values()), abs=1e-4) and token in top


def test_stop_string_ends_the_completion_before_it(client):
    free = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0]
    # A stop string taken from the middle of the free-running text cuts it there.
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert stop.strip(), free.text
    stopped = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and free.text.startswith(stopped.text)


def test_seed_reproduces_sampled_output(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL_NAME,
                prompt="Tell me a story",
                max_tokens=16,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    first, again, other = sample(1234), sample(1234), sample(4321)
    assert first == again
    assert first != other


def test_n_greater_than_one(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=8,
        temperature=1.0,
        n=3,
        seed=7,
    )
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert all(choice.message.content is not None for choice in completion.choices)
    assert 3 <= completion.usage.completion_tokens <= 3 * 8  # counted over all three choices
    assert len({choice.message.content for choice in completion.choices}) > 1


# ---- bad input -----------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = {
    "prompt longer than max_model_len": (COMPLETIONS, {"prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 4}),
    "max_tokens too large": (COMPLETIONS, {"prompt": "hi", "max_tokens": 100_000}),
    "max_tokens of the wrong type": (COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}),
    "messages of the wrong type": (CHAT, {"messages": "hi"}),
    "empty messages": (CHAT, {"messages": []}),
    "missing prompt": (COMPLETIONS, {"max_tokens": 4}),
    "unknown model": (COMPLETIONS, {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
    "negative temperature": (CHAT, {"messages": HI, "temperature": -1}),
    "absurd top_p": (CHAT, {"messages": HI, "top_p": 5}),
    "negative top_k": (CHAT, {"messages": HI, "top_k": -7}),
    "absurd frequency_penalty": (CHAT, {"messages": HI, "frequency_penalty": 1e9}),
    "n too large": (CHAT, {"messages": HI, "n": 100_000}),
    "negative max_tokens": (CHAT, {"messages": HI, "max_tokens": -1}),
    "too many logprobs": (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "logprobs": 10_000}),
    "prompt_logprobs (unsupported)": (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 1}),
    "token id outside the vocabulary": (COMPLETIONS, {"prompt": [10**9], "max_tokens": 2}),
    # Chat messages vLLM's catch-all message type lets through and the OpenAI API refuses.
    "unknown chat role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}),
    "user message without content": (CHAT, {"messages": [{"role": "user"}]}),
    "assistant message without content or tool calls": (CHAT, {"messages": [*HI, {"role": "assistant"}]}),
    "tool result answering no call": (
        CHAT,
        {"messages": [*HI, {"role": "tool", "content": "4", "tool_call_id": "x"}]},
    ),
}


def test_bad_requests_get_4xx_while_a_stream_keeps_going(server, client):
    streamed: list[str] = []
    usage = []

    def long_stream() -> None:
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt="Once upon a time",
            max_tokens=60,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            streamed.extend(choice.text for choice in chunk.choices)
            usage.extend([chunk.usage] if chunk.usage else [])

    worker = threading.Thread(target=long_stream)
    worker.start()
    failures = []
    for name, (path, payload) in BAD_REQUESTS.items():
        status, body = post(server, path, {"model": MODEL_NAME, **payload})
        if not (400 <= status < 500 and body.get("error", {}).get("message")):
            failures.append((name, status, str(body)[:300]))
    status, body = post(server, COMPLETIONS, b'{"model": "tiny", "prompt": ')
    if not (status == 400 and body["error"]["message"]):
        failures.append(("malformed JSON", status, body))
    worker.join(timeout=120)
    assert not failures
    # Every token arrived, in chunks (a busy host merges some).
    assert not worker.is_alive() and len(streamed) > 1 and [u.completion_tokens for u in usage] == [60]
    after = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, temperature=0)
    assert after.usage.completion_tokens >= 1


def send_raw(server, head: str, body_chunks: list[bytes]) -> tuple[int, dict]:
    """Send a request by hand (the server answers 413 before the body is all sent, which urllib and
    http.client report as a broken pipe) and read the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode())
        with contextlib.suppress(OSError):
            for chunk in body_chunks:
                sock.sendall(chunk)
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
            if b"\r\n\r\n" in response and response.rstrip().endswith(b"}"):
                break
    status_line, _, rest = response.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_request_body_above_the_limit_gets_413(server):
    auth = f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
    size = 2 * MAX_REQUEST_BYTES
    declared = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {size}\r\n\r\n"
    status, body = send_raw(server, declared, [b"x" * size])
    assert status == 413 and "larger than" in body["error"]["message"]
    # Without a Content-Length (chunked transfer), the limit applies as the body streams in.
    chunked = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n"
    piece = b"x" * 100_000
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * 30 + [b"0\r\n\r\n"]
    status, body = send_raw(server, chunked, chunks)
    assert status == 413 and "larger than" in body["error"]["message"]
    # Under the limit, chunked bodies reach the API as usual.
    small = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}).encode()
    status, body = send_raw(server, chunked, [b"%x\r\n%s\r\n0\r\n\r\n" % (len(small), small)])
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_api_key_guards_every_route_but_health_and_metrics(server):
    for key in (None, "wrong-key"):
        assert http("GET", server.base + "/v1/models", key=key)[0] == 401
        assert http("GET", server.base + "/v1/neuron/info", key=key)[0] == 401
        assert post(server, COMPLETIONS, {"model": MODEL_NAME, "prompt": "hi"}, key=key)[0] == 401
        # Routes outside /v1, which vLLM's own key check leaves open.
        for path in ("/version", "/openapi.json", "/docs"):
            assert http("GET", server.base + path, key=key)[0] == 401, path
        for path in ("/tokenize", "/invocations"):
            assert post(server, path, {"model": MODEL_NAME, "prompt": "hi"}, key=key)[0] == 401, path
    assert http("GET", server.base + "/v1/models", key=API_KEY)[0] == 200
    assert post(server, "/tokenize", {"model": MODEL_NAME, "prompt": "hi"})[0] == 200
    assert http("GET", server.base + "/health")[0] == 200
    assert http("GET", server.base + "/metrics")[0] == 200


def test_neuron_info_endpoint(server):
    status, body = http("GET", server.base + "/v1/neuron/info", key=API_KEY)
    info = json.loads(body)
    buckets = ENGINE_KWARGS["additional_config"] | EVERY_FORM  # the server's plan (tests/conftest.py)
    assert status == 200
    assert info["device_mode"] == "cpu" and info["compile_backend"] == "xla"
    assert info["buckets"] == {
        "prefill_tokens": buckets["prefill_buckets"],
        "decode_batch": buckets["decode_batch_buckets"],
        "context_tokens": buckets["context_buckets"],
        "decode_context_tokens": buckets["context_buckets"],  # none of their own: the same pages
        "fresh_prefill_tokens": buckets["fresh_prefill_buckets"],
    }
    assert info["graphs"] == EVERY_FORM_GRAPHS and info["max_model_len"] == MAX_MODEL_LEN
    assert info["kv_cache"]["block_size"] == 32 and info["kv_cache"]["num_blocks"] > 0
    assert {"torch", "vllm-torchneuron"} <= set(info["versions"])
    lowered = info["lowered_graphs"]
    assert len(lowered) == EVERY_FORM_GRAPHS
    for graph in lowered:
        assert graph["lowering_seconds"] > 0 and graph["stablehlo_ops"] > 100, graph
        # Updated in place: each layer's KV cache and the token slots (worker/step/step_state.py).
        assert graph["largest_tensor"]["bytes"] > 0 and len(graph["aliased_inputs"]) == 2 + 1, graph
        # XLA's figures for the graph it compiled and ran, the caches in place.
        assert graph["caches_in_place"] and graph["flops"] > 0 and graph["alias_bytes"] > 0, graph
    assert lowered[0]["call"].startswith("prefill of")
    # This server compiled every graph before serving (the suite's engines run VLLM_NEURON_READINESS=full).
    assert info["compile"]["readiness"] == "full"
    assert (info["compile"]["graphs_ready"], info["compile"]["graphs_pending"]) == (EVERY_FORM_GRAPHS, 0)
    sampling = info["sampling"]
    assert sampling["sampler"] == "device" and sampling["top_k_cap"] == 256 and sampling["logprobs_cap"] == 20
    assert "top_p" in sampling["on_device"] and "logit_bias" in sampling["on_host"]
    # Async scheduling on, the calls in the engine's thread (CPU mode's default).
    assert info["async_scheduling"] is True and info["device_thread"] is False
    assert info["lora"] is None  # --enable-lora: tests/engine/test_lora_server.py
    assert info["kv_events"] is None  # --kv-events-config: tests/engine/test_kv_events.py
    assert info["host_cpu"] == host_cpu.describe()  # CPU mode: the ISA that decides --dtype auto


# ---- /metrics -------------------------------------------------------------------------------------------


def metric_values(text: str, name: str) -> dict[str, float]:
    """{label set: value} of one series in Prometheus text format."""
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            values[labels[len(name) :]] = float(value)
    return values


PLUGIN_SERIES = {  # name on /metrics -> how it is exported
    "vllm_neuron:compiled_graphs": "gauge",
    "vllm_neuron:unexpected_recompiles": "counter",
    "vllm_neuron:graphs_ready": "gauge",
    "vllm_neuron:graphs_pending": "gauge",
    "vllm_neuron:warmup_seconds": "gauge",
    "vllm_neuron:compile_seconds": "counter",
    "vllm_neuron:padding_real_tokens": "counter",
    "vllm_neuron:padding_slots": "counter",
    "vllm_neuron:bucket_calls": "counter",
    "vllm_neuron:step_seconds": "histogram",
    "vllm_neuron:step_device_to_host_bytes": "histogram",
    "vllm_neuron:sampled_steps": "counter",
    "vllm_neuron:kv_blocks_total": "gauge",
    "vllm_neuron:kv_blocks_used": "gauge",
    "vllm_neuron:device_memory_used_bytes": "gauge",
    "vllm_neuron:process_resident_memory_bytes": "gauge",
    "vllm_neuron:process_open_fds": "gauge",
    "vllm_neuron:process_threads": "gauge",
}


def test_plugin_series_on_metrics_after_traffic(server, client):
    client.completions.create(model=MODEL_NAME, prompt=[7] * 100, max_tokens=5, temperature=0)
    status, body = http("GET", server.base + "/metrics")
    text = body.decode()
    assert status == 200 and "vllm:generation_tokens_total" in text  # vLLM's own series are still there
    for name, kind in PLUGIN_SERIES.items():
        exposed = name + "_total" if kind == "counter" else name
        assert f"# HELP {exposed} " in text and f"# TYPE {exposed} {kind}" in text, name

    def one(name: str) -> float:
        (value,) = metric_values(text, name).values()
        return value

    assert one("vllm_neuron:compiled_graphs") == EVERY_FORM_GRAPHS
    assert (one("vllm_neuron:graphs_ready"), one("vllm_neuron:graphs_pending")) == (EVERY_FORM_GRAPHS, 0)
    assert one("vllm_neuron:unexpected_recompiles_total") == 0
    compile_seconds = metric_values(text, "vllm_neuron:compile_seconds_total")
    phases = {'{phase="decode"}', '{phase="prefill"}', '{phase="mixed"}'}
    assert set(compile_seconds) == phases
    assert all(value > 0 for value in compile_seconds.values())
    real = metric_values(text, "vllm_neuron:padding_real_tokens_total")
    slots = metric_values(text, "vllm_neuron:padding_slots_total")
    for phase in ("prefill", "decode"):
        label = f'{{phase="{phase}"}}'
        assert 0 < real[label] <= slots[label]
    calls = metric_values(text, "vllm_neuron:bucket_calls_total")
    # A 64-token chunk ran alone at context 256 or beside decode rows (mixed: batch x context + chunk).
    assert any(
        ('phase="prefill"' in k and 'bucket="64x256"' in k) or ('phase="mixed"' in k and '+64"' in k)
        for k in calls
    )
    assert set(metric_values(text, "vllm_neuron:warmup_seconds")) == phases
    steps = metric_values(text, "vllm_neuron:step_seconds_count")
    seconds = metric_values(text, "vllm_neuron:step_seconds_sum")
    parts = ("schedule", "prepare", "forward", "sample", "host")
    assert set(steps) == {f'{{part="{part}"}}' for part in parts}
    assert all(count > 0 for count in steps.values())
    # Sane: each part of a tiny model's step is a fraction of a second (a clock mix-up once gave hours).
    assert all(0 < seconds[part] / steps[part] < 1.0 for part in steps)
    # The host's share (the device idle between two steps' calls) is counted for steps that follow another.
    host, schedule, prepare = '{part="host"}', '{part="schedule"}', '{part="prepare"}'
    assert steps[host] <= steps[schedule] < steps[prepare]
    # Greedy steps sampled in the graph: an int32 token per row left the device.
    assert metric_values(text, "vllm_neuron:sampled_steps_total")['{sampler="device"}'] > 0
    moved = one("vllm_neuron:step_device_to_host_bytes_sum") / one(
        "vllm_neuron:step_device_to_host_bytes_count"
    )
    assert 0 < moved < 1024
    total = one("vllm_neuron:kv_blocks_total")
    assert total > 0 and 0 <= one("vllm_neuron:kv_blocks_used") <= total
    assert one("vllm_neuron:device_memory_used_bytes") > 0


def test_step_trace_gives_each_step_of_a_request(server, client):
    """VLLM_NEURON_STEP_TRACE: one JSON line per step, in the engine-core process, with what it computed."""

    def lines() -> list[dict]:
        return [json.loads(line) for line in server.step_trace.read_text().splitlines()]

    before, start = len(lines()), time.time()
    prompt = [(index * 37) % 300 + 20 for index in range(50)]  # unseen: no prefix-cache hits
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
    steps = lines()[before:]
    # The prompt in one step (50 tokens, within the budget), which samples the first token; then one decode
    # row per further token.
    assert [(step["prefill_tokens"], step["decode_rows"]) for step in steps] == [(50, 0)] + [(0, 1)] * 5
    assert steps[0]["calls"] == ["fresh prefill of 50 tokens: tokens 64, over its own keys"]
    assert all(step["calls"] == ["decode of 1 requests: batch 2 x context 256"] for step in steps[1:])
    for step in steps:
        assert start <= step["time"] <= time.time()
        parts = step["prepare_ms"] + step["forward_ms"] + step["sample_ms"]
        assert 0 < step["forward_ms"] <= parts <= step["step_ms"] + 0.1
    # The engine's own work between two steps of one request (the first served step has no previous one).
    assert all(step["since_previous_ms"] >= 0 for step in steps[1:])
    # The host's share of a decode step, the device idle since the previous step's calls: at least this
    # step's input preparation, at most the time since the previous step started. An int32 token leaves.
    for previous, step in itertools.pairwise(steps):
        since_start = previous["step_ms"] + step["since_previous_ms"] + step["prepare_ms"]
        assert step["prepare_ms"] - 0.01 <= step["host_ms"] <= since_start + 0.1
        assert (step["to_host_bytes"], step["sampler"]) == (4, "device")


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server, client):
    def metric(name: str) -> float:
        return sum(metric_values(http("GET", server.base + "/metrics")[1].decode(), name).values())

    before = metric("vllm:generation_tokens_total")
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
        running = metric("vllm:num_requests_running")
        usage = metric("vllm:kv_cache_usage_perc")
        if running == 0 and usage == 0:
            break
        time.sleep(0.5)
    assert running == 0 and usage == 0, (running, usage)
    assert metric("vllm:generation_tokens_total") - before < 240  # aborted, not run to max_tokens
