"""The token hand-off between steps: a decode row whose token the previous step sampled takes it on the
device (an index into the token slots inside the next call's graph), not through the host: AWS's plugin
feeds each sampled token to the next step device to device too.

The slots: [1 + 2 * max rows] int32. Slot 0 is the null slot: padding rows write there and a token fed from
it is never read (`token_feed` 0 means: the id in input_ids). A step writes its rows' tokens into one half,
at its base + batch row (later calls of the step overwrite earlier ones: a prompt's last sub-chunk gives its
token), and reads the previous step's half, so that a step whose first call writes a row never overwrites a
token a later call of the same step reads. The compiled graph reads before it samples and writes after.

A token in the slots may not be final: where a row's top-p cut may lie beyond the graph's candidates the
graph leaves NO_TOKEN (vllm_neuron/sampling.py) and the host samples the row. Such a row's token is filled
in on the host, on the device thread, once the previous step's calls end (`fill_previous_tokens`)."""

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vllm_neuron import sampling
from worker.step.step_state import ToHost, final_rows

if TYPE_CHECKING:
    from worker.step.step_state import RunningStep


def size(max_num_seqs: int) -> int:
    return 1 + 2 * max_num_seqs


def next_base(previous_base: int, max_num_seqs: int) -> int:
    """The half a step writes: the other one than the step before it."""
    return 1 + max_num_seqs if previous_base == 1 else 1


class Halves:
    """Which half of the slots the latest step wrote."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.base = 1

    def next(self) -> int:
        """The base of the half the next step writes."""
        self.base = next_base(self.base, self.max_num_seqs)
        return self.base


@dataclass
class Fills:
    """Decode rows (batch rows) whose token the previous step is still sampling: where each comes from."""

    from_slots: dict[int, int] = field(default_factory=dict)  # -> its slot
    from_host: dict[int, str] = field(default_factory=dict)  # -> its request id (fill_previous_tokens)

    def add(self, row: int, req_id: str, previous: "RunningStep | None") -> None:
        """A row from the slots where the previous step's token is final there, else from the host."""
        if previous is None:
            raise RuntimeError(f"request {req_id}: its next token is neither known nor being sampled")
        slot = previous.final_slots.get(req_id)
        if slot is None:
            self.from_host[row] = req_id
        else:
            self.from_slots[row] = slot

    def feed(
        self, decode_rows: list[int], token_index: np.ndarray, tokens: int
    ) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """A call's token feed ([tokens]: each token's slot, 0: its own id) for its decode rows (batch rows,
        whose tokens are at `token_index` in input_ids), and the (index in input_ids, request id) of the
        rows whose token the host fills in."""
        feed = np.zeros(tokens, dtype=np.int64)
        host_fills = []
        for row, index in zip(decode_rows, token_index.tolist(), strict=False):
            if row in self.from_slots:
                feed[index] = self.from_slots[row]
            elif row in self.from_host:
                host_fills.append((index, self.from_host[row]))
        return feed, host_fills


def keep(base: int, batch_rows: list[int], rows: int, queries: int) -> np.ndarray:
    """[rows]: where each logits row's sampled token goes. A verify call's go nowhere: its rows' tokens are
    decided on the host (accepted drafts)."""
    slots = np.zeros(rows, dtype=np.int64)
    if queries == 1:
        slots[: len(batch_rows)] = base + np.asarray(batch_rows, dtype=np.int64)
    return slots


def final_slots(
    req_ids: list[str],
    sampling_rows: np.ndarray,
    partial_rows: list[int],
    verify_rows: dict[int, list[int]],
    base: int,
) -> dict[str, int]:
    """Requests whose sample in the graph is their next token, -> its slot: not a partial prefill's (its
    sample is discarded), nor a verify row's (its token is the accepted drafts'), nor a row whose top-p cut
    may lie beyond the graph's candidates (NO_TOKEN: the host samples it, sampling.may_overflow)."""
    skip = set(partial_rows) | set(verify_rows)
    return {
        req_id: base + row
        for row, req_id in enumerate(req_ids)
        if row not in skip and not sampling.may_overflow(sampling_rows[row])
    }


def fill_previous_tokens(step: "RunningStep") -> None:
    """On the device thread, once the previous step's calls ended: its samples into this step's decode rows
    that take them from the host (rows the graph may have left to the host: NO_TOKEN waits for that step's
    output), then those calls' inputs are packed."""
    previous, outputs = step.previous, step.previous_outputs
    step.previous = step.previous_outputs = None  # no chain of steps kept alive
    waiting = [item for item in step.planned if item.fills]
    if not waiting:
        return
    if isinstance(outputs, Future):
        outputs = outputs.result()
    final = final_rows(outputs)
    row_of = {req_id: row for row, req_id in enumerate(previous.req_ids)}
    wanted = {row_of[req_id] for item in waiting for _, req_id in item.fills}
    tokens: dict[int, int] = {}
    for call_index in sorted({final[row][0] for row in wanted}):
        out = outputs[call_index]
        sampled = out.real("token_ids", ToHost()).tolist()
        tokens |= {row: sampled[j] for j, row in enumerate(out.batch_rows) if final[row][0] == call_index}
    if any(tokens[row] == sampling.NO_TOKEN for row in wanted):
        previous.tokens_ready.wait()
        if previous.tokens is None:
            raise RuntimeError("the previous step failed: its tokens are missing")
        tokens = {row: int(previous.tokens[row]) for row in wanted}
    for item in waiting:
        item.host.input_ids = item.host.input_ids.copy()
        for index, req_id in item.fills:
            item.host.input_ids[index] = tokens[row_of[req_id]]
        item.pack()
