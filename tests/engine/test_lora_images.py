"""worker/lora/images.py against vLLM's own in-place slot writes: vLLM's LoRA layers (one slice, two packed
slices, the embedding) at one rank, in a process of their own (the layers need vLLM's parallel groups), on
fake TorchNeuron (tests/fake_neuron), which sees how the writes reach the device."""

import json
import os
import subprocess
import sys
from pathlib import Path

FAKE_NEURON = Path(__file__).parents[1] / "fake_neuron"

SCRIPT = """
import json, socket, torch, torch_neuronx
from vllm.config import LoRAConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.lora.layers import (
    MergedColumnParallelLinearWithLoRA, ReplicatedLinearWithLoRA, VocabParallelEmbeddingWithLoRA,
)
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from worker.lora.images import SlotImages

with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
MAX_RANK, SLOTS = 8, 3
# bfloat16 slots, as a bf16 model's: their images cannot pass through numpy on the way to the device.
config = LoRAConfig(max_lora_rank=MAX_RANK, max_loras=SLOTS, lora_dtype=torch.bfloat16)
f32 = dict(params_dtype=torch.float32)

def build():
    layers = {
        "one": ReplicatedLinearWithLoRA(ReplicatedLinear(8, 6, bias=False, **f32)),
        "packed": MergedColumnParallelLinearWithLoRA(MergedColumnParallelLinear(8, [6, 5], False, **f32)),
        "embedding": VocabParallelEmbeddingWithLoRA(VocabParallelEmbedding(10, 8, **f32)),
    }
    for layer in layers.values():
        layer.create_lora_weights(SLOTS, config)
    return layers

with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1)
    layers, direct = build(), build()
gen = torch.Generator().manual_seed(0)

def randn(*shape):
    return torch.randn(*shape, generator=gen)

def adapter(name, rank):
    if name == "one":
        return randn(rank, 8), randn(6, rank)
    if name == "packed":
        return [randn(rank, 8)] * 2, [randn(6, rank), randn(5, rank)]
    return randn(rank, 10), randn(8, rank)

def stacks(layer):
    held = (layer.lora_a_stacked, layer.lora_b_stacked)
    return [t for stack in held for t in (stack if isinstance(stack, tuple) else (stack,))]

# vLLM's own writes land in `direct`, the images' in `layers`: slot 0 at rank 5, slot 1 at the maximum
# rank then at rank 2, slot 2 at the maximum then reset.
images = SlotImages(layers)
kept = {name: (layer.lora_a_stacked, layer.lora_b_stacked) for name, layer in layers.items()}
facts = torch_neuronx.runtime.facts
# The slots as device tensors (a compiled graph reads them when served): fake rules (k) and (l) watch them.
torch_neuronx.eager.storages.add([t for layer in layers.values() for t in stacks(layer)])
for index, rank in ((0, 5), (1, MAX_RANK), (1, 2), (2, MAX_RANK), (2, None)):
    stand_ins = images.stand_ins()
    for name in layers:
        a, b = adapter(name, rank or 1)
        for target in (direct[name], stand_ins[name]):
            target.reset_lora(index) if rank is None else target.set_lora(index, a, b)
    images.write(index)

def equal(name):
    return all(torch.equal(x, y) for x, y in zip(stacks(layers[name]), stacks(direct[name]), strict=True))

print("RESULT " + json.dumps({
    "equal": {name: equal(name) for name in layers},
    "nonzero": {name: [bool(stacks(layers[name])[0][s].any()) for s in range(SLOTS)] for name in layers},
    "kept": all(kept[name] == (layer.lora_a_stacked, layer.lora_b_stacked) for name, layer in layers.items()),
    "stacked": sum(len(stacks(layer)) for layer in layers.values()),
    "fake": {key: facts[key] for key in ("to_device", "blocking_to_device", "synchronize", "eager_kernels",
                                         "host_round_trips", "host_reads")},
}))
"""


def test_slot_images_write_what_vllms_own_writes_would(tmp_path):
    """Each slot written whole from its image holds exactly what vLLM's in-place writes leave: a lower rank
    over a higher one leaves no stale columns, a reset a zero slot, the other slots untouched, and the layers
    keep their own stacked tensors. Each image reaches the device through the device seam, one transfer per
    stacked tensor that waits for no graph (fake rules (i), (j)), and no eager kernel or round trip through
    the host (rules (k), (l))."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_NEURON), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-c", SCRIPT]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["equal"] == {"one": True, "packed": True, "embedding": True}
    assert result["nonzero"] == {name: [True, True, False] for name in ("one", "packed", "embedding")}
    assert result["kept"]
    fake, writes = result["fake"], 5
    assert fake["to_device"] == {"MainThread": writes * result["stacked"]}
    assert fake["blocking_to_device"] == fake["synchronize"] == {}
    assert fake["eager_kernels"] == fake["host_round_trips"] == fake["host_reads"] == []
