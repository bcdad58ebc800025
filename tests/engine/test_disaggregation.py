"""Prefill/decode disaggregation through vLLM's KV connector API (issue 41): a prefill server (kv_producer)
and a decode server (kv_consumer) with vLLM's ExampleConnector over a shared folder, driven by the plugin's
worker around its compiled steps (worker/kv/kv_transfer.py), give one server's greedy tokens; the decode
server loads the prompts' KV rather than computing it; neither compiles a graph after warm-up. Start-up
refuses the connectors and settings the plugin would serve wrong (vllm_neuron/refusals.py:
_kv_transfer_refusals)."""

import json
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from vllm.config import KVTransferConfig

from kv_cache import layout
from tests.conftest import FEW_BUCKETS
from tests.engine.test_server import metric_values
from tests.helpers import engine_config, hf_greedy, random_prompt
from tests.serving import ServerProcess, complete, http, stop_all
from worker.kv.kv_transfer import KVTransfer

MAX_TOKENS = 8
BLOCK_SIZE = 32
# Beyond one block and beyond the 64-token prefill bucket (a prompt of several calls in one step); one
# shorter than a block, which the decode server computes itself. No length is 1 + a multiple of the block
# size: ExampleConnector's producer stores (n - 1) // 32 * 32 tokens, the consumer looks up (n-2) // 32 * 32.
LENGTHS = (40, 75, 100, 150, 200, 20)
PROMPTS = [random_prompt(length, seed=4100 + i) for i, length in enumerate(LENGTHS)]
# What the decode server loads: every whole block of a prompt but the one its last token is in.
LOADED_TOKENS = sum((length - 2) // BLOCK_SIZE * BLOCK_SIZE for length in LENGTHS)
# What vLLM's disaggregation proxies send the prefill server: it prefills, samples one token, and hands over.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# A server that saves must prefill each prompt in one step (ExampleConnector stores it in that step).
ONE_STEP_PREFILL = ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "256")


def transfer_config(role: str, folder) -> str:
    return json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(folder)},
        }
    )


def test_the_block_major_view_is_the_cache_itself():
    cache = layout.allocate(5, 4, 2, 3, torch.float32, torch.device("cpu"))
    view = layout.block_major(cache)
    assert view.shape == (5, 4, 4, 3) and view.data_ptr() == cache.data_ptr()
    # ExampleConnector's write of two tokens (block 2, offsets 1 and 3), through the view.
    view[torch.tensor([2, 2]), :, torch.tensor([1, 3])] = torch.ones(2, 4, 3)
    assert cache[:, 2, [1, 3]].eq(1).all() and cache.sum() == 2 * 4 * 3


class Caches:
    """Two layers' caches, as the runner's KVCaches gives them."""

    def __init__(self) -> None:
        self.tensors = {name: torch.zeros(4, 3, BLOCK_SIZE, 2) for name in ("layers.0", "layers.1")}

    def by_layer(self) -> dict[str, torch.Tensor]:
        return self.tensors


def test_a_step_loads_before_its_calls_and_saves_after_them(monkeypatch):
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorTransferResults,
    )
    from vllm.forward_context import is_forward_context_available

    connector = mock.create_autospec(KVConnectorBase_V1, instance=True)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    caches = Caches()
    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer"),
        compilation_config=SimpleNamespace(fast_moe_cold_start=False, static_forward_context={}),
    )
    transfer = KVTransfer(config, caches)
    step = SimpleNamespace(kv_connector_metadata="meta", has_sync_kv_loads=True, finished_req_ids=set())

    def loads(context) -> None:  # what a connector sees: each layer's cache, block-major, the same storage
        for name, layer in context.no_compile_layers.items():
            assert layer.kv_cache.shape == (3, 4, BLOCK_SIZE, 2)
            assert layer.kv_cache.data_ptr() == caches.tensors[name].data_ptr()

    connector.start_load_kv.side_effect = loads
    with transfer.around(step) as output:
        # The compiled calls: no connector metadata (vLLM's attention op would run its hooks) and no forward
        # context but the step's own, as in warm-up.
        before = [call[0] for call in connector.method_calls]
        assert not is_forward_context_available()
    assert before == [
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_layer_load",
        "wait_for_layer_load",
        "clear_connector_metadata",
    ]
    after = [call[0] for call in connector.method_calls[len(before) :]]
    assert after[:4] == ["bind_connector_metadata", "save_kv_layer", "save_kv_layer", "wait_for_save"]
    assert after[-1] == "clear_connector_metadata" and output is not None

    # A warm-up step (no metadata) runs no connector; a consumer only loads.
    with transfer.around(SimpleNamespace(kv_connector_metadata=None)) as output:
        assert output is None
    config.kv_transfer_config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_consumer")
    connector.reset_mock()
    with KVTransfer(config, caches).around(step):
        pass
    assert "save_kv_layer" not in [call[0] for call in connector.method_calls]
    # A step with no tokens still reports the connector's finished transfers.
    connector.get_transfer_results.return_value = KVConnectorTransferResults(finished_sending={"sent"})
    assert transfer.without_forward(step).kv_connector_output.finished_sending == {"sent"}


@pytest.mark.parametrize(
    ("connector", "overrides", "refusal"),
    [
        ("NixlPushConnector", {}, "the plugin runs a connector around each step's compiled calls"),
        ("LMCacheConnectorV1", {}, "the plugin runs a connector around each step's compiled calls"),
        ("ExampleConnector", {}, "must prefill each prompt in one step"),
        (
            "ExampleConnector",
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 256},
            "must prefill each prompt in one step",  # the prefill share still chunks
        ),
        ("NixlConnector", {"transfer": {"kv_buffer_device": "cuda"}}, "stages KV through host memory"),
        (
            "NixlConnector",
            {"transfer": {"kv_connector_extra_config": {"progress_thread": "off"}}},
            "'progress_thread' is true .* or false .*, not 'off'",
        ),
        (
            "NixlConnector",
            {"transfer": {"kv_connector_module_path": "my.connectors"}},
            "the plugin runs a connector around each step's compiled calls",
        ),
    ],
)
def test_start_up_refuses_what_would_be_served_wrong(tiny_model_dir, connector, overrides, refusal):
    transfer = KVTransferConfig(
        kv_connector=connector, kv_role="kv_producer", **overrides.pop("transfer", {})
    )
    with pytest.raises(ValueError, match=refusal):
        engine_config(tiny_model_dir, kv_transfer_config=transfer, **overrides)


def test_a_decode_server_may_chunk_its_prefills(tiny_model_dir):
    transfer = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_consumer")
    assert engine_config(tiny_model_dir, kv_transfer_config=transfer).kv_transfer_config is transfer


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """A prefill and a decode server over one shared folder, warmed up side by side."""
    folder = tmp_path_factory.mktemp("disaggregation")
    buckets = json.dumps(FEW_BUCKETS)
    prefill = ServerProcess(
        tiny_model_dir,
        folder / "prefill.log",
        "--kv-transfer-config",
        transfer_config("kv_producer", folder / "kv"),
        *ONE_STEP_PREFILL,
        "--additional-config",
        json.dumps(FEW_BUCKETS | {"prefill_tokens_while_decoding": 0}),
    )
    decode = ServerProcess(
        tiny_model_dir,
        folder / "decode.log",
        "--kv-transfer-config",
        transfer_config("kv_consumer", folder / "kv"),
        "--additional-config",
        buckets,
    )
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        yield prefill, decode
    finally:
        stop_all(prefill, decode)  # their drains and exits overlap


@pytest.mark.slow
def test_prefill_then_decode_gives_one_servers_greedy_tokens(servers, hf_model):
    prefill, decode = servers
    graphs = [compiled_graphs(server) for server in servers]
    for prompt in PROMPTS:
        expected = hf_greedy(hf_model, prompt, MAX_TOKENS)
        handed = complete(
            prefill, prompt, 1, timeout=120, return_token_ids=True, kv_transfer_params=PREFILL_PARAMS
        )
        assert handed["choices"][0]["token_ids"] == expected[:1]
        # ExampleConnector finds the KV by the prompt and hands over no parameters; a NIXL-style connector
        # would name the remote blocks here.
        params = handed.get("kv_transfer_params")  # None: left out
        answer = complete(
            decode, prompt, MAX_TOKENS, timeout=120, return_token_ids=True, kv_transfer_params=params
        )
        assert answer["choices"][0]["token_ids"] == expected, len(prompt)

    metrics = http("GET", decode.base + "/metrics")[1].decode()
    loaded = sum(metric_values(metrics, "vllm:external_prefix_cache_hits_total").values())
    assert loaded == LOADED_TOKENS  # the decode server loaded these, and computed only the rest
    assert [compiled_graphs(server) for server in servers] == graphs  # none after warm-up, on either
    for server in servers:
        metrics = http("GET", server.base + "/metrics")[1].decode()
        assert sum(metric_values(metrics, "vllm_neuron:unexpected_recompiles_total").values()) == 0


def compiled_graphs(server: ServerProcess) -> float:
    metrics = http("GET", server.base + "/metrics")[1].decode()
    return sum(metric_values(metrics, "vllm_neuron:compiled_graphs").values())
