"""A call's inputs cross to the device in one transfer (worker/step/call_inputs.py), and a decode row takes
the previous step's token from the token slots on the device (worker/step/step_state.py)."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.unit.test_sampling import make_rows
from vllm_neuron import sampling
from worker.step import call_inputs, step_state

CPU = torch.device("cpu")


def test_a_calls_arrays_cross_in_one_transfer_as_views_of_one_buffer(monkeypatch):
    from vllm_neuron import device

    transfers = []
    copy = device.copy_to_device
    monkeypatch.setattr(
        device, "copy_to_device", lambda to, array: transfers.append((to, array.nbytes)) or copy(to, array)
    )
    arrays = {
        "a": np.arange(5, dtype=np.int64),
        "b": np.full((3, 6), 0.25, dtype=np.float32),  # 72 bytes: the next array starts 8-aligned
        "c": np.arange(12, dtype=np.int64).reshape(3, 4),
        "d": np.zeros(0, dtype=np.int64),
        "e": np.array([7], dtype=np.int64),
    }
    staging = call_inputs.StagingBuffers(CPU)
    sent = staging.send(call_inputs.pack(arrays))
    assert len(transfers) == 1 and list(sent) == list(arrays)
    for array, tensor in zip(arrays.values(), sent.values(), strict=True):
        assert tensor.is_contiguous() and tensor.numpy().tolist() == array.tolist()
        assert (
            tensor.numpy().dtype == array.dtype and tensor.storage_offset() * tensor.element_size() % 8 == 0
        )
    assert len({tensor.untyped_storage().data_ptr() for tensor in sent.values()}) == 1
    # The next call of the layout lands in the same buffer: nothing allocated per call.
    again = staging.send(call_inputs.pack({name: array + 1 for name, array in arrays.items()}))
    assert transfers[1][0] is transfers[0][0] and staging.nbytes == transfers[0][1]
    assert again["a"].tolist() == [1, 2, 3, 4, 5] and again["a"].data_ptr() == sent["a"].data_ptr()


def test_each_sending_thread_has_buffers_of_its_own():
    """A transfer from another thread (a background compile, the draft model) never lands in the buffer of a
    call the device thread has yet to run."""
    staging = call_inputs.StagingBuffers(CPU)
    packed = call_inputs.pack({"ids": np.arange(4, dtype=np.int64)})
    here = staging.send(packed)
    with ThreadPoolExecutor(1, thread_name_prefix="other") as pool:
        there = pool.submit(staging.send, call_inputs.pack({"ids": np.zeros(4, dtype=np.int64)})).result()
    assert here["ids"].tolist() == [0, 1, 2, 3] and there["ids"].tolist() == [0] * 4
    assert staging.nbytes == 2 * packed.buffer.nbytes


def test_steps_write_alternate_halves_and_padding_the_null_slot():
    rows = 4
    first = step_state.next_base(1, rows)
    second = step_state.next_base(first, rows)
    assert {first, second} == {1, 1 + rows} and step_state.next_base(second, rows) == first
    # Halves of rows slots each, past the null slot 0: a step never writes the half the next one reads.
    assert max(first, second) + rows - 1 == step_state.token_slot_count(rows) - 1
    assert step_state.keep_slots(first, [2, 0], rows=4, queries=1).tolist() == [first + 2, first, 0, 0]
    assert step_state.keep_slots(first, [2, 0], rows=8, queries=2).tolist() == [0] * 8  # verify: on the host


def test_only_a_rows_final_token_is_fed_on_the_device():
    """Not a partial prefill's discarded sample, a verify row's (accepted drafts decide), nor a row whose
    top-p cut may lie beyond the graph's candidates (NO_TOKEN)."""
    table = torch.cat(
        [
            make_rows(1, temperature=0.0),
            make_rows(1, temperature=0.8, top_p=0.9),  # may overflow
            make_rows(1, temperature=0.8, top_k=40, top_p=0.9),  # top-k within the candidates: never
            make_rows(1, temperature=0.0),  # partial prefill
            make_rows(1, temperature=0.0),  # verify
        ]
    ).numpy()
    req_ids = ["greedy", "top-p", "top-k-top-p", "partial", "verify"]
    slots = step_state.final_slots(
        req_ids, [sampling.may_overflow(row) for row in table], [3], {4: [5, 6]}, base=9
    )
    assert slots == {"greedy": 9, "top-k-top-p": 11}


def test_a_decode_row_is_fed_from_its_slot_or_filled_in_by_the_host():
    """A row whose previous token is final in the slots takes it there; one the graph may have left to the
    host (NO_TOKEN) is filled in on the host; a row with neither is an error."""
    previous = SimpleNamespace(final_slots={"a": 7})
    fills = step_state.Fills()
    fills.add(0, "a", previous)
    fills.add(2, "b", previous)
    with pytest.raises(RuntimeError, match="neither known nor being sampled"):
        fills.add(1, "c", None)
    feed, host = fills.feed([2, 0], np.array([4, 5]), tokens=6)
    assert feed.tolist() == [0, 0, 0, 0, 0, 7] and host == [(4, "b")]


def test_a_graph_reads_the_previous_steps_tokens_and_writes_its_own():
    """ForwardAndSample's two lines on the slots, compiled: a decode row fed from the slot the previous step
    wrote, a prefill row's id its own; the step's tokens into its half, padding into the null slot."""

    def step(slots, input_ids, feed, keep, sampled):
        fed = slots.index_select(0, feed).to(input_ids.dtype)
        ids = torch.where(feed > 0, fed, input_ids)
        slots.index_copy_(0, keep, sampled)
        return ids

    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=False)
    rows = 2
    slots = torch.zeros(step_state.token_slot_count(rows), dtype=torch.int32)
    base = step_state.next_base(1, rows)
    keep = torch.from_numpy(step_state.keep_slots(base, [0, 1], rows=3, queries=1))
    ids = compiled(
        slots,
        torch.tensor([5, 6, 0]),
        torch.zeros(3, dtype=torch.int64),
        keep,
        torch.tensor([41, 42, 9], dtype=torch.int32),
    )
    assert ids.tolist() == [5, 6, 0] and slots[base : base + rows].tolist() == [41, 42]
    # The next step: row 0 is the previous step's row 1, row 1 a new prompt's token.
    feed = torch.tensor([base + 1, 0, 0])
    next_keep = torch.from_numpy(step_state.keep_slots(step_state.next_base(base, rows), [0, 1], 3, 1))
    ids = compiled(
        slots, torch.tensor([0, 7, 0]), feed, next_keep, torch.tensor([43, 44, 9], dtype=torch.int32)
    )
    assert ids.tolist() == [42, 7, 0]
