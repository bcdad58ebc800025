"""NIXL's block copies as compiled graphs (worker/kv/nixl_blocks.py): each moves whole blocks between the
head-major caches and NIXL's block-major host buffers exactly as indexing the views would, for any block
count (padded to a bucket, or split past the largest), compiles only at warm-up, and touches the caches only
inside its graphs. For a float32 cache and an FP8 one (`--kv-cache-dtype fp8`: uint8 e4m3 bits,
kv_cache/fp8.py), whose every byte value, NaN and -0 bits included, must move unchanged. An FP8 cache's
per-layer scales are not moved: they are the model's (1.0, or the checkpoint's), and NIXL pairs only
servers of the same model and cache dtype (vLLM's compute_nixl_compatibility_hash)."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from kv_cache import layout
from vllm_neuron.compiler.compile import CompileRecorder
from vllm_neuron.graph_plan import copy_buckets, max_copy_blocks
from worker.kv.nixl_blocks import BlockCopier

BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE = 12, 4, 2, 3
LAYERS = ("layers.0", "layers.1", "layers.2")
MAX_BLOCKS = 4  # buckets 1, 2, 4


class Caches(SimpleNamespace):
    """What the copier reads of worker.kv.kv_caches.KVCaches."""

    def by_layer(self) -> dict[str, torch.Tensor]:
        return self.tensors


# The cache dtypes: vLLM allocates `--kv-cache-dtype fp8` as uint8 (STR_DTYPE_TO_TORCH_DTYPE).
@pytest.fixture(scope="module", params=[torch.float32, torch.uint8], ids=["float32", "fp8"])
def copier(request):
    recorder = CompileRecorder("xla", strict=True)
    tensors = {
        name: layout.allocate(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, request.param, None, recorder.zeros)
        for name in LAYERS
    }
    caches = Caches(tensors=tensors, device=torch.device("cpu"))
    copier = BlockCopier(caches, recorder, "xla", blocks_per_request=8, max_blocks=MAX_BLOCKS)
    assert copier.warm_up() == 2 * len(copy_buckets(MAX_BLOCKS)) == recorder.num_graphs
    recorder.armed = True  # strict: any later compile raises
    return copier


def random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random values; for FP8 bits every byte value, each as often (e4m3's NaNs 0x7f and 0xff, -0 0x80)."""
    if dtype == torch.uint8:
        return (torch.randperm(math.prod(shape), generator=generator) % 256).to(dtype).view(shape)
    return torch.randn(shape, generator=generator, dtype=dtype)


def fill(copier: BlockCopier, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    for cache in copier.caches.by_layer().values():
        cache.copy_(random(cache.shape, copier.dtype, generator))
    return {name: cache.clone() for name, cache in copier.caches.by_layer().items()}


def host_buffers(copier: BlockCopier, seed: int) -> dict[str, torch.Tensor]:
    """NIXL's host buffers: each layer's block-major view's shape and the cache's dtype, contiguous (vLLM's
    initialize_host_xfer_buffer)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, 2 * KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    return {name: random(shape, copier.dtype, generator) for name in LAYERS}


def test_buckets_are_powers_of_two_up_to_a_requests_blocks_within_the_byte_budget():
    assert copy_buckets(8) == [1, 2, 4, 8]
    assert copy_buckets(6) == [1, 2, 4, 6]
    assert copy_buckets(1) == [1]
    assert max_copy_blocks(64, 1024) == 64
    assert max_copy_blocks(64, 16 << 20) == 16  # 256 MiB at most per copy
    assert max_copy_blocks(64, 1 << 30) == 1


def test_each_copy_graph_is_labelled_and_counts_only_its_own_inputs_and_outputs(copier):
    """Named as a model call's graph is: what it does, its blocks and bucket; the caches it reads or writes
    are the worker's, not a copy's inputs (the graph reserve counts a call's own)."""
    page = copier.block_bytes  # every layer's page of one block
    lowered = [graph.summary() for graph in copier.recorder.lowering.graphs]
    assert [(graph["call"], graph["input_bytes"], graph["output_bytes"]) for graph in lowered] == [
        entry
        for bucket in copy_buckets(MAX_BLOCKS)
        for entry in (
            (f"NIXL gather of {bucket} blocks: bucket {bucket}", bucket * 8, bucket * page),
            (f"NIXL scatter of {bucket} blocks: bucket {bucket}", bucket * (8 + page), 0),
        )
    ]


@pytest.mark.parametrize("count", [1, 3, 4, 7, 9])  # a bucket, padded, the largest, split, split and padded
def test_save_copies_blocks_to_the_host_buffers_as_the_views_would(copier, count):
    generator = torch.Generator().manual_seed(count)
    cache_ids = (torch.randperm(BLOCKS - 1, generator=generator)[:count] + 1).tolist()  # never the null block
    host_ids = torch.randperm(BLOCKS, generator=generator)[:count].tolist()
    caches = fill(copier, count)
    host = host_buffers(copier, count)
    expected = {name: buffer.clone() for name, buffer in host.items()}
    for name in LAYERS:
        expected[name][host_ids] = layout.block_major(caches[name])[cache_ids]

    copier({name: layout.block_major(c) for name, c in caches.items()}, host, cache_ids, host_ids, "d2h")
    for name in LAYERS:
        assert host[name].equal(expected[name])
        assert copier.caches.by_layer()[name].equal(caches[name])  # read only


@pytest.mark.parametrize("count", [2, 3, 9])
def test_load_writes_blocks_into_the_caches_in_place_as_the_views_would(copier, count):
    generator = torch.Generator().manual_seed(100 + count)
    host_ids = torch.randperm(BLOCKS, generator=generator)[:count].tolist()
    cache_ids = (torch.randperm(BLOCKS - 1, generator=generator)[:count] + 1).tolist()
    before = fill(copier, 100 + count)
    host = host_buffers(copier, 100 + count)
    expected = {name: cache.clone() for name, cache in before.items()}
    for name in LAYERS:
        layout.block_major(expected[name])[cache_ids] = host[name][host_ids]
        expected[name][:, layout.NULL_BLOCK] = 0  # padding writes zeros there
    caches = copier.caches.by_layer()
    pointers = [cache.data_ptr() for cache in caches.values()]

    copier(host, {name: layout.block_major(c) for name, c in caches.items()}, host_ids, cache_ids, "h2d")
    caches = copier.caches.by_layer()
    assert [cache.data_ptr() for cache in caches.values()] == pointers
    for name in LAYERS:
        real = [block for block in range(BLOCKS) if block != layout.NULL_BLOCK]
        assert caches[name][:, real].equal(expected[name][:, real])
        assert caches[name][:, layout.NULL_BLOCK].isfinite().all()


def test_blocks_saved_then_loaded_elsewhere_arrive_bit_for_bit(copier):
    """A prefill server's save into its host buffer, NIXL's read of those bytes into the decode server's,
    and its load into other blocks (every block but the null one, in three copies): each block's bytes as
    they were (FP8: every byte value among them)."""
    generator = torch.Generator().manual_seed(11)
    saved, loaded = ((torch.randperm(BLOCKS - 1, generator=generator) + 1).tolist() for _ in range(2))
    before = fill(copier, 11)
    views = {name: layout.block_major(cache) for name, cache in copier.caches.by_layer().items()}
    host = host_buffers(copier, 11)
    copier(views, host, saved, list(range(len(saved))), "d2h")
    remote = {name: buffer.clone() for name, buffer in host.items()}  # NIXL moves the buffers' bytes
    copier(remote, views, list(range(len(saved))), loaded, "h2d")
    values = set()
    for name, cache in copier.caches.by_layer().items():
        moved, original = layout.block_major(cache)[loaded], layout.block_major(before[name])[saved]
        assert moved.view(torch.uint8).equal(original.view(torch.uint8))
        values |= set(original.view(torch.uint8).unique().tolist())
    assert copier.dtype != torch.uint8 or len(values) == 256


def test_nothing_to_copy_copies_nothing(copier):
    before = fill(copier, 7)
    copier(host_buffers(copier, 7), dict(before), [], [], "h2d")
    for name, cache in copier.caches.by_layer().items():
        assert cache.equal(before[name])


class CacheOps(TorchDispatchMode):
    """The aten ops that take a cache's memory, outside the copier's compiled graphs."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {cache.untyped_storage().data_ptr() for cache in caches}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(t.untyped_storage().data_ptr() in self.storages for t in tensors):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def outside_the_mode(graph):
    def run(*args):
        with _disable_current_modes():
            return graph(*args)

    return run


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_a_copy_touches_the_caches_only_inside_its_graphs(copier, direction, monkeypatch):
    """No eager index, index_put_ or copy on a cache (on Neuron each would be a kernel compiled per block
    count, or a write of the whole cache through a permuted view)."""
    calls = []
    for name in ("gather", "scatter"):
        graph = outside_the_mode(getattr(copier, name))
        monkeypatch.setattr(
            copier, name, lambda *args, graph=graph, name=name: calls.append(name) or graph(*args)
        )
    caches = copier.caches.by_layer()
    views = {name: layout.block_major(cache) for name, cache in caches.items()}
    host = host_buffers(copier, 3)
    ids = [5, 1, 2, 9, 3, 7]  # two copies: 4 blocks, then 2
    with CacheOps(list(caches.values())) as recorded:
        if direction == "d2h":
            copier(views, host, ids, ids, direction)
        else:
            copier(host, views, ids, ids, direction)
    assert recorded.ops == []
    assert calls == ["gather" if direction == "d2h" else "scatter"] * 2


def test_the_graphs_write_the_caches_in_place_and_meet_neuronx_ccs_rules(copier):
    """As TorchNeuron's aliasing analysis reads them: each load graph updates every cache in place (its
    mhlo.input_output_alias lists them), each save graph writes nothing; and XLA kept the writes in place."""
    graphs = [graph.summary() for graph in copier.recorder.lowering.graphs]
    assert len(graphs) == 2 * len(copier.buckets)
    for save, load in zip(graphs[::2], graphs[1::2], strict=True):
        assert save["aliased_inputs"] == save["written_inputs"] == []
        # (the parameters in dynamo's order, first use first: a cache, the block ids, the pages, the others)
        assert load["aliased_inputs"] == load["written_inputs"] and len(set(load["aliased_inputs"])) == len(
            LAYERS
        )
        assert load["caches_in_place"], load["cache_problems"]
        for graph in (save, load):
            assert graph["neuronx_cc_rules"]["broken"] == []
