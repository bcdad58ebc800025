"""The fake TorchNeuron's rules (k) and (l) (tests/fake_neuron/torch_neuronx/eager_ops.py), in a process of
their own: importing the fake intercepts torch's tensor methods and sets the plugin's device type."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FAKE_NEURON = Path(__file__).parents[1] / "fake_neuron"

# A tiny compiled graph makes its inputs and output device tensors; then eager ops on them and on host
# tensors, each tagged so that the record shows which op made it.
SCRIPT = """
import json, numpy as np, torch, torch_neuronx
from vllm_neuron import device

stacked = torch.zeros(2, 1, 4, 8)  # [slots, 1, max rank, in], as vLLM's LoRA layers stack A
kv = torch.zeros(4, 8)

@torch.compile(backend="neuron", fullgraph=True)
def step(kv, stacked, x):
    kv.mul_(2)  # written in place: the fake's run copies it back, inside the graph
    return kv + stacked.sum() + x

out = step(kv, stacked, torch.ones(4, 8))
host_scalar = torch.ones(())
facts, seen = torch_neuronx.runtime.facts, {}

def waits():
    return facts["synchronize"].get("MainThread", 0)

def tag(name, op):
    before = {key: len(facts[key]) for key in ("eager_kernels", "host_round_trips", "host_reads")}
    synchronized = waits()
    op()
    seen[name] = {key: facts[key][before[key]:] for key in before}
    if waits() > synchronized:
        seen[name]["synchronize"] = waits() - synchronized

tag("graph", lambda: step(kv, stacked, out))
tag("reset slot", lambda: stacked.__setitem__(1, 0))
tag("reset slot again", lambda: stacked.__setitem__(0, 0))
tag("gapped slot write", lambda: stacked[1, 0, :4, :3].copy_(torch.ones(4, 3)))
tag("whole slot write", lambda: stacked[1].copy_(torch.ones(1, 4, 8), non_blocking=True))
tag("permuted write", lambda: kv.t().copy_(torch.ones(8, 4)))
tag("device copy", lambda: kv.copy_(out))
tag("zero", lambda: kv.zero_())
tag("fill", lambda: kv.fill_(2.0))
tag("fill again", lambda: kv.fill_(2.0))
tag("fill another value", lambda: kv.fill_(3.0))
tag("index", lambda: kv[torch.tensor([0, 1])])
tag("index_put", lambda: kv.__setitem__(torch.tensor([0]), 1.0))
tag("view", lambda: kv[1:, 2])
tag("read to host", lambda: torch.empty(4, 8).copy_(kv))
tag("read to host, non-blocking", lambda: torch.empty(4, 8).copy_(kv, non_blocking=True))
tag("item", lambda: kv[0, 0].item())
tag("tolist", lambda: out.tolist())
tag("bool", lambda: bool(kv[0, 0]))
tag("int and float", lambda: (int(kv[0, 0]), float(kv[0, 0])))
tag("cpu copy", lambda: kv.cpu().fill_(7))
tag("host scalars", lambda: (host_scalar.item(), bool(host_scalar), host_scalar.cpu().tolist()))
try:
    kv.numpy()
    numpy_refused = None
except torch_neuronx.FakeNeuronRuleError as error:
    numpy_refused = str(error)
host = torch.zeros(4, 8)
ops = (lambda: host.fill_(1), lambda: host.t().copy_(torch.ones(8, 4)), lambda: host[torch.tensor([0])])
tag("host ops", lambda: [op() for op in ops])
tag("to_host copy", lambda: device.to_host(kv).fill_(1))
array = np.zeros(4, dtype=np.float32)
first = torch.from_numpy(array)
torch_neuronx.eager.storages.add([first])
tag("same address, another storage", lambda: torch.from_numpy(array).fill_(1))
held = torch_neuronx.eager.storages.holds(first)
# Rule (m): a started read holds its data once an event recorded after it is waited on.
started = device.start_read(out)
arrived_early = not started.isnan().all()
fence = device.ReadFence()
later = device.start_read(kv)  # after the fence: not its read
synchronized = waits()
fence.wait()
reads = {
    "arrived_early": arrived_early,
    "arrived": torch.equal(started, out),
    "later_arrived": not later.isnan().all(),
    "fence_synchronized": waits() - synchronized,
    "event_waits": facts["event_waits"],
    "reads_started": facts["reads_started"],
}
result = {"seen": seen, "first_held": held, "numpy_refused": numpy_refused, "kv_kept": bool((kv != 7).all())}
result["reads"] = {key: value if isinstance(value, dict) else bool(value) for key, value in reads.items()}
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_NEURON), os.environ.get("PYTHONPATH", "")]))
    env |= {"VLLM_NEURON_DEVICE": "neuron", "FAKE_NEURON_RECORD": ""}
    env["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(tmp_path_factory.mktemp("neff"))
    command = [sys.executable, "-c", SCRIPT]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["first_held"]
    # numpy() of a device tensor raises on Trainium; a cpu() copy written on the host leaves the device's.
    assert "numpy() of a device tensor" in result["numpy_refused"] and result["kv_kept"]
    return result["seen"] | {"rule m": result["reads"]}


def kernels(seen: dict, name: str) -> list[tuple]:
    return [(k["op"], k["shapes"], k["static"]) for k in seen[name]["eager_kernels"]]


def test_ops_in_a_graph_and_on_host_tensors_are_not_eager_device_ops(seen):
    """The graph's own writes (its in-place input included), host tensors, a view, to_host's copy, and a host
    tensor at a device storage's address: nothing recorded."""
    quiet = ("graph", "view", "host ops", "same address, another storage", "host scalars")
    for name in quiet:
        assert seen[name] == {"eager_kernels": [], "host_round_trips": [], "host_reads": []}, name


def test_rule_k_an_eager_op_on_a_device_tensor_compiles_a_kernel_per_new_shape(seen):
    assert kernels(seen, "reset slot") == [("__setitem__", [[1, 4, 8]], None)]
    assert kernels(seen, "reset slot again") == []  # the same shape: the kernel is cached
    assert kernels(seen, "device copy") == [("copy_", [[4, 8], [4, 8]], None)]
    assert kernels(seen, "zero") == [("zero_", [[4, 8]], None)]
    # A fill's scalar is a static argument of its kernel: a new value is a new kernel.
    assert kernels(seen, "fill") == [("fill_", [[4, 8]], [2.0])]
    assert kernels(seen, "fill again") == []
    assert kernels(seen, "fill another value") == [("fill_", [[4, 8]], [3.0])]
    assert kernels(seen, "index") == [("index", [[4, 8], [2]], None)]
    assert kernels(seen, "index_put") == [("index_put_", [[4, 8], [1]], None)]
    assert all(entry["thread"] == "MainThread" for entry in seen["zero"]["eager_kernels"])


def test_a_host_copy_into_a_contiguous_device_slot_is_a_plain_write(seen):
    """A slot of a stacked tensor is contiguous at a storage offset: a runtime write (rule (i)), no kernel."""
    assert seen["whole slot write"] == {"eager_kernels": [], "host_round_trips": [], "host_reads": []}


def test_rule_l_a_gapped_write_copies_the_whole_storage_through_the_host(seen):
    [trip] = seen["gapped slot write"]["host_round_trips"]
    where = (trip["op"], trip["shape"], trip["stride"], trip["storage_offset"])
    assert where == ("copy_", [4, 3], [8, 1], 32)
    assert trip["bytes"] == 2 * 4 * 8 * 4  # the whole stacked tensor, not the slot
    # The transpose to the view's stride order compiles and runs before the device copy fails.
    assert kernels(seen, "gapped slot write") == [("noncontiguous_copy_transpose", [[4, 3]], [[0, 1]])]


def test_rule_l_a_permutation_of_the_whole_storage_is_a_compiled_transpose(seen):
    assert seen["permuted write"]["host_round_trips"] == []
    assert kernels(seen, "permuted write") == [("noncontiguous_copy_transpose", [[8, 4]], [[1, 0]])]


def test_a_device_tensor_copied_into_a_host_one_is_a_read(seen):
    [read] = seen["read to host"]["host_reads"]
    assert (read["op"], read["shape"], read["bytes"]) == ("copy_", [4, 8], 4 * 8 * 4)
    assert seen["read to host"]["synchronize"] == 1  # blocking: the stream must be idle first
    [read] = seen["read to host, non-blocking"]["host_reads"]
    assert read["op"] == "copy_" and "synchronize" not in seen["read to host, non-blocking"]


def test_scalars_lists_and_cpu_copies_of_a_device_tensor_are_blocking_reads(seen):
    """item(), bool/int/float, tolist() and cpu() each copy to the host and wait for the stream."""
    expected = {
        "item": [("item", [])],
        "tolist": [("tolist", [4, 8])],
        "bool": [("__bool__", [])],
        "int and float": [("__int__", []), ("__float__", [])],
        "cpu copy": [("cpu", [4, 8])],
    }
    for name, reads in expected.items():
        assert [(read["op"], read["shape"]) for read in seen[name]["host_reads"]] == reads, name
        assert seen[name]["synchronize"] == len(reads), name
        assert seen[name]["eager_kernels"] == seen[name]["host_round_trips"] == [], name


def test_rule_m_a_blocking_read_waits_for_the_stream_and_a_started_one_for_its_event(seen):
    """to_host waits until the stream is idle (a synchronize); start_read does not wait, and its host tensor
    holds the data only once an event recorded after the read is synchronized, which waits for nothing."""
    assert seen["to_host copy"] == {
        "eager_kernels": [],
        "host_round_trips": [],
        "host_reads": [],
        "synchronize": 1,
    }
    reads = seen["rule m"]
    assert not reads["arrived_early"] and reads["arrived"] and not reads["later_arrived"]
    assert reads["fence_synchronized"] is False and reads["event_waits"] == {"MainThread": 1}
    assert reads["reads_started"] == {"MainThread": 2}
