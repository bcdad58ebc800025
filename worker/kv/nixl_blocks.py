"""NIXL's block copies between the KV caches and its host buffers, as compiled graphs of fixed shape.

vLLM's own copy (copy_kv_blocks) indexes each layer's block-major view with index tensors on the device: on
Neuron every aten::index / index_put_ is an eager kernel compiled per input shape (a new compile for each
block count), and the write into the permuted view rewrites the whole cache. Here a copy of n blocks is, per
bucket of n (vllm_neuron/graph_plan.py: copy_buckets), one graph over every layer:
- save (d2h, the prefill server): `GatherPages` takes every cache and the block ids, and returns the blocks'
  block-major pages of every layer as one flat tensor, brought to the host in one transfer and put into the
  host buffers there (host indexing);
- load (h2d, the decode server): the host gathers the pages of every layer into one buffer behind the block
  ids, which crosses to the device in one transfer, and `ScatterPages` writes them into every cache in place
  (an index_copy_ per cache, which TorchNeuron's aliasing analysis sees: the caches are updated inputs).
Padded entries read or write the null block (zeros written). Copies of more blocks than the largest bucket
run as several. Every bucket compiles at start-up through the compile recorder (`warm_up`), so a transfer
never compiles.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from kv_cache.layout import NULL_BLOCK, page_rows, page_table
from vllm_neuron import device as neuron_device
from vllm_neuron.buckets import pick_bucket
from vllm_neuron.compiler import compile as neuron_compile
from vllm_neuron.graph_plan import copy_buckets, max_copy_blocks
from worker.step.call_inputs import StagingBuffers

if TYPE_CHECKING:
    from worker.kv.kv_caches import KVCaches

_INDEX = np.dtype(np.int64)

# Both graphs take the caches as `kv_caches`: the lowering counts what dynamo names l_kv_caches_* as state the
# worker holds, not a copy's own inputs (vllm_neuron/compiler/stablehlo.py: model_state).


class GatherPages(torch.nn.Module):
    """Every cache's pages of block_ids [n], block-major, one layer after another: [sum of n * page]."""

    def forward(self, kv_caches: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [page_table(cache).index_select(0, page_rows(cache, block_ids)).view(-1) for cache in kv_caches]
        )


class ScatterPages(torch.nn.Module):
    """Write `pages` (GatherPages's layout) at block_ids [n] of every cache, in place."""

    def forward(self, kv_caches: list[torch.Tensor], block_ids: torch.Tensor, pages: torch.Tensor) -> None:
        offset = 0
        for cache in kv_caches:
            table = page_table(cache)
            rows = page_rows(cache, block_ids)
            size = rows.shape[0] * table.shape[1]
            table.index_copy_(0, rows, pages[offset : offset + size].view(-1, table.shape[1]))
            offset += size


def copy_label(graph: str, blocks: int, bucket: int) -> str:
    """A copy as its graph's label and a recompile's message name it: as a model call's name does
    (vllm_neuron/calls.py), what it does, its real size and its bucket."""
    return f"NIXL {graph} of {blocks} blocks: bucket {bucket}"


class BlockCopier:
    """vLLM's block-copy operation for a connector that stages KV through host buffers (NIXL:
    set_host_xfer_buffer_ops), over the runner's caches; `max_blocks` (default: a request's blocks, within
    COPY_BYTES) is the largest bucket."""

    def __init__(
        self,
        caches: "KVCaches",
        recorder: neuron_compile.CompileRecorder,
        backend: str,
        blocks_per_request: int,
        max_blocks: int | None = None,
    ) -> None:
        self.caches = caches
        self.recorder = recorder
        self.staging = StagingBuffers(caches.device)  # as a call's inputs: worker/step/call_inputs.py
        tensors = list(caches.by_layer().values())
        dtypes = {cache.dtype for cache in tensors}
        if len(dtypes) != 1:
            raise ValueError(f"NIXL block copies need one KV cache dtype across layers, not {dtypes}")
        self.dtype = dtypes.pop()
        self.page_shapes = [cache[:, 0].shape for cache in tensors]  # a block's page, per layer
        self.block_bytes = sum(shape.numel() for shape in self.page_shapes) * tensors[0].element_size()
        self.buckets = copy_buckets(max_blocks or max_copy_blocks(blocks_per_request, self.block_bytes))
        graphs = len(self.buckets)
        self.gather, _ = neuron_compile.compile_static(GatherPages(), backend, graphs, recorder=recorder)
        self.scatter, _ = neuron_compile.compile_static(ScatterPages(), backend, graphs, recorder=recorder)

    @torch.no_grad()  # the grad mode of warm-up and serving alike: dynamo guards on it
    def warm_up(self) -> int:
        """Compile each bucket's two graphs (null-block copies: zeros written to the null block); returns
        the graphs compiled."""
        before = self.recorder.num_graphs
        for bucket in self.buckets:
            self._gather(np.full(bucket, NULL_BLOCK, dtype=_INDEX), bucket)
            self._scatter(self._load_buffer(bucket), bucket, bucket)
        neuron_device.synchronize()
        return self.recorder.num_graphs - before

    @torch.no_grad()
    def __call__(
        self,
        src: dict[str, torch.Tensor],
        dst: dict[str, torch.Tensor],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        direction: str,
    ) -> None:
        """Copy blocks src_block_ids of each layer in `src` to dst_block_ids in `dst`: "d2h" from the caches
        (`src`: their views, unread) to the host buffers `dst`, "h2d" from the host buffers `src` to the
        caches (`dst`: their views, unwritten). As vLLM's copy_kv_blocks: nothing without blocks."""
        if not src_block_ids or len(src_block_ids) != len(dst_block_ids):
            return
        if direction not in ("d2h", "h2d"):
            raise ValueError(f"block copy direction {direction!r}: d2h or h2d")
        host = dst if direction == "d2h" else src
        buffers = [host[name] for name in self.caches.by_layer()]
        largest = self.buckets[-1]
        for start in range(0, len(src_block_ids), largest):
            sources, targets = src_block_ids[start : start + largest], dst_block_ids[start : start + largest]
            bucket = pick_bucket(self.buckets, len(sources))
            if direction == "d2h":
                self._save(sources, targets, bucket, buffers)
            else:
                self._load(sources, targets, bucket, buffers)

    def _save(
        self, cache_ids: list[int], host_ids: list[int], bucket: int, buffers: list[torch.Tensor]
    ) -> None:
        padded = np.full(bucket, NULL_BLOCK, dtype=_INDEX)
        padded[: len(cache_ids)] = cache_ids
        # The one device-to-host transfer, waited for here (NIXL reads the host buffers once the save
        # returns): for the gather and the work queued before it, not for work queued after it.
        (pages,) = neuron_device.read_now([self._gather(padded, len(cache_ids))])
        rows = torch.tensor(host_ids, dtype=torch.int64)
        for buffer, layer_pages in zip(buffers, self._per_layer(pages, bucket), strict=True):
            buffer.index_copy_(0, rows, layer_pages[: len(host_ids)])

    def _load(
        self, host_ids: list[int], cache_ids: list[int], bucket: int, buffers: list[torch.Tensor]
    ) -> None:
        buffer = self._load_buffer(bucket)
        block_ids, pages = self._split(torch.from_numpy(buffer), bucket)
        block_ids[: len(cache_ids)] = torch.tensor(cache_ids, dtype=torch.int64)
        rows = torch.tensor(host_ids, dtype=torch.int64)
        for host, layer_pages in zip(buffers, self._per_layer(pages, bucket), strict=True):
            torch.index_select(host, 0, rows, out=layer_pages[: len(host_ids)])
        self._scatter(buffer, bucket, len(cache_ids))

    def _gather(self, block_ids: np.ndarray, blocks: int) -> torch.Tensor:
        """Every layer's pages of block_ids (a bucket's worth, `blocks` of them real), on the device: one
        transfer, one graph."""
        self.recorder.thread.call = copy_label("gather", blocks, len(block_ids))
        return self.gather(self._caches(), self.staging.send_bytes(block_ids).view(torch.int64))

    def _scatter(self, buffer: np.ndarray, bucket: int, blocks: int) -> None:
        """Write a `_load_buffer` (`blocks` of its bucket real) into the caches: one transfer, one graph."""
        self.recorder.thread.call = copy_label("scatter", blocks, bucket)
        block_ids, pages = self._split(self.staging.send_bytes(buffer), bucket)
        self.scatter(self._caches(), block_ids, pages)

    def _load_buffer(self, bucket: int) -> np.ndarray:
        """A load's bytes: `bucket` block ids (the null block), then every layer's pages (zeros)."""
        buffer = np.zeros(bucket * (_INDEX.itemsize + self.block_bytes), dtype=np.uint8)
        buffer[: bucket * _INDEX.itemsize].view(_INDEX)[:] = NULL_BLOCK
        return buffer

    def _split(self, buffer: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A load buffer's block ids [bucket] and its pages (flat): views of its bytes, no copy."""
        split = bucket * _INDEX.itemsize
        return buffer[:split].view(torch.int64), buffer[split:].view(self.dtype)

    def _per_layer(self, pages: torch.Tensor, bucket: int) -> Iterator[torch.Tensor]:
        """Each layer's pages in a copy's flat pages: [bucket, 2 * kv_heads, block_size, head_size]."""
        offset = 0
        for shape in self.page_shapes:
            size = bucket * shape.numel()
            yield pages[offset : offset + size].view(bucket, *shape)
            offset += size

    def _caches(self) -> list[torch.Tensor]:
        return list(self.caches.by_layer().values())
