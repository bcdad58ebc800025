"""Data parallelism (issue 41): `vllm-neuron serve --data-parallel-size 2` runs two engines behind vLLM's own
coordinator, each worker on its own share of the host (its NeuronCores on Trainium, its CPUs here), and
serves the tokens one engine serves."""

import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from tests.conftest import FEW_BUCKETS
from tests.engine.test_kv_events import Router, events_config, router_hashes
from tests.engine.test_server import metric_values
from tests.helpers import hf_greedy, random_prompt
from tests.serving import MODEL_NAME, ServerProcess, free_port, http

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPTS = [random_prompt(4 + 23 * i, seed=410 + i) for i in range(8)]


def two_ports() -> int:
    """A port P with P + 1 free too: vLLM offsets the KV events endpoint's port by the DP rank."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two free ports in a row")


@pytest.fixture(scope="module")
def routers():
    """llm-d's way round: the router binds, each engine's publisher connects to its own endpoint. Any first
    sequence number: here engine 0's first batch did not reach its subscriber (a router asks the replay
    endpoint for what it missed), the batches after it did, in sequence."""
    port = two_ports()
    subscribers = [Router(f"tcp://127.0.0.1:{port + rank}", first_seq=None) for rank in (0, 1)]
    yield subscribers
    for subscriber in subscribers:
        subscriber.close()


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, tmp_path_factory, routers):
    folder = tmp_path_factory.mktemp("data-parallel")
    server = ServerProcess(
        tiny_model_dir,
        folder / "server.log",
        "--data-parallel-size",
        "2",
        "--additional-config",
        json.dumps(FEW_BUCKETS),
        "--kv-events-config",
        json.dumps(events_config(routers[0].endpoint)),
        "--prefix-caching-hash-algo",
        "sha256_cbor",
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def complete_concurrently(server: ServerProcess, prompts: list[list[int]]) -> list[list[int]]:
    client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(prompt: list[int]) -> list[int]:
        response = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return response.choices[0].token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts))


def test_two_engines_serve_one_engines_greedy_tokens(dp_server, hf_model):
    """Concurrent requests are spread over both engines (vLLM's coordinator balances them) and each gets
    HF's greedy tokens, which one engine gives too (tests/engine/test_engine.py)."""
    tokens = complete_concurrently(dp_server, PROMPTS)
    assert tokens == [hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in PROMPTS]
    status, raw = http("GET", dp_server.base + "/metrics")
    assert status == 200
    finished = metric_values(raw.decode(), "vllm:request_success_total")
    per_engine = {engine: 0.0 for engine in ("0", "1")}
    for labels, value in finished.items():
        per_engine[labels.split('engine="')[1].split('"')[0]] += value
    assert sum(per_engine.values()) == len(PROMPTS) and min(per_engine.values()) > 0, per_engine


def test_each_engine_publishes_kv_events_on_the_endpoint_info_names(dp_server, routers):
    """/v1/neuron/info names each engine's endpoint, in rank order, and a prompt sent to an engine (vLLM's
    X-data-parallel-rank header) has its blocks announced on that engine's endpoint."""
    info = json.loads(http("GET", dp_server.base + "/v1/neuron/info")[1])["kv_events"]
    assert info["endpoints"] == [router.endpoint for router in routers]
    assert info["endpoint"] == routers[0].endpoint
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    client = OpenAI(base_url=dp_server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    for attempt in range(2):
        for rank, router in enumerate(routers):
            prompt = random_prompt(70, seed=430 + 2 * attempt + rank)
            client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=1,
                extra_headers={"X-data-parallel-rank": str(rank)},
            )
            router.receive()
    # The last prompt of each engine, announced on its own endpoint only.
    for rank, router in enumerate(routers):
        hashes = set(router_hashes(random_prompt(70, seed=432 + rank), info["block_size"], seed))
        assert hashes <= router.index and not hashes & routers[1 - rank].index, rank


def test_each_engine_pinned_its_worker_to_its_own_cpus(dp_server):
    pinned = [line for line in dp_server.log().splitlines() if "on this host runs on CPUs" in line]
    assert sorted(line.split("CPU mode: worker ")[1].split(" of")[0] for line in pinned) == ["0", "1"]
    status, raw = http("GET", dp_server.base + "/v1/neuron/info")
    assert status == 200 and json.loads(raw)["data_parallel_size"] == 2
