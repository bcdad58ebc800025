"""Padded inputs of one compiled call, built on the host: the only place that turns rows into bucket shapes.

Padding conventions: token id 0, position 0, slot 0 (inside the null block), block id 0 (the null block),
LoRA slot 0 (the base model).
A padded prefill query at position 0 attends to one finite key, a padded decode row to no page (zeros), so no
row produces NaN; their logits are dropped. A padding decode page starts past every position: no key of it
is visible.

A call's host arrays cross in one transfer: packed into one byte buffer on the host, written into a device
buffer that lives as long as the worker, and handed to the graph as views of it (each a dense run of the
buffer: no copy, no kernel). TorchNeuron makes each host-to-device copy that creates a tensor an allocation
(copy_cpu_to_neuron, python_ops/cast_policy.py) and a runtime transfer of its own, and a blocking one (of
more than one element) synchronizes the stream, waiting for every graph already submitted
(csrc/utils/CopyUtils.cpp); a call has about ten arrays. A device buffer serves every call of one layout
(one bucket's arrays) sent from one thread. Threads have buffers of their own: the device's one stream
(every thread's default, csrc NeuronStream.cpp) runs a thread's transfers and calls in the order that thread
submitted them, so a call always reads its own inputs, while another thread's transfer could land between a
call's and its run.
"""

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_cache.layout import NULL_BLOCK, slot_mapping
from vllm_neuron import device as neuron_device
from vllm_neuron import sampling
from vllm_neuron.attention_backend import NeuronAttentionMetadata, PageQueries, TableQueries
from vllm_neuron.buckets import PACKED_CHUNKS, ceil_div

# The prefix of an EAGLE3 head's arrays among a call's inputs (worker/spec_decode/head_inputs.py).
HEAD = "head."

# First position of a padding decode page: past any context (and within int32, for device index types).
PADDING_PAGE_START = 2**30


@dataclass
class Chunk:
    """Consecutive tokens of one request to run in one call: tokens at positions start .. start+len-1."""

    token_ids: np.ndarray
    start: int
    block_row: np.ndarray  # the request's block ids (zeros past its allocation)
    lora_slot: int = 0  # the request's adapter slot: 0 the base model, k vLLM's LoRA slot k - 1


@dataclass
class CallInputs:
    """A call's inputs on the device (views of one transfer, `StagingBuffers`)."""

    input_ids: torch.Tensor  # [tokens], as built on the host (see token_feed)
    positions: torch.Tensor  # [tokens]
    logits_indices: torch.Tensor  # [rows whose logits we keep]
    metadata: NeuronAttentionMetadata
    sampling_rows: torch.Tensor  # [rows, sampling.PARAMS]: each logits row's sampling row
    # Where each token's id is, in the compiled model's token slots (0: it is input_ids'), and where each
    # logits row's sampled token goes (0: the null slot): worker/step/step_state.py.
    token_feed: torch.Tensor  # [tokens]
    token_keep: torch.Tensor  # [rows]
    # Each token's and each logits row's LoRA slot (vllm_neuron/lora/punica.py); None without --enable-lora.
    lora_slots: torch.Tensor | None = None  # [tokens]
    lora_rows: torch.Tensor | None = None  # [rows]
    # An EAGLE3 head's inputs (HEAD names, worker/spec_decode/head_inputs.py).
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class HostInputs:
    """A call's padded inputs as built on the host, packed for one transfer by `pack`."""

    input_ids: np.ndarray
    positions: np.ndarray
    logits_indices: np.ndarray
    slot_mapping: np.ndarray
    table: dict[str, np.ndarray] | None  # the fields of its TableQueries
    paged: dict[str, np.ndarray] | None  # the fields of its PageQueries
    num_real_rows: int  # the first logits rows, those of real requests
    decode_token_index: np.ndarray  # where each decode row's token is in input_ids, in row order
    lora_slots: np.ndarray  # each token's LoRA slot, aligned with input_ids (padding: 0, the base)
    fresh_prefill: bool = False  # NeuronAttentionMetadata.fresh_prefill

    @property
    def rows(self) -> int:
        """Logits rows: each gets a row of sampling parameters and a sampled token."""
        return len(self.logits_indices)

    @property
    def lora_rows(self) -> np.ndarray:
        """Each logits row's LoRA slot: its token's (a padding row repeats row 0's token, harmlessly)."""
        return self.lora_slots[self.logits_indices]

    def arrays(
        self,
        sampling_rows: np.ndarray | None = None,
        token_feed: np.ndarray | None = None,
        token_keep: np.ndarray | None = None,
        lora: bool = False,
        extra: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """The call's arrays by name, with each logits row's sampling row (default: greedy), where tokens
        come from and go to in the token slots (default: nowhere), with `lora` the LoRA slots of the tokens
        and the logits rows, and `extra` arrays (an EAGLE3 head's, worker/spec_decode/head_inputs.py)."""
        if sampling_rows is None:
            sampling_rows = np.zeros((self.rows, sampling.PARAMS), np.float32)
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "logits_indices": self.logits_indices,
            "sampling_rows": sampling_rows,
            "token_feed": np.zeros(len(self.input_ids), np.int64) if token_feed is None else token_feed,
            "token_keep": np.zeros(self.rows, np.int64) if token_keep is None else token_keep,
            "slot_mapping": self.slot_mapping,
            **{f"table.{name}": array for name, array in (self.table or {}).items()},
            **{f"paged.{name}": array for name, array in (self.paged or {}).items()},
            **({"lora_slots": self.lora_slots, "lora_rows": self.lora_rows} if lora else {}),
            **(extra or {}),
        }

    def pack(self, *args, **kwargs) -> "Packed":
        """`arrays` (same arguments) packed for one transfer."""
        return pack(self.arrays(*args, **kwargs))

    def send(
        self, staging: "StagingBuffers", packed: "Packed | None" = None, lora: bool = False
    ) -> CallInputs:
        """On the device, in one transfer from this thread into its staging buffer for the call's layout:
        `packed` (this call's, packed earlier), or greedy, its tokens all its own (warm-up's synthetic calls,
        the draft model's calls)."""
        return self.inputs_from(staging.send(packed if packed is not None else self.pack(lora=lora)))

    def inputs_from(self, sent: dict[str, torch.Tensor]) -> CallInputs:
        """The call's inputs from its arrays on the device (`arrays`' names; an EAGLE3 head's go to
        `extra`)."""
        sent = dict(sent)
        extra = {name: sent.pop(name) for name in list(sent) if name.startswith(HEAD)}
        table = {name: sent.pop(f"table.{name}") for name in self.table or ()}
        paged = {name: sent.pop(f"paged.{name}") for name in self.paged or ()}
        metadata = NeuronAttentionMetadata(
            slot_mapping=sent.pop("slot_mapping"),
            table=TableQueries(**table) if self.table is not None else None,
            paged=PageQueries(**paged) if self.paged is not None else None,
            fresh_prefill=self.fresh_prefill,
        )
        return CallInputs(metadata=metadata, extra=extra, **sent)


@dataclass
class _HostPart:
    """Host arrays of the table or the paged queries of a call, before they are joined and sent."""

    input_ids: np.ndarray
    positions: np.ndarray
    kv_slots: np.ndarray  # each token's place in the KV cache (vLLM's slot mapping)
    logits_indices: np.ndarray  # within the part; its real rows first
    num_real_rows: int
    tables: dict[str, np.ndarray]  # the fields of its TableQueries / PageQueries
    lora_slots: np.ndarray  # each token's LoRA slot
    queries: int = 1  # query positions a row has (a verify call's rows: its last token and its drafts)


def _context_blocks(block_row: np.ndarray, num_blocks: int) -> np.ndarray:
    """The first num_blocks block ids of a row, zero-padded when the context bucket is wider than the row."""
    out = np.full(num_blocks, NULL_BLOCK, dtype=np.int64)
    width = min(num_blocks, block_row.shape[0])
    out[:width] = block_row[:width]
    return out


def _table_part(
    chunks: list[Chunk], token_bucket: int, context_bucket: int, block_size: int, logits_rows: int
) -> _HostPart:
    """Chunks of one or more requests packed in one row of token_bucket queries over a block table of
    context_bucket positions. Each chunk's context (its cached prefix and itself) is a segment of whole
    blocks, in chunk order, and its queries see only that segment, causally. Keeps each chunk's last real
    token's logits, in `logits_rows` rows (padding rows repeat row 0)."""
    if len(chunks) > logits_rows:
        raise ValueError(f"{len(chunks)} chunks in one call, which keeps {logits_rows} logits rows")
    num_blocks = context_bucket // block_size
    input_ids = np.zeros(token_bucket, dtype=np.int64)
    positions = np.zeros(token_bucket, dtype=np.int64)
    key_positions = np.zeros(token_bucket, dtype=np.int64)
    first_keys = np.zeros(token_bucket, dtype=np.int64)
    kv_slots = np.full(token_bucket, NULL_BLOCK * block_size, dtype=np.int64)
    block_table = np.full(num_blocks, NULL_BLOCK, dtype=np.int64)
    logits_indices = np.zeros(logits_rows, dtype=np.int64)
    lora_slots = np.zeros(token_bucket, dtype=np.int64)
    tokens_used = blocks_used = 0
    for index, chunk in enumerate(chunks):
        count = len(chunk.token_ids)
        end = chunk.start + count
        blocks = ceil_div(end, block_size)
        if tokens_used + count > token_bucket or blocks_used + blocks > num_blocks:
            raise ValueError(
                f"{count} tokens at position {chunk.start} do not fit a context bucket of {context_bucket} "
                f"and {token_bucket} tokens beside {tokens_used} tokens in {blocks_used} blocks"
            )
        tokens = slice(tokens_used, tokens_used + count)
        segment = block_table[blocks_used : blocks_used + blocks]
        segment[:] = _context_blocks(chunk.block_row, blocks)
        input_ids[tokens] = chunk.token_ids
        lora_slots[tokens] = chunk.lora_slot
        positions[tokens] = np.arange(chunk.start, end)
        kv_slots[tokens] = slot_mapping(segment, positions[tokens], block_size)
        first_keys[tokens] = blocks_used * block_size
        key_positions[tokens] = first_keys[tokens] + positions[tokens]
        logits_indices[index] = tokens_used + count - 1
        tokens_used, blocks_used = tokens_used + count, blocks_used + blocks
    return _HostPart(
        input_ids,
        positions,
        kv_slots,
        logits_indices,
        len(chunks),
        {
            "positions": key_positions.reshape(1, token_bucket),
            "first_keys": first_keys.reshape(1, token_bucket),
            "block_table": block_table.reshape(1, num_blocks),
        },
        lora_slots,
    )


def _paged_part(
    chunks: list[Chunk],
    batch_bucket: int,
    num_pages: int,
    page_tokens: int,
    block_size: int,
    queries: int = 1,
) -> _HostPart:
    """Rows of up to `queries` consecutive tokens of one request (decode: one) over `num_pages` KV pages the
    rows share, each row as many as its context needs (in row order). A row's unused query positions repeat
    its last position and write to the null block."""
    blocks_per_page = page_tokens // block_size
    rows = len(chunks)
    starts = np.fromiter((chunk.start for chunk in chunks), dtype=np.int64, count=rows)
    counts = np.fromiter((len(chunk.token_ids) for chunk in chunks), dtype=np.int64, count=rows)
    if rows and int(counts.max()) > queries:
        raise ValueError(f"a row of {int(counts.max())} tokens in a call of {queries} queries a row")
    last = starts + counts - 1
    row_pages = (last + page_tokens) // page_tokens  # ceil((last + 1) / page_tokens)
    if int(row_pages.sum()) > num_pages:
        raise ValueError(f"decode rows need {int(row_pages.sum())} KV pages, the call has {num_pages}")
    # Every row's blocks as far as its last page reaches, zero-padded (vectorised: this runs every step).
    width = max((int(row_pages.max()) if rows else 0) * blocks_per_page, 1)
    block_rows = np.full((rows, width), NULL_BLOCK, dtype=np.int64)
    for row, chunk in enumerate(chunks):
        reach = min(width, chunk.block_row.shape[0])
        block_rows[row, :reach] = chunk.block_row[:reach]

    input_ids = np.zeros((batch_bucket, queries), dtype=np.int64)
    positions = np.zeros((batch_bucket, queries), dtype=np.int64)
    kv_slots = np.full((batch_bucket, queries), NULL_BLOCK * block_size, dtype=np.int64)
    if queries == 1:
        input_ids[:rows, 0] = [chunk.token_ids[0] for chunk in chunks]
    else:
        for row, chunk in enumerate(chunks):
            input_ids[row, : counts[row]] = chunk.token_ids
    offsets = np.arange(queries, dtype=np.int64)
    real = offsets < counts[:, None]  # [rows, queries]
    positions[:rows] = np.minimum(starts[:, None] + offsets, last[:, None])
    row_index = np.broadcast_to(np.arange(rows)[:, None], real.shape)
    written = (
        block_rows[row_index, positions[:rows] // block_size] * block_size + positions[:rows] % block_size
    )
    kv_slots[:rows] = np.where(real, written, NULL_BLOCK * block_size)
    # Every query slot of a row takes the row's adapter (its unused ones' logits are dropped anyway).
    lora_slots = np.zeros((batch_bucket, queries), dtype=np.int64)
    lora_slots[:rows] = np.fromiter((chunk.lora_slot for chunk in chunks), dtype=np.int64, count=rows)[
        :, None
    ]

    # The pages in row order: page p of row r holds the row's blocks p*blocks_per_page onwards.
    used = int(row_pages.sum())
    page_row = np.repeat(np.arange(rows, dtype=np.int64), row_pages)
    page_of_row = np.arange(used, dtype=np.int64) - np.repeat(np.cumsum(row_pages) - row_pages, row_pages)
    page_blocks = np.full((num_pages, blocks_per_page), NULL_BLOCK, dtype=np.int64)
    page_rows = np.zeros(num_pages, dtype=np.int64)
    page_starts = np.full(num_pages, PADDING_PAGE_START, dtype=np.int64)
    block_columns = page_of_row[:, None] * blocks_per_page + np.arange(blocks_per_page)
    page_blocks[:used] = block_rows[page_row[:, None], block_columns]
    page_rows[:used] = page_row
    page_starts[:used] = page_of_row * page_tokens
    return _HostPart(
        input_ids.reshape(-1),
        positions.reshape(-1),
        kv_slots.reshape(-1),
        np.arange(batch_bucket * queries, dtype=np.int64),
        len(chunks),
        {
            # [rows] for one query a row (decode's graphs as they were), [rows, queries] for a verify call
            "positions": positions if queries > 1 else positions.reshape(-1),
            "page_blocks": page_blocks,
            "page_rows": page_rows,
            "page_starts": page_starts,
        },
        lora_slots.reshape(-1),
        queries,
    )


def decode_inputs(
    chunks: list[Chunk],
    *,
    batch_bucket: int,
    num_pages: int,
    page_tokens: int,
    block_size: int,
) -> HostInputs:
    """One token per request: rows = batch bucket, one query per row, over `num_pages` KV pages of
    `page_tokens` positions that the rows share, each row as many as its context needs (in row order).

    A batch bucket of one shares nothing: its row attends over its own first num_pages pages of blocks as a
    block table, through the fused kernel the prefill path uses (fewer, larger ops for the same work)."""
    if batch_bucket == 1:
        (chunk,) = chunks
        table = _table_part([chunk], 1, num_pages * page_tokens, block_size, 1)
        return _host_inputs(table=table, decode_at=0)
    paged = _paged_part(chunks, batch_bucket, num_pages, page_tokens, block_size)
    return _host_inputs(paged=paged, decode_at=0)


def verify_inputs(
    chunks: list[Chunk],
    *,
    batch_bucket: int,
    queries: int,
    num_pages: int,
    page_tokens: int,
    block_size: int,
) -> HostInputs:
    """Speculative decoding's verify call: each row its last token and its draft tokens (`queries` positions a
    row, unused ones padding), over shared KV pages as in a decode call. Keeps every query's logits, row by
    row: logits row r * queries + j is query j of row r."""
    paged = _paged_part(chunks, batch_bucket, num_pages, page_tokens, block_size, queries)
    return _host_inputs(paged=paged, decode_at=0)


def prefill_inputs(
    chunks: list[Chunk], *, token_bucket: int, context_bucket: int, block_size: int
) -> HostInputs:
    """The chunks of up to PACKED_CHUNKS requests packed in one row of token_bucket queries, each over its
    own segment of the context bucket; keeps each chunk's last real token's logits. Every prefill call keeps
    PACKED_CHUNKS logits rows, so packing changes no shape. A context bucket of 0 is a fresh prefill call:
    one chunk at position 0, over its own keys."""
    if not context_bucket:
        return _fresh_inputs(chunks, token_bucket, block_size)
    return _host_inputs(table=_table_part(chunks, token_bucket, context_bucket, block_size, PACKED_CHUNKS))


def _fresh_inputs(chunks: list[Chunk], token_bucket: int, block_size: int) -> HostInputs:
    """One request's first chunk, its tokens first and padding after (a causal query never sees a later
    key, so the padding needs no mask), and no table: attention reads the chunk's own keys."""
    (chunk,) = chunks
    if chunk.start:
        raise ValueError(f"a fresh prefill call starts at position 0, not {chunk.start}")
    count = len(chunk.token_ids)
    input_ids = np.zeros(token_bucket, dtype=np.int64)
    positions = np.zeros(token_bucket, dtype=np.int64)
    kv_slots = np.full(token_bucket, NULL_BLOCK * block_size, dtype=np.int64)
    input_ids[:count] = chunk.token_ids
    lora_slots = np.zeros(token_bucket, dtype=np.int64)
    lora_slots[:count] = chunk.lora_slot
    positions[:count] = np.arange(count)
    blocks = _context_blocks(chunk.block_row, ceil_div(count, block_size))
    kv_slots[:count] = slot_mapping(blocks, positions[:count], block_size)
    logits_indices = np.zeros(PACKED_CHUNKS, dtype=np.int64)
    logits_indices[0] = count - 1
    part = _HostPart(input_ids, positions, kv_slots, logits_indices, 1, {}, lora_slots)
    return _host_inputs(table=part, fresh_prefill=True)


def mixed_inputs(
    chunk: Chunk,
    decode_chunks: list[Chunk],
    *,
    token_bucket: int,
    context_bucket: int,
    batch_bucket: int,
    num_pages: int,
    page_tokens: int,
    block_size: int,
) -> HostInputs:
    """A prefill chunk and decode rows in one call (one pass over the weights): the chunk's token_bucket
    queries first, then one per decode row over shared pages. Logits row 0 is the chunk's, rows 1.. the
    decode rows'."""
    return _host_inputs(
        table=_table_part([chunk], token_bucket, context_bucket, block_size, 1),
        paged=_paged_part(decode_chunks, batch_bucket, num_pages, page_tokens, block_size),
        decode_at=token_bucket,
    )


def _host_inputs(
    table: _HostPart | None = None,
    paged: _HostPart | None = None,
    decode_at: int | None = None,
    fresh_prefill: bool = False,
) -> HostInputs:
    """The parts joined; `decode_at`: where the decode rows' tokens start in input_ids (the paged part's, or
    a batch-1 decode call's one token), None in a prefill call; `fresh_prefill`: the table part is a fresh
    chunk's, without tables."""
    parts = [part for part in (table, paged) if part is not None]
    logits_indices, offset = [], 0
    for part in parts:
        logits_indices.append(part.logits_indices + offset)
        offset += len(part.input_ids)
    decode_part = paged or table
    return HostInputs(
        input_ids=np.concatenate([part.input_ids for part in parts]),
        positions=np.concatenate([part.positions for part in parts]),
        logits_indices=np.concatenate(logits_indices),
        slot_mapping=np.concatenate([part.kv_slots for part in parts]),
        table=None if table is None or fresh_prefill else table.tables,
        paged=None if paged is None else paged.tables,
        # A mixed call's table part has one chunk, one logits row: the real rows of both parts come first.
        num_real_rows=sum(part.num_real_rows for part in parts),
        decode_token_index=np.arange(0 if decode_at is None else decode_part.num_real_rows, dtype=np.int64)
        * decode_part.queries
        + (decode_at or 0),
        lora_slots=np.concatenate([part.lora_slots for part in parts]),
        fresh_prefill=fresh_prefill,
    )


# ---- one transfer per call ----------------------------------------------------------------------------

# Every array starts at a multiple of this many bytes: the widest element (int64), so that each byte range
# may be viewed as its own dtype.
ALIGN = 8

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}

Layout = tuple[tuple[int, np.dtype, tuple[int, ...]], ...]  # each array's byte offset, dtype and shape


@dataclass
class Packed:
    """A call's arrays packed into one host buffer, their names, and where each lies in it."""

    buffer: np.ndarray  # uint8
    names: tuple[str, ...]
    layout: Layout


def pack(arrays: dict[str, np.ndarray]) -> Packed:
    """The arrays in one host buffer, each at an ALIGN-ed offset."""
    layout, total = [], 0
    for array in arrays.values():
        if array.dtype not in _TORCH_DTYPES:
            raise TypeError(f"a call input of dtype {array.dtype}: only {list(_TORCH_DTYPES)} are packed")
        layout.append((total, array.dtype, array.shape))
        total += -(-array.nbytes // ALIGN) * ALIGN
    buffer = np.zeros(total, dtype=np.uint8)
    for array, (offset, _, _) in zip(arrays.values(), layout, strict=True):
        buffer[offset : offset + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
    return Packed(buffer, tuple(arrays), tuple(layout))


class StagingBuffers:
    """The worker's device buffers for call inputs: one per layout and sending thread, made at its first call
    (warm-up runs every bucket) and written in place by each later one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, Layout | int], torch.Tensor] = {}
        self._lock = threading.Lock()  # the device thread and a background compile may add buffers at once

    def send(self, packed: Packed) -> dict[str, torch.Tensor]:
        """The packed arrays on the device, by name, in one transfer that does not wait for the device: each
        a view of this thread's buffer for the layout, with its dtype and shape."""
        staging = self.send_bytes(packed.buffer, packed.layout)
        return {
            name: staging[offset : offset + int(np.prod(shape)) * dtype.itemsize]
            .view(_TORCH_DTYPES[dtype])
            .view(shape)
            for name, (offset, dtype, shape) in zip(packed.names, packed.layout, strict=True)
        }

    def send_bytes(self, buffer: np.ndarray, layout: Layout | None = None) -> torch.Tensor:
        """A host byte buffer (any dtype, viewed as bytes) on the device, in one transfer that does not wait
        for the device, into this thread's buffer for `layout` (default: the buffer's size)."""
        key = (threading.current_thread().name, layout or buffer.nbytes)
        staging = self._buffers.get(key)
        if staging is None:
            with self._lock:
                staging = self._buffers.setdefault(
                    key, torch.empty(buffer.nbytes, dtype=torch.uint8, device=self.device)
                )
        neuron_device.copy_to_device(staging, torch.from_numpy(buffer.view(np.uint8)))
        return staging

    @property
    def nbytes(self) -> int:
        """Device bytes the buffers hold."""
        return sum(buffer.numel() for buffer in self._buffers.values())
