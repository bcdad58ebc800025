"""An EAGLE3 head's inputs on the host: where each request's target hidden states are kept on the device, and
the arrays each target call gives the head's first pass (worker/spec_decode/eagle3.py).

The head's cache entry at position i is computed from the token at i + 1 and the target's hidden state at i
(vLLM's first pass, its input ids shifted by one). A target call over positions s .. e - 1 knows the tokens
s .. e - 1 and the hidden states s .. e - 1, so it writes the head's entries s - 1 .. e - 2: each token with
the hidden state before it, the first one's from the request's earlier call, kept in the hidden slots. The
entry e - 1 needs the call's sampled token: the propose call after the step writes it (its first pass).

The hidden slots: `(max_num_seqs + 1) x entries` rows of the combined hidden state (the head's `fc` of the
target's aux states), `entries` = 1 + the drafts a verify row checks; a request owns one slot, its rows the
hidden states of its latest call's logits rows (a verify row's every query, a chunk's last token). Slot 0 is
scratch: padding rows write there, and a token whose earlier hidden state is gone (a new request, a prefix
cache hit, a resumed preemption) reads it and writes its entry to the null block: the head's cache then keeps
the entry an earlier request wrote, as vLLM's does.
"""

from dataclasses import dataclass, field

import numpy as np

from kv_cache.layout import NULL_BLOCK
from worker.step.call_inputs import HEAD, Chunk, HostInputs


@dataclass
class HiddenSlots:
    """The hidden slots' owners and contents, on the host; the buffer itself is the compiled model's."""

    max_num_seqs: int
    entries: int  # hidden states a request keeps: 1 + num_speculative_tokens
    block_size: int
    _slots: dict[str, int] = field(default_factory=dict)
    _kept: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (first position, count)

    @property
    def rows(self) -> int:
        return (self.max_num_seqs + 1) * self.entries

    def release(self, req_ids: "set[str] | list[str]") -> None:
        """Finished or preempted requests give their slot back (a resumed one starts without one)."""
        for req_id in req_ids:
            self._slots.pop(req_id, None)
            self._kept.pop(req_id, None)

    def _slot(self, req_id: str, live: list[str]) -> int:
        slot = self._slots.get(req_id)
        if slot is None:
            used = set(self._slots.values())
            free = next((s for s in range(1, self.max_num_seqs + 1) if s not in used), None)
            if free is None:  # a request the batch no longer holds gives its slot up
                self.release([r for r in self._slots if r not in live][:1])
                free = next(s for s in range(1, self.max_num_seqs + 1) if s not in set(self._slots.values()))
            slot = self._slots[req_id] = free
        return slot

    def index(self, req_id: str, position: int) -> int | None:
        """The hidden slots' row of the request's target hidden state at `position` (None: not kept)."""
        kept, slot = self._kept.get(req_id), self._slots.get(req_id)
        if kept is None or slot is None or not 0 <= position - kept[0] < kept[1]:
            return None
        return slot * self.entries + position - kept[0]

    def call_arrays(
        self, host: HostInputs, chunks: list[Chunk], req_ids: list[str], queries: int, live: list[str]
    ) -> dict[str, np.ndarray]:
        """A target call's head arrays (`chunks`, `req_ids`: the call's prefill parts, then its decode rows,
        in the call's order), and the call's logits rows recorded as each request's kept hidden states. The
        calls of a step are planned in the order they run, so a chunk split over two calls finds the first
        call's hidden state."""
        arrays, first, after = _shifted(host, self.block_size, chunks)
        starts = np.flatnonzero(first)
        assert len(starts) == len(chunks) == len(req_ids), (len(starts), len(chunks), len(req_ids))
        slots, hidden = arrays[HEAD + "slot_mapping"], arrays[HEAD + "hidden"]
        hidden[after] += self.rows  # the call's own hidden states come after the slots'
        for token, chunk, req_id in zip(starts, chunks, req_ids, strict=True):
            index = self.index(req_id, chunk.start - 1)
            if index is not None:
                before = chunk.start - 1
                slots[token] = chunk.block_row[before // self.block_size] * self.block_size
                slots[token] += before % self.block_size
                hidden[token] = index
        keep = np.zeros(host.rows, dtype=np.int64)
        for row, (chunk, req_id) in enumerate(zip(chunks, req_ids, strict=True)):
            slot = self._slot(req_id, live)
            keep[row * queries : (row + 1) * queries] = slot * self.entries + np.arange(queries)
            # A verify row's logits rows are its queries; a chunk's or a decode row's, its last token.
            count = len(chunk.token_ids)
            self._kept[req_id] = (chunk.start, count) if queries > 1 else (chunk.start + count - 1, 1)
        arrays[HEAD + "keep"] = keep
        return arrays


def null_arrays(host: HostInputs, block_size: int) -> dict[str, np.ndarray]:
    """Head arrays that write no entry and keep no hidden state (warm-up's synthetic calls)."""
    arrays, _, _ = _shifted(host, block_size)
    arrays[HEAD + "slot_mapping"][:] = NULL_BLOCK * block_size
    arrays[HEAD + "hidden"][:] = 0
    arrays[HEAD + "keep"] = np.zeros(host.rows, dtype=np.int64)
    return arrays


def _shifted(
    host: HostInputs, block_size: int, chunks: list[Chunk] | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The call's positions moved back by one for the head (each clamped to the first key its query may
    see); for `chunks` (the call's, in its order: the table part's, then the paged rows'), the previous
    token's KV slot and index for each token whose previous position is in the call (null slot, index 0
    otherwise), which tokens start a chunk and which continue one."""
    if host.fresh_prefill:
        raise ValueError("an EAGLE3 head runs no fresh prefill call: fresh_prefill_buckets must be []")
    tokens = len(host.positions)
    arrays: dict[str, np.ndarray] = {}
    table_tokens = 0
    if host.table is not None:
        table_tokens = host.table["positions"].shape[-1]
        arrays[HEAD + "table.positions"] = np.maximum(host.table["positions"] - 1, host.table["first_keys"])
    queries = 1
    if host.paged is not None:
        paged_positions = host.paged["positions"]
        queries = paged_positions.shape[1] if paged_positions.ndim == 2 else 1
        arrays[HEAD + "paged.positions"] = np.maximum(paged_positions - 1, 0)
    first = np.zeros(tokens, dtype=bool)
    after = np.zeros(tokens, dtype=bool)
    chunks = chunks or []
    # The table part holds every chunk of a call without pages (prefill, a batch-1 decode), else a mixed
    # call's one chunk.
    in_table = len(chunks) if host.paged is None else int(host.table is not None)
    offset = 0
    for index, chunk in enumerate(chunks):
        if index < in_table:
            begin, offset = offset, offset + len(chunk.token_ids)
        else:
            begin = table_tokens + (index - in_table) * queries
        first[begin] = True
        after[begin + 1 : begin + len(chunk.token_ids)] = True
    head_slots = np.full(tokens, NULL_BLOCK * block_size, dtype=np.int64)
    head_slots[1:][after[1:]] = host.slot_mapping[:-1][after[1:]]
    hidden = np.zeros(tokens, dtype=np.int64)
    hidden[1:][after[1:]] = np.flatnonzero(after[1:])  # the token before: index t - 1 of token t
    arrays[HEAD + "positions"] = np.maximum(host.positions - 1, 0)
    arrays[HEAD + "slot_mapping"] = head_slots
    arrays[HEAD + "hidden"] = hidden
    return arrays, first, after
