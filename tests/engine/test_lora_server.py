"""LoRA through the HTTP API (issue 39): `vllm-neuron serve --enable-lora --lora-modules`, a request's
`model` choosing its adapter, an adapter loaded and unloaded at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING),
adapters in /v1/models, /v1/neuron/info and /metrics, and no graph compiled for any of it (strict mode)."""

import json
from pathlib import Path

import pytest

from tests.conftest import FEW_BUCKETS
from tests.helpers import build_adapter, hf_greedy, random_prompt
from tests.serving import MODEL_NAME, ServerProcess, completion, http

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPT = random_prompt(6, seed=39)
# name -> (rank, alpha, target modules, seed)
STATIC = {"support": (8, 16, ["q_proj", "v_proj"], 11)}
RUNTIME = {"billing": (4, 8, ["o_proj", "down_proj"], 12)}
HEAD = {"head": (4, 4, ["q_proj", "lm_head"], 14)}
UNSERVABLE = {"wide": (16, 16, ["q_proj"], 13)}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    folder = tmp_path_factory.mktemp("served-adapters")
    specs = STATIC | RUNTIME | HEAD | UNSERVABLE
    built = {name: build_adapter(tiny_model_dir, folder / name, *spec) for name, spec in specs.items()}
    return {name: (folder / name, model) for name, model in built.items()}


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, adapters, tmp_path_factory):
    """One server with two adapter slots of rank up to 8, one adapter named on the command line, and one
    bucket of each kind (the last --additional-config wins)."""
    folder = tmp_path_factory.mktemp("lora-server")
    modules = [f"{name}={adapters[name][0]}" for name in STATIC]
    server = ServerProcess(
        tiny_model_dir,
        folder / "server.log",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        *modules,
        "--additional-config",
        json.dumps(FEW_BUCKETS),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def complete(server: ServerProcess, model: str) -> tuple[int, dict]:
    """PROMPT's greedy tokens from `model` (the base model or an adapter), or the error (e.g. 404)."""
    status, raw = completion(server, PROMPT, MAX_TOKENS, model=model, return_token_ids=True)
    return status, json.loads(raw)


def post(server: ServerProcess, route: str, body: dict) -> tuple[int, bytes]:
    return http("POST", server.base + route, json.dumps(body).encode())


def models(server: ServerProcess) -> dict[str, dict]:
    status, raw = http("GET", server.base + "/v1/models")
    assert status == 200
    return {entry["id"]: entry for entry in json.loads(raw)["data"]}


def info(server: ServerProcess) -> dict:
    status, raw = http("GET", server.base + "/v1/neuron/info")
    assert status == 200
    return json.loads(raw)


def test_a_requests_model_chooses_its_adapter(lora_server, adapters, hf_model):
    listed = models(lora_server)
    assert set(listed) == {MODEL_NAME, *STATIC} and listed["support"]["parent"] == MODEL_NAME
    for name, reference in [("support", adapters["support"][1]), (MODEL_NAME, hf_model)]:
        status, body = complete(lora_server, name)
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == hf_greedy(reference, PROMPT, MAX_TOKENS)


def test_an_adapter_loaded_at_run_time_is_served_then_unloaded(lora_server, adapters):
    graphs = info(lora_server)["compile"]
    path, reference = adapters["billing"]
    status, raw = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "billing", "lora_path": str(path)})
    assert status == 200, raw
    assert "billing" in models(lora_server)
    status, body = complete(lora_server, "billing")
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == hf_greedy(reference, PROMPT, MAX_TOKENS)
    lora = info(lora_server)["lora"]
    assert {"billing", *STATIC} <= set(lora["slots"]) and lora["max_loras"] == 2
    assert lora["slot_bytes"] > 0 and {"billing", *STATIC} <= set(lora["adapters"])

    status, raw = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "billing"})
    assert status == 200, raw
    assert "billing" not in models(lora_server)
    status, body = complete(lora_server, "billing")
    assert status == 404 and "billing" in body["error"]["message"]
    assert "billing" not in info(lora_server)["lora"]["slots"]
    assert info(lora_server)["compile"] == graphs


def test_every_graph_lowered_with_the_slots_and_the_caches_in_place(lora_server):
    """XLA compiled and ran each graph (tests/environment.py): the slot weights and each row's slot are
    inputs of the one program, the KV caches still updated in place."""
    lowered = info(lora_server)["lowered_graphs"]
    assert lowered and all(graph["caches_in_place"] for graph in lowered)


def test_an_unservable_adapter_is_refused_by_name_with_a_4xx(lora_server, adapters):
    path, _ = adapters["wide"]
    status, raw = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(path)})
    assert 400 <= status < 500, raw
    assert "LoRA rank 16 is greater than max_lora_rank 8" in json.loads(raw)["error"]["message"]
    assert "wide" not in models(lora_server)
    status, body = complete(lora_server, "support")  # the server serves on
    assert status == 200, body


def test_an_adapter_on_the_lm_head_is_served(lora_server, adapters):
    """vLLM wraps the output embedding too unless --lora-target-modules leaves it out (then such an
    adapter is refused: tests/engine/test_lora.py)."""
    path, reference = adapters["head"]
    status, raw = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "head", "lora_path": str(path)})
    assert status == 200, raw
    status, body = complete(lora_server, "head")
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == hf_greedy(reference, PROMPT, MAX_TOKENS)


def test_metrics_show_the_adapters(lora_server):
    complete(lora_server, "support")
    status, raw = http("GET", lora_server.base + "/metrics")
    assert status == 200
    text = raw.decode()
    assert 'vllm:lora_requests_info{max_lora="2"' in text
    assert "vllm_neuron:lora_adapters_loaded" in text
    assert "vllm_neuron:unexpected_recompiles_total 0.0" in text
