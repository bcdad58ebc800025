"""A step's compiled calls with their inputs on the device: `calls.plan_step` splits the step's decode rows
and prefill chunks into bucketed calls, and each call's padded inputs and sampling parameter rows are built
here and packed for one transfer. A decode row whose token the previous step is still sampling takes it from
the token slots inside the graph (worker/token_slots.py), or, where the graph may leave that token to the
host, gets it filled in on the device thread."""

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_neuron import sampling
from vllm_neuron.buckets import BucketConfig
from vllm_neuron.calls import Call, plan_step
from worker import call_inputs, speculation, token_slots
from worker.call_inputs import CallInputs, Chunk, HostInputs
from worker.packed_inputs import StagingBuffers
from worker.readiness import Readiness
from worker.step_state import PlannedCall, RunningStep, ToHost, final_rows

Rows = list[tuple[int, Chunk]]  # (batch row, its chunk of tokens)


@dataclass
class Fills:
    """Decode rows (batch rows) whose token the previous step is still sampling: where each comes from."""

    from_slots: dict[int, int] = field(default_factory=dict)  # -> its slot (worker/token_slots.py)
    from_host: dict[int, str] = field(default_factory=dict)  # -> its request id (fill_previous_tokens)

    def add(self, row: int, req_id: str, previous_slots: dict[str, int]) -> None:
        """A row from the slots where the previous step's token is final there, else from the host."""
        slot = previous_slots.get(req_id)
        if slot is None:
            self.from_host[row] = req_id
        else:
            self.from_slots[row] = slot


class CallPlanner:
    def __init__(
        self, buckets: BucketConfig, block_size: int, device: torch.device, lora: bool = False
    ) -> None:
        self.buckets = buckets
        self.block_size = block_size
        self.device = device
        self.lora = lora  # send each call's LoRA slots (--enable-lora)
        self.staging = StagingBuffers(device)  # where each call's inputs land (worker/packed_inputs.py)

    def plan(
        self,
        decode: Rows,
        prefill: Rows,
        parameters: np.ndarray,
        fills: Fills,
        drafts: dict[int, list[int]],
        random_draws: Callable[[int], torch.Generator | bool | None],
        readiness: Readiness,
        slot_base: int,
    ) -> list[PlannedCall]:
        """The step's calls, each sampling the rows of its requests (a sub-chunk's row is sampled again by
        the next: the last part of a chunk gives its token; a verify call samples every query of its rows).
        `parameters`: each batch row's sampling row; `fills`: decode rows whose token the previous step is
        still sampling; `drafts`: decode rows' draft tokens (batch row -> drafts), which make the decode rows
        run in verify calls; `random_draws(row)`: a verify row's source of uniform draws when its drafts are
        accepted by their probability (None: by equality, or no drafts); `slot_base`: where the step's
        tokens go in the token slots. A call is packed once planned, or with fills from the host, on the
        device thread once they are in; the thread that runs it sends it."""
        verify = bool(drafts)
        contexts = [chunk.start + len(chunk.token_ids) for _, chunk in decode]
        chunks = [(chunk.start, len(chunk.token_ids)) for _, chunk in prefill]
        ready = readiness.ready_graphs if readiness.staging else None
        plans = plan_step(contexts, chunks, self.buckets, self.block_size, ready, verify=verify)
        if ready is not None and readiness.serving:
            readiness.report_demand(
                plans, plan_step(contexts, chunks, self.buckets, self.block_size, verify=verify)
            )
        planned = []
        for plan in plans:
            parts = []
            for index, start, length in plan.parts:
                chunk = prefill[index][1]
                offset = start - chunk.start
                tokens = chunk.token_ids[offset : offset + length]
                parts.append(Chunk(tokens, start, chunk.block_row, chunk.lora_slot))
            rows = [decode[index][1] for index in plan.decode_rows]
            host = self.host_inputs(plan.call, parts, rows)
            # Logits rows come in call order: the prefill parts' first, then the decode rows'; padding rows
            # are greedy.
            batch_rows = [prefill[index][0] for index, _, _ in plan.parts]
            batch_rows += [decode[index][0] for index in plan.decode_rows]
            table = np.zeros((host.rows, sampling.PARAMS), dtype=np.float32)
            # A verify row's queries each sample with the row's parameters; a random row's also leave out
            # their draft and get draws of their own (speculation.set_drafts).
            queries = plan.call.queries
            table[: host.num_real_rows * queries] = np.repeat(parameters[batch_rows], queries, axis=0)
            for index, row in enumerate(batch_rows if queries > 1 else ()):
                source = random_draws(row) if row in drafts else None
                if source is not None:
                    speculation.set_drafts(
                        table[index * queries : (index + 1) * queries], drafts[row], source
                    )
            feed = np.zeros(len(host.input_ids), dtype=np.int64)
            host_fills = []
            for k, index in enumerate(plan.decode_rows):
                row, token_index = decode[index][0], int(host.decode_token_index[k])
                if row in fills.from_slots:
                    feed[token_index] = fills.from_slots[row]
                elif row in fills.from_host:
                    host_fills.append((token_index, fills.from_host[row]))
            keep = token_slots.keep(slot_base, batch_rows, host.rows, queries)
            item = PlannedCall(plan.call, host, table, feed, keep, batch_rows, host_fills, self.lora)
            if not host_fills:
                item.pack()
            planned.append(item)
        return planned

    def inputs(self, call: Call, parts: list[Chunk], rows: list[Chunk]) -> CallInputs:
        """A call's inputs on the device, greedy, its tokens all its own (warm-up's synthetic calls, the
        draft model's calls)."""
        return self.host_inputs(call, parts, rows).send(self.staging, lora=self.lora)

    def host_inputs(self, call: Call, parts: list[Chunk], rows: list[Chunk]) -> HostInputs:
        """A call's inputs, padded to its buckets, on the host."""
        if call.phase == "prefill":
            return call_inputs.prefill_inputs(
                parts,
                token_bucket=call.token_bucket,
                context_bucket=call.chunk_context,
                block_size=self.block_size,
            )
        pages = self.buckets.decode_pages(call.batch, call.decode_context)
        if call.phase == "verify":
            return call_inputs.verify_inputs(
                rows,
                batch_bucket=call.batch,
                queries=call.queries,
                num_pages=pages,
                page_tokens=self.buckets.page_tokens,
                block_size=self.block_size,
            )
        if call.phase == "decode":
            return call_inputs.decode_inputs(
                rows,
                batch_bucket=call.batch,
                num_pages=pages,
                page_tokens=self.buckets.page_tokens,
                block_size=self.block_size,
            )
        (chunk,) = parts
        return call_inputs.mixed_inputs(
            chunk,
            rows,
            token_bucket=call.token_bucket,
            context_bucket=call.chunk_context,
            batch_bucket=call.batch,
            num_pages=pages,
            page_tokens=self.buckets.page_tokens,
            block_size=self.block_size,
        )


def fill_previous_tokens(step: RunningStep) -> None:
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
