"""Neuron-mode start-up without Trainium: an engine with VLLM_NEURON_DEVICE=neuron on tests/fake_neuron, a
stand-in for TorchNeuron that enforces the Neuron runtime's start-up rules (see its docstring), from
start-up through warm-up to greedy tokens; and unit tests of each rule the plugin follows."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ENGINE_KWARGS, EVERY_FORM_ENGINE, EVERY_FORM_GRAPHS, EXPECTED_GRAPHS, model_runner
from tests.engine.test_speculative import SPECULATIVE, copy_friendly_prompt
from tests.environment import TEST_ENVIRONMENT
from tests.helpers import MAX_TOKENS, PROMPTS, hf_greedy, run_engine
from vllm_neuron import device
from vllm_neuron.compiler import compile_cache, hlo_text, neuronx_cc_rules
from vllm_neuron.platform import NeuronPlatform
from worker.neuron_worker import NeuronWorker

FAKE_NEURON = Path(__file__).parents[1] / "fake_neuron"
CORE_MEMORY = 256 * 1024**2  # small, so that the KV cache it sizes stays small in host memory
KV_CACHE_FRACTION = 0.3  # the default
# KV bytes of one block of the tiny model: K and V x 2 layers x 2 KV heads x 32 dims x 32 tokens x float32
KV_BLOCK_BYTES = 2 * 2 * 2 * 32 * 32 * 4


class NeuronStub:
    """torch.neuron as device.py sees it: a fixed total memory, memory in use that changes from one call to
    the next, and a log of the calls (each of which would start the Neuron runtime)."""

    def __init__(self, total_memory: int) -> None:
        self.total_memory = total_memory
        self.calls: list[str] = []

    def get_device_properties(self, device_id: int) -> SimpleNamespace:
        self.calls.append("get_device_properties")
        return SimpleNamespace(total_memory=self.total_memory)

    def _in_use(self, name: str) -> int:
        self.calls.append(name)
        return len(self.calls) * 1024**2

    def memory_allocated(self, device_id: int | None = None) -> int:
        return self._in_use("memory_allocated")

    def memory_reserved(self, device_id: int) -> int:
        return self._in_use("memory_reserved")

    def mem_get_info(self, device_id: int) -> tuple[int, int]:
        return self.total_memory - self._in_use("mem_get_info"), self.total_memory

    def synchronize(self) -> None:
        self.calls.append("synchronize")


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
    device.pin_rank(0, 1, assigned=None, host_workers=1)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "4"
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("0", "1")


def test_data_parallel_engines_take_their_cores_from_the_visible_ranges(neuron_mode, monkeypatch):
    """vLLM gives DP engine r of a host the devices [r * TP, (r + 1) * TP) through the platform: ranges such
    as the device plugin writes them are read, and each engine's rank is pinned to the core it was given."""
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "8-9,12-13")
    assert [NeuronPlatform.device_id_to_physical_device_id(i) for i in range(4)] == [8, 9, 12, 13]
    device.pin_rank(0, 1, assigned=12, host_workers=4)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "12"


def test_engine_config_does_not_start_the_runtime(neuron_mode):
    """vLLM asks the platform for device memory while it builds the engine config, before any worker."""
    with pytest.raises(NotImplementedError):
        NeuronPlatform.get_device_total_memory()
    assert neuron_mode.calls == []


def test_fallback_to_host_execution_is_disabled(neuron_mode, monkeypatch):
    monkeypatch.delenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", raising=False)
    device.disable_fallback_execution()
    assert os.environ["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "1"


def test_compiler_defaults_leave_a_users_own_value(neuron_mode, monkeypatch):
    monkeypatch.setenv("NEURON_COMPILER_OPT_LEVEL", "-O2")
    device.set_compiler_defaults()
    assert os.environ["NEURON_COMPILER_OPT_LEVEL"] == "-O2"
    monkeypatch.delenv("NEURON_COMPILER_OPT_LEVEL")
    device.set_compiler_defaults()
    assert os.environ["NEURON_COMPILER_OPT_LEVEL"] == device.COMPILER_DEFAULTS["NEURON_COMPILER_OPT_LEVEL"]


def test_memory_in_use_is_what_the_allocator_holds_without_waiting_for_the_device(neuron_mode, monkeypatch):
    monkeypatch.setattr(neuron_mode, "memory_reserved", lambda device_id=None: 0)  # as TorchNeuron answers
    monkeypatch.setattr(neuron_mode, "memory_allocated", lambda device_id=None: 5 * 1024**2)
    assert device.memory_in_use() == 5 * 1024**2
    # /metrics reads it once a second on the engine thread, which a synchronize would hold until the step
    # it just submitted ends.
    assert "synchronize" not in neuron_mode.calls


RANK_ONE = """
import os, torch, torch_neuronx
from vllm_neuron import device
store = torch.distributed.HashStore()
store.set(torch_neuronx.ROOT_PORT_KEY, "29511")  # rank 0's pick
torch_neuronx.runtime.create_process_group(rank=1, size=2, store=store)
print(device.total_memory(), device.memory_in_use(), os.environ["NEURON_RT_ROOT_COMM_ID"])
for query in ("torch.neuron.get_device_properties(1)", "torch.neuron.memory_allocated(0)"):
    try:
        eval(query)
    except torch_neuronx.FakeNeuronRuleError as error:
        print("refused:", error)
# A group of 4 ranks, 2 on this node: its root communicator must not be this node's loopback.
for address in ("localhost", "127.0.0.1", "10.0.0.5"):
    os.environ.pop("NEURON_RT_ROOT_COMM_ID")
    os.environ["MASTER_ADDR"] = address
    try:
        torch_neuronx.Runtime().set_root_comm_id(rank=1, size=4, store=store)
        print(os.environ["NEURON_RT_ROOT_COMM_ID"])
    except torch_neuronx.FakeNeuronRuleError as error:
        print("refused:", error)
"""


BLOCKING = """
import torch, torch_neuronx
from vllm_neuron import device
with torch_neuronx.HostToDeviceCopies() as copies:
    held = torch.zeros(4)
    held.copy_(torch.ones(4))
    held.copy_(torch.ones(4), non_blocking=True)
    torch.ones(4).to("cpu", torch.float32, True)
    torch.ones(4).to("cpu")
    held[:1].copy_(torch.ones(1))  # one element: the bounce buffer, no wait
print(copies.blocking)
slot = torch.zeros(8, dtype=torch.bfloat16)  # a host tensor numpy cannot hold
device.copy_to_device(slot, torch.arange(8, dtype=torch.bfloat16))
print(torch_neuronx.runtime.facts["synchronize"], torch_neuronx.runtime.facts["to_device"], slot.tolist())
try:
    device.copy_to_device(torch.zeros(4, 2).t(), torch.ones(2, 4))
except ValueError as error:
    print("refused:", error)
"""


def test_a_blocking_transfer_to_the_device_is_a_synchronize():
    """Fake rule (j) sees each copy's non_blocking, and the plugin's transfer seam waits for nothing, takes
    any host tensor (bfloat16 too) and refuses a non-contiguous destination (a round trip through the
    host)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_NEURON), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", BLOCKING], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    blocking, seam, refused = done.stdout.strip().split("\n")
    assert (blocking, seam) == ("2", "{} {'MainThread': 1} [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]")
    assert refused.startswith("refused:") and "non-contiguous" in refused


def test_tensor_parallel_rank_one_reads_its_own_cores_memory(tmp_path):
    """Each rank's process sees one NeuronCore: its memory is index 0 to the runtime's memory query, and the
    current device (the local rank) to the allocator's (fake TorchNeuron's rule (e)). The process group sets
    the root communicator's address, refused on a loopback address when the group spans nodes (rule (h))."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_NEURON), os.environ.get("PYTHONPATH", "")]))
    env |= {"VLLM_NEURON_DEVICE": "neuron", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    env |= {"NEURON_RT_VISIBLE_CORES": "1", "FAKE_NEURON_TOTAL_MEMORY": str(CORE_MEMORY)}
    command = [sys.executable, "-c", RANK_ONE]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first, *refusals, across_nodes = done.stdout.strip().splitlines()
    # Rule (h): MASTER_ADDR unset is localhost, with the port rank 0 shared through the store.
    assert first == f"{CORE_MEMORY} 0 localhost:29511"
    assert len(refusals) == 4 and "total_memory=0" in refusals[0] and "never uses" in refusals[1]
    assert all("point at themselves" in refusal for refusal in refusals[2:])
    assert across_nodes == "10.0.0.5:29511"


def kv_cache_bytes(weights: int = 1024**2, utilization: float = 0.9) -> int:
    """NeuronWorker.determine_available_memory of a worker whose model has `weights` bytes (meta tensors)."""
    model = torch.nn.Linear(weights // 4, 1, bias=False, device="meta")
    worker = SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_memory_bytes=None, gpu_memory_utilization=utilization),
        local_rank=0,
        model_runner=SimpleNamespace(model=model, lora=None),
        cache_fields={"model": "a configuration no graph was lowered for"},
    )
    return NeuronWorker.determine_available_memory(worker)


def test_kv_cache_is_a_fixed_share_of_the_core(neuron_mode, monkeypatch):
    """Not what happens to be free: pods sharing a compile cache must compile the same KV shapes."""
    sizes = {kv_cache_bytes() for _ in range(3)}
    assert sizes == {int(neuron_mode.total_memory * KV_CACHE_FRACTION)}
    monkeypatch.setenv("VLLM_NEURON_KV_CACHE_FRACTION", "0.1")
    assert kv_cache_bytes() == int(neuron_mode.total_memory * 0.1)
    for bad in ("0", "1.5", "lots"):
        monkeypatch.setenv("VLLM_NEURON_KV_CACHE_FRACTION", bad)
        with pytest.raises(ValueError, match="VLLM_NEURON_KV_CACHE_FRACTION"):
            kv_cache_bytes()


def test_zero_device_memory_fails_at_start_up(neuron_mode):
    neuron_mode.total_memory = 0
    with pytest.raises(RuntimeError, match="reports 0 bytes of device memory"):
        kv_cache_bytes()


def test_weights_and_kv_cache_that_do_not_fit_fail_at_start_up(neuron_mode):
    weights = 16 * 1024**3  # 8B parameters in bf16 on one 24 GiB core
    with pytest.raises(
        RuntimeError, match="weights 16.0 GiB \\+ KV cache 7.2 GiB .* larger --tensor-parallel"
    ):
        kv_cache_bytes(weights)
    kv_cache_bytes(weights // 4)


# A core whose KV share is the test engines' CPU KV budget (tests/environment.py): the same cache shape in
# both modes, so that each bucket's StableHLO can be compared whole.
ENGINE_CORE_MEMORY = math.ceil(int(TEST_ENVIRONMENT["VLLM_NEURON_CPU_KV_CACHE_BYTES"]) / KV_CACHE_FRACTION)


def fake_neuron_environment(record: Path, cache_root: Path) -> dict[str, str | None]:
    """An engine's environment in Neuron mode on fake TorchNeuron, which writes what it saw to `record` (a
    folder: a file per process); the plugin's compile cache under `cache_root`, TorchNeuron's settings the
    plugin's."""
    return {
        "VLLM_NEURON_DEVICE": "neuron",
        "VLLM_NEURON_COMPILE_BACKEND": None,  # Neuron mode's own: `neuron`
        "PYTHONPATH": os.pathsep.join([str(FAKE_NEURON), os.environ.get("PYTHONPATH", "")]),
        "FAKE_NEURON_RECORD": str(record),
        "FAKE_NEURON_TOTAL_MEMORY": str(ENGINE_CORE_MEMORY),
        "VLLM_NEURON_GRAPH_RESERVE_BYTES": str(16 * 1024**2),
        "VLLM_NEURON_CACHE_ROOT": str(cache_root),
        "TORCH_NEURONX_NEFF_CACHE_DIR": None,
        "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": None,
    }


@pytest.mark.slow
def test_neuron_mode_starts_in_the_order_the_runtime_needs(llm, tiny_model_dir, hf_model, tmp_path):
    record, cache_root = tmp_path / "fake_neuron.json", tmp_path / "compile-cache"
    env = fake_neuron_environment(record, cache_root) | {
        # The Kubernetes device plugin gave this pod two cores; it serves with one rank.
        "NEURON_RT_VISIBLE_CORES": "0-1",
        "NEURON_COMPILER_OPT_LEVEL": None,  # the plugin's default
        "NEURON_CC_FLAGS": "--enable-saturate-infinity",  # the user's own, passed on as it is
    }
    # Then requests that ask for logprobs (each row's top ones come to the host), and sleep level 1 (Neuron
    # mode moves the weights to the host and back) and the same tokens again.
    logprobs = [
        {"prompt": PROMPTS[0], "params": {"max_tokens": 4, "temperature": 0.0, "logprobs": 3}},
        {"prompt": PROMPTS[1], "params": {"max_tokens": 4, "temperature": 0.8, "seed": 1, "logprobs": 0}},
    ]
    # On a plan of each form of call at one bucket, each of which the shared engine has too.
    extra = {"sampling": logprobs, "sleep_level": 1}
    result = run_engine(tiny_model_dir, EVERY_FORM_ENGINE, env, extra=extra)

    assert result["platform"] == "NeuronPlatform"
    assert result["tokens"] == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    assert result["tokens_after_wake_up"] == result["tokens"]
    assert result["sampled_tokens"][0] == hf_greedy(hf_model, PROMPTS[0], 4)
    facts = json.loads(record.read_text())
    # No device tensor reached the host strided (fake rule (f)): no eager kernel compiled while serving.
    assert facts["eager_compiles"] == []
    # Nor any other eager op on a device tensor (rule (k)), write through the host or read past to_host (l).
    assert facts["eager_kernels"] == facts["host_round_trips"] == facts["host_reads"] == []
    # Fake rule (i): each call's inputs go to the device in one transfer (warm-up's, serving's, on any
    # thread), and the calls on the device thread bring nothing to the host: a decode row takes the previous
    # step's token on the device.
    assert sum(facts["to_device"].values()) == sum(facts["graph_runs"].values())
    serving_calls = facts["graph_runs"]["neuron-device_0"]
    assert serving_calls > 20 and "neuron-device_0" not in facts["to_host"]
    # Rule (m): no read waits for the whole stream. Each step's outputs start for the host on the device
    # thread behind its calls, and the engine thread waits for that step's fence only: not for the next
    # step's calls, which async scheduling has queued by then. Sleep mode's weights too, under one fence.
    assert facts["to_host"] == {}, facts["to_host"]
    assert facts["reads_started"]["neuron-device_0"] >= serving_calls
    assert facts["event_waits"]["MainThread"] >= serving_calls / 2, facts["event_waits"]
    # Fake rules (g) and (j): the engine thread waits for the device once per warm-up step (at most one a
    # graph) and around sleep mode, never per serving step; the device thread never waits: each call's
    # transfer is queued behind the calls before it.
    assert facts["synchronize"]["MainThread"] <= len(facts["compiles"]) + 4 < serving_calls
    assert "neuron-device_0" not in facts["synchronize"] and facts["blocking_to_device"] == {}
    (folder,) = cache_root.iterdir()
    assert facts["runtime_started_by"] == "process group"
    assert facts["process_group_before_runtime"]
    assert facts["neff_cache_dir_at_start"] == str(folder / "neff")
    assert facts["visible_cores_at_start"] == "0"
    assert len(facts["compiles"]) == EVERY_FORM_GRAPHS
    assert all(graph["fallback_disabled"] for graph in facts["compiles"])
    flags = {(graph["NEURON_COMPILER_OPT_LEVEL"], graph["NEURON_CC_FLAGS"]) for graph in facts["compiles"]}
    assert flags == {("-O1", "--enable-saturate-infinity")}
    assert compile_cache.is_warm(folder)  # the NEFFs are in this configuration's folder
    (stats,) = result["compile_stats"]
    assert stats["graphs"] == EVERY_FORM_GRAPHS and stats["unexpected_recompiles"] == 0
    assert stats["kv_cache_shape"][1] == int(ENGINE_CORE_MEMORY * KV_CACHE_FRACTION) // KV_BLOCK_BYTES
    # One graph for both modes: each bucket's StableHLO (the fake NEFF holds what neuronx-cc would get) is
    # the StableHLO of the same bucket in CPU mode, the shared engine's (the text names the bucket's shapes).
    neuron_mode = [Path(graph["neff"]).read_text() for graph in facts["compiles"]]
    cpu_mode = [graph.stablehlo for graph in model_runner(llm).recorder.lowering.graphs]
    assert len(cpu_mode) == EXPECTED_GRAPHS and len(set(neuron_mode)) == EVERY_FORM_GRAPHS
    for index, neuron_text in enumerate(neuron_mode):
        assert neuron_text in cpu_mode, f"graph {index} differs between Neuron mode and CPU mode"
    assert_every_written_input_aliased_and_the_rules_hold(facts["compiles"])


def assert_every_written_input_aliased_and_the_rules_hold(compiles: list[dict]) -> None:
    """What the fake TorchNeuron compiled, as its source would: every input its executor binds in place (each
    KV cache, the token slots) is in the NEFF's mhlo.input_output_alias from its analysis of dynamo's graph,
    and neuronx-cc's rules hold on each NEFF."""
    for graph in compiles:
        text = Path(graph["neff"]).read_text()
        written = graph["mutated_inputs"]
        assert len(written) >= 2 and sorted(hlo_text.parse(text).aliases) == sorted(written), graph
        assert neuronx_cc_rules.check(text, written) == [], graph


@pytest.mark.slow
def test_tensor_parallel_ranks_start_in_the_order_the_runtime_needs(tiny_model_dir, hf_model, tmp_path):
    """TP=2 in Neuron mode: vLLM's multiprocess executor starts a worker process per rank on fake TorchNeuron.
    Each rank pins its own one core of the pod's two, creates the `neuron` process group before anything
    starts the runtime (which sets the root communicator's address), reads its memory by the indices the
    runtime answers for (rule (e)), compiles every bucket once in warm-up, and serves HF's greedy tokens with
    no eager compile, with n-gram speculation (verify calls) and logprobs, each call's inputs in one
    transfer (rule (i))."""
    records, cache_root = tmp_path / "fake_neuron", tmp_path / "compile-cache"
    records.mkdir()
    env = fake_neuron_environment(records, cache_root) | {
        "NEURON_RT_VISIBLE_CORES": "2-3",  # the pod's two cores: rank 0 gets core 2, rank 1 core 3
        "FAKE_NEURON_CORES": "4",
        "NEURON_RT_ROOT_COMM_ID": None,
        "MASTER_ADDR": None,
    }
    # One bucket of each kind (test_tensor_parallel.py's server test): each phase's graph on each rank.
    small = {"prefill_buckets": [64], "decode_batch_buckets": [2], "context_buckets": [256]}
    engine = {**ENGINE_KWARGS, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    engine |= {"max_num_seqs": 2, "additional_config": small, "speculative_config": SPECULATIVE}
    max_tokens = 4
    logprobs = [{"prompt": PROMPTS[0], "params": {"max_tokens": 2, "temperature": 0.0, "logprobs": 3}}]
    # A prompt the n-gram drafter finds its next tokens in: verify calls.
    repeating = copy_friendly_prompt(40, seed=1)
    logprobs.append({"prompt": repeating, "params": {"max_tokens": 8, "temperature": 0.0}})
    result = run_engine(
        tiny_model_dir, engine, env, max_tokens=max_tokens, extra={"sampling": logprobs, "sleep_level": 1}
    )

    assert result["platform"] == "NeuronPlatform"
    assert result["tokens"] == [hf_greedy(hf_model, p, max_tokens) for p in PROMPTS]
    assert result["tokens_after_wake_up"] == result["tokens"]
    assert result["sampled_tokens"] == [hf_greedy(hf_model, PROMPTS[0], 2), hf_greedy(hf_model, repeating, 8)]
    stats = result["compile_stats"]
    assert [rank["rank"] for rank in stats] == [0, 1]
    # Per rank a prefill graph (64 tokens), a decode and a verify graph (2 rows), all of the 256-token
    # context, compiled in warm-up (strict shapes: a compile while serving would have failed the engine).
    graphs = 3
    assert all(rank["graphs"] == graphs and rank["unexpected_recompiles"] == 0 for rank in stats), stats
    facts = {}
    for path in records.iterdir():
        fact = json.loads(path.read_text())
        if "local_rank" in fact:  # a rank's worker (the engine process may record nothing)
            facts[fact["local_rank"]] = fact
    assert sorted(facts) == [0, 1]
    ports = set()
    for rank, fact in facts.items():
        assert fact["runtime_started_by"] == "process group" and fact["process_group_before_runtime"]
        assert fact["visible_cores_at_start"] == str(2 + rank)
        # Rule (h): one root communicator, rank 0's port, on this node.
        address, _, port = fact["root_comm_id"].rpartition(":")
        assert address == "localhost" and port.isdigit()
        ports.add(port)
        # Rule (e): the runtime's memory query at index 0 (the process's one core), the allocator's at the
        # current device (no index) or the own rank.
        queries = {(query["query"], query["index"]) for query in fact["memory_queries"]}
        assert ("get_device_properties", 0) in queries, queries
        assert queries <= {
            ("get_device_properties", 0),
            ("memory_allocated", None),
            ("memory_allocated", rank),
        }
        assert len(fact["compiles"]) == graphs
        assert all(graph["fallback_disabled"] for graph in fact["compiles"])
        assert fact["eager_compiles"] == []  # rule (f), through serving, logprobs, sleep and wake-up
        assert fact["eager_kernels"] == fact["host_round_trips"] == fact["host_reads"] == []  # (k), (l)
        assert sum(fact["to_device"].values()) == sum(fact["graph_runs"].values())  # rule (i)
        # Rule (j): no transfer waits for the device, and the device thread never synchronizes.
        assert fact["blocking_to_device"] == {} and "neuron-device_0" not in fact["synchronize"]
        assert_every_written_input_aliased_and_the_rules_hold(fact["compiles"])
        # Each rank's NEFFs in its own folder of the compile cache (its shard's graphs).
        folder = Path(fact["neff_cache_dir_at_start"]).parent
        assert folder.parent == cache_root and compile_cache.is_warm(folder)
    assert len(ports) == 1
    assert facts[0]["neff_cache_dir_at_start"] != facts[1]["neff_cache_dir_at_start"]
