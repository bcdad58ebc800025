"""An EAGLE3 head's host arrays (worker/spec_decode/head_inputs.py): each token's entry one position back, at
that position's KV slot, from the hidden state before it (the call's own, or its request's kept one)."""

import numpy as np
import pytest

from kv_cache.layout import NULL_BLOCK
from worker.spec_decode.head_inputs import HiddenSlots, null_arrays
from worker.step.call_inputs import HEAD, Chunk, mixed_inputs, prefill_inputs, verify_inputs

BLOCK = 4
NULL = NULL_BLOCK * BLOCK


def row(*blocks: int) -> np.ndarray:
    return np.array([*blocks, 0, 0, 0, 0], dtype=np.int64)


def slot(block_row: np.ndarray, position: int) -> int:
    return int(block_row[position // BLOCK] * BLOCK + position % BLOCK)


def test_a_packed_prefill_call_reads_each_tokens_previous_hidden_state():
    slots = HiddenSlots(max_num_seqs=4, entries=3, block_size=BLOCK)
    a, b = row(3, 5, 7), row(9, 2)
    # Request "a" ran positions 0..5 before: its hidden state at 5 is kept; "b" starts at 0.
    first = prefill_inputs([Chunk(np.arange(6), 0, a)], token_bucket=8, context_bucket=16, block_size=BLOCK)
    slots.call_arrays(first, [Chunk(np.arange(6), 0, a)], ["a"], 1, ["a"])
    chunks = [Chunk(np.arange(6, 9), 6, a), Chunk(np.arange(3), 0, b)]
    host = prefill_inputs(chunks, token_bucket=8, context_bucket=16, block_size=BLOCK)
    arrays = slots.call_arrays(host, chunks, ["a", "b"], 1, ["a", "b"])
    kept_a = slots._slots["a"] * 3  # the row of a's hidden state at 5 (its first entry)
    assert arrays[HEAD + "slot_mapping"].tolist() == [
        slot(a, 5), slot(a, 6), slot(a, 7),  # a's entries 5, 6, 7
        NULL, slot(b, 0), slot(b, 1),  # b's entry -1 (none), 0, 1
        NULL, NULL,  # padding
    ]  # fmt: skip
    rows = slots.rows
    assert arrays[HEAD + "hidden"].tolist() == [kept_a, rows + 0, rows + 1, 0, rows + 3, rows + 4, 0, 0]
    assert arrays[HEAD + "positions"].tolist() == [5, 6, 7, 0, 0, 1, 0, 0]
    # Table queries one position back, never before their segment's first key.
    table_positions, first_keys = host.table["positions"], host.table["first_keys"]
    assert (arrays[HEAD + "table.positions"] == np.maximum(table_positions - 1, first_keys)).all()
    # Each chunk's logits row keeps its last token's hidden state: a's at 8, b's at 2.
    assert arrays[HEAD + "keep"].tolist()[:2] == [slots._slots["a"] * 3, slots._slots["b"] * 3]
    assert slots.index("a", 8) == slots._slots["a"] * 3 and slots.index("a", 5) is None
    assert slots.index("b", 2) == slots._slots["b"] * 3


def test_a_verify_row_reads_its_accepted_tokens_hidden_state_and_keeps_each_querys():
    slots = HiddenSlots(max_num_seqs=2, entries=3, block_size=BLOCK)
    a, b = row(3, 5, 7, 9), row(6, 8, 10, 11)
    # Both rows verified queries at 8, 9, 10 last step; a accepted one draft (its newest token at 10, the
    # hidden state before it at 9), b none (newest at 9, hidden state at 8).
    earlier = [Chunk(np.arange(3), 8, a), Chunk(np.arange(3), 8, b)]
    host = verify_inputs(earlier, batch_bucket=2, queries=3, num_pages=4, page_tokens=8, block_size=BLOCK)
    slots.call_arrays(host, earlier, ["a", "b"], 3, ["a", "b"])
    # b verifies one draft of two: its third query is unused.
    chunks = [Chunk(np.arange(3), 10, a), Chunk(np.arange(2), 9, b)]
    host = verify_inputs(chunks, batch_bucket=2, queries=3, num_pages=4, page_tokens=8, block_size=BLOCK)
    arrays = slots.call_arrays(host, chunks, ["a", "b"], 3, ["a", "b"])
    sa, sb, rows = slots._slots["a"] * 3, slots._slots["b"] * 3, slots.rows
    assert arrays[HEAD + "slot_mapping"].tolist() == [
        slot(a, 9), slot(a, 10), slot(a, 11),
        slot(b, 8), slot(b, 9), NULL,
    ]  # fmt: skip
    assert arrays[HEAD + "hidden"].tolist() == [sa + 1, rows + 0, rows + 1, sb + 0, rows + 3, 0]
    assert arrays[HEAD + "paged.positions"].tolist() == [[9, 10, 11], [8, 9, 9]]
    assert arrays[HEAD + "keep"].tolist() == [sa, sa + 1, sa + 2, sb, sb + 1, sb + 2]
    # Each row keeps its real queries' hidden states: a's at 10..12, b's at 9..10.
    assert [slots.index("a", p) for p in (9, 10, 12, 13)] == [None, sa, sa + 2, None]
    assert [slots.index("b", p) for p in (9, 10, 11)] == [sb, sb + 1, None]


def test_a_mixed_call_shifts_its_chunk_and_its_decode_rows():
    slots = HiddenSlots(max_num_seqs=4, entries=1, block_size=BLOCK)
    a, b = row(3, 5), row(6)
    chunk, decode = Chunk(np.arange(4), 0, a), [Chunk(np.array([7]), 2, b)]
    host = mixed_inputs(
        chunk,
        decode,
        token_bucket=4,
        context_bucket=8,
        batch_bucket=2,
        num_pages=2,
        page_tokens=8,
        block_size=BLOCK,
    )
    arrays = slots.call_arrays(host, [chunk, *decode], ["a", "b"], 1, ["a", "b"])
    # b's hidden state at 1 is not kept (a new slot): its entry at 1 is not written.
    assert arrays[HEAD + "slot_mapping"].tolist() == [NULL, slot(a, 0), slot(a, 1), slot(a, 2), NULL, NULL]
    assert arrays[HEAD + "paged.positions"].tolist() == [1, 0]
    assert arrays[HEAD + "keep"].tolist() == [slots._slots["a"], slots._slots["b"], 0]


def test_warm_ups_synthetic_calls_write_no_entry_and_keep_nothing():
    host = prefill_inputs(
        [Chunk(np.arange(5), 3, row(3, 5))], token_bucket=8, context_bucket=16, block_size=4
    )
    arrays = null_arrays(host, BLOCK)
    assert (arrays[HEAD + "slot_mapping"] == NULL).all() and not arrays[HEAD + "hidden"].any()
    assert not arrays[HEAD + "keep"].any()


def test_a_slot_is_freed_by_a_request_that_left():
    slots = HiddenSlots(max_num_seqs=1, entries=1, block_size=BLOCK)
    calls = {}
    for req_id in ("a", "b"):
        chunk = Chunk(np.arange(2), 0, row(3))
        host = prefill_inputs([chunk], token_bucket=4, context_bucket=8, block_size=BLOCK)
        calls[req_id] = slots.call_arrays(host, [chunk], [req_id], 1, [req_id])
    assert slots.index("a", 1) is None and slots.index("b", 1) == 1  # "a" left the batch: "b" took its slot
    slots.release(["b"])
    assert slots.index("b", 1) is None


def test_a_fresh_prefill_call_is_refused():
    host = prefill_inputs([Chunk(np.arange(3), 0, row(3))], token_bucket=4, context_bucket=0, block_size=4)
    with pytest.raises(ValueError, match="fresh_prefill_buckets"):
        null_arrays(host, BLOCK)
