"""The sampled tokens of the latest two steps, kept on the device, so that a decode row whose token the
previous step sampled takes it there (an index into the slots inside the next call's graph), not through the
host: AWS's plugin feeds each sampled token to the next step device to device too.

The slots: [1 + 2 * max rows] int32. Slot 0 is the null slot: padding rows write there and a token fed from
it is never read (`token_feed` 0 means: the id in input_ids). A step writes its rows' tokens into one half,
at its base + batch row (later calls of the step overwrite earlier ones: a prompt's last sub-chunk gives its
token), and reads the previous step's half, so that a step whose first call writes a row never overwrites a
token a later call of the same step reads. The compiled graph reads before it samples and writes after."""

import numpy as np

from vllm_neuron import sampling


def size(max_rows: int) -> int:
    return 1 + 2 * max_rows


def next_base(previous_base: int, max_rows: int) -> int:
    """The half a step writes: the other one than the step before it."""
    return 1 + max_rows if previous_base == 1 else 1


def keep(base: int, batch_rows: list[int], rows: int, queries: int) -> np.ndarray:
    """[rows]: where each logits row's sampled token goes. A verify call's go nowhere: its rows' tokens are
    decided on the host (accepted drafts)."""
    slots = np.zeros(rows, dtype=np.int64)
    if queries == 1:
        slots[: len(batch_rows)] = base + np.asarray(batch_rows, dtype=np.int64)
    return slots


def final_slots(
    req_ids: list[str],
    parameters: np.ndarray,
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
        if row not in skip and not sampling.may_overflow(parameters[row])
    }
