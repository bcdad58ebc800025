"""Data parallelism (issue 41): `vllm-neuron serve --data-parallel-size 2` runs two engines behind vLLM's own
coordinator, each worker on its own share of the host (its NeuronCores on Trainium, its CPUs here), and
serves the tokens one engine serves."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from tests.conftest import FEW_BUCKETS
from tests.helpers import hf_greedy, random_prompt
from tests.serving import MODEL_NAME, ServerProcess, http
from tests.test_server import metric_values

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPTS = [random_prompt(4 + 23 * i, seed=410 + i) for i in range(8)]


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("data-parallel")
    server = ServerProcess(
        tiny_model_dir,
        folder / "server.log",
        "--data-parallel-size",
        "2",
        "--additional-config",
        json.dumps(FEW_BUCKETS),
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_two_engines_serve_one_engines_greedy_tokens(dp_server, hf_model):
    """Concurrent requests are spread over both engines (vLLM's coordinator balances them) and each gets
    HF's greedy tokens, which one engine gives too (tests/test_engine.py)."""
    client = OpenAI(base_url=dp_server.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(prompt: list[int]) -> list[int]:
        response = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return response.choices[0].token_ids

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        tokens = list(pool.map(complete, PROMPTS))
    assert tokens == [hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in PROMPTS]
    status, raw = http("GET", dp_server.base + "/metrics")
    assert status == 200
    finished = metric_values(raw.decode(), "vllm:request_success_total")
    per_engine = {engine: 0.0 for engine in ("0", "1")}
    for labels, value in finished.items():
        per_engine[labels.split('engine="')[1].split('"')[0]] += value
    assert sum(per_engine.values()) == len(PROMPTS) and min(per_engine.values()) > 0, per_engine


def test_each_engine_pinned_its_worker_to_its_own_cpus(dp_server):
    pinned = [line for line in dp_server.log().splitlines() if "on this host runs on CPUs" in line]
    assert sorted(line.split("CPU mode: worker ")[1].split(" of")[0] for line in pinned) == ["0", "1"]
    status, raw = http("GET", dp_server.base + "/v1/neuron/info")
    assert status == 200 and json.loads(raw)["data_parallel_size"] == 2
