"""Neuron-mode start-up without Trainium: an engine with VLLM_NEURON_DEVICE=neuron on tests/fake_neuron, a
stand-in for TorchNeuron that enforces the Neuron runtime's start-up rules (see its docstring), from
start-up through warm-up to greedy tokens; and unit tests of each rule the plugin follows."""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import ENGINE_KWARGS, EXPECTED_GRAPHS, hf_greedy
from tests.test_vllm_parity import MAX_TOKENS, PROMPTS, run_engine
from vllm_neuron import compile_cache, device
from vllm_neuron.platform import NeuronPlatform

FAKE_NEURON = Path(__file__).with_name("fake_neuron")
CORE_MEMORY = 256 * 1024**2  # small, so that the KV cache it sizes stays small in host memory
KV_CACHE_FRACTION = 0.3  # the default


class NeuronStub:
    """torch.neuron as device.py sees it: a fixed total memory, and a log of the calls (each of which would
    start the Neuron runtime)."""

    def __init__(self, total_memory: int) -> None:
        self.total_memory = total_memory
        self.calls: list[str] = []

    def get_device_properties(self, device_id: int) -> object:
        self.calls.append("get_device_properties")
        return type("Properties", (), {"total_memory": self.total_memory})()


@pytest.fixture
def neuron_mode(monkeypatch) -> NeuronStub:
    """Neuron mode in this (CPU-mode) test process, with torch.neuron stubbed."""
    stub = NeuronStub(total_memory=24 * 1024**3)
    monkeypatch.setattr(device, "mode", lambda: "neuron")
    monkeypatch.setattr(torch, "neuron", stub, raising=False)
    return stub


def test_one_rank_is_pinned_to_one_core_too(neuron_mode, monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-5")  # the pod's cores
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    device.pin_rank(0, 1)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "4"
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("0", "1")


def test_engine_config_does_not_start_the_runtime(neuron_mode):
    """vLLM asks the platform for device memory while it builds the engine config, before any worker."""
    with pytest.raises(NotImplementedError):
        NeuronPlatform.get_device_total_memory()
    assert neuron_mode.calls == []


def test_fallback_to_host_execution_is_disabled(neuron_mode, monkeypatch):
    monkeypatch.delenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", raising=False)
    device.disable_fallback_execution()
    assert os.environ["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "1"


@pytest.mark.slow
def test_neuron_mode_starts_in_the_order_the_runtime_needs(tiny_model_dir, hf_model, tmp_path):
    record, cache_root = tmp_path / "fake_neuron.json", tmp_path / "compile-cache"
    env = {
        "VLLM_NEURON_DEVICE": "neuron",
        "PYTHONPATH": os.pathsep.join([str(FAKE_NEURON), os.environ.get("PYTHONPATH", "")]),
        "FAKE_NEURON_RECORD": str(record),
        "FAKE_NEURON_TOTAL_MEMORY": str(CORE_MEMORY),
        "VLLM_NEURON_GRAPH_RESERVE_BYTES": str(16 * 1024**2),
        "VLLM_NEURON_CACHE_ROOT": str(cache_root),
        # The Kubernetes device plugin gave this pod two cores; it serves with one rank.
        "NEURON_RT_VISIBLE_CORES": "0-1",
        "TORCH_NEURONX_NEFF_CACHE_DIR": None,
        "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": None,
    }
    result = run_engine(tiny_model_dir, ENGINE_KWARGS, env)

    assert result["platform"] == "NeuronPlatform"
    assert result["tokens"] == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    facts = json.loads(record.read_text())
    (folder,) = cache_root.iterdir()
    assert facts["runtime_started_by"] == "process group"
    assert facts["process_group_before_runtime"]
    assert facts["neff_cache_dir_at_start"] == str(folder / "neff")
    assert facts["visible_cores_at_start"] == "0"
    assert len(facts["compiles"]) == EXPECTED_GRAPHS
    assert all(graph["fallback_disabled"] for graph in facts["compiles"])
    assert compile_cache.is_warm(folder)  # the NEFFs are in this configuration's folder
    (stats,) = result["compile_stats"]
    assert stats["graphs"] == EXPECTED_GRAPHS and stats["unexpected_recompiles"] == 0
