"""A step's compiled calls with their inputs on the device: `calls.plan_step` splits the step's decode rows
and prefill chunks into bucketed calls, and each call's padded inputs and sampling parameter rows are built
here; on the device thread, decode rows whose token the previous step is still sampling get it filled in."""

from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from vllm_neuron import device as neuron_device
from vllm_neuron import sampling
from vllm_neuron.buckets import BucketConfig
from vllm_neuron.calls import Call, plan_step
from worker import call_inputs, speculation
from worker.call_inputs import CallInputs, Chunk
from worker.readiness import Readiness
from worker.step_state import PlannedCall, RunningStep, final_rows

Rows = list[tuple[int, Chunk]]  # (batch row, its chunk of tokens)


class CallPlanner:
    def __init__(self, buckets: BucketConfig, block_size: int, device: torch.device) -> None:
        self.buckets = buckets
        self.block_size = block_size
        self.device = device

    def plan(
        self,
        decode: Rows,
        prefill: Rows,
        parameters: np.ndarray,
        fills: dict[int, str],
        drafts: dict[int, list[int]],
        random_draws: Callable[[int], torch.Generator | bool | None],
        readiness: Readiness,
    ) -> list[PlannedCall]:
        """The step's calls, each sampling the rows of its requests (a sub-chunk's row is sampled again by
        the next: the last part of a chunk gives its token; a verify call samples every query of its rows).
        `parameters`: each batch row's sampling row; `fills`: decode rows (batch row -> request id) whose
        token the device thread fills in; `drafts`: decode rows' draft tokens (batch row -> drafts), which
        make the decode rows run in verify calls; `random_draws(row)`: a verify row's source of uniform
        draws when its drafts are accepted by their probability (None: by equality, or no drafts)."""
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
                parts.append(Chunk(chunk.token_ids[offset : offset + length], start, chunk.block_row))
            rows = [decode[index][1] for index in plan.decode_rows]
            inputs = self.inputs(plan.call, parts, rows)
            # Logits rows come in call order: the prefill parts' first, then the decode rows'; padding rows
            # are greedy.
            batch_rows = [prefill[index][0] for index, _, _ in plan.parts]
            batch_rows += [decode[index][0] for index in plan.decode_rows]
            table = np.zeros((len(inputs.logits_indices), sampling.PARAMS), dtype=np.float32)
            # A verify row's queries each sample with the row's parameters; a random row's also leave out
            # their draft and get draws of their own (speculation.set_drafts).
            queries = plan.call.queries
            table[: inputs.num_real_rows * queries] = np.repeat(parameters[batch_rows], queries, axis=0)
            for index, row in enumerate(batch_rows if queries > 1 else ()):
                source = random_draws(row) if row in drafts else None
                if source is not None:
                    speculation.set_drafts(
                        table[index * queries : (index + 1) * queries], drafts[row], source
                    )
            params = torch.from_numpy(table).to(self.device)
            decode_rows = [decode[index][0] for index in plan.decode_rows]
            call_fills = [
                (int(inputs.decode_token_index[k]), fills[row])
                for k, row in enumerate(decode_rows)
                if row in fills
            ]
            planned.append(PlannedCall(plan.call, inputs, params, batch_rows, call_fills))
        return planned

    def inputs(self, call: Call, parts: list[Chunk], rows: list[Chunk]) -> CallInputs:
        """A call's inputs, padded to its buckets, on the device."""
        if call.phase == "prefill":
            return call_inputs.prefill_inputs(
                parts,
                token_bucket=call.token_bucket,
                context_bucket=call.chunk_context,
                block_size=self.block_size,
                device=self.device,
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
                device=self.device,
            )
        if call.phase == "decode":
            return call_inputs.decode_inputs(
                rows,
                batch_bucket=call.batch,
                num_pages=pages,
                page_tokens=self.buckets.page_tokens,
                block_size=self.block_size,
                device=self.device,
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
            device=self.device,
        )

    def greedy_params(self, rows: int) -> torch.Tensor:
        """Sampling parameters of `rows` greedy rows (warm-up's synthetic calls, padding)."""
        return torch.zeros(rows, sampling.PARAMS, dtype=torch.float32, device=self.device)


def fill_previous_tokens(step: RunningStep, device: torch.device) -> None:
    """On the device thread, once the previous step's calls ended: its samples into this step's decode rows
    that wait for them. A row the graph left to the host (NO_TOKEN) waits for that step's output."""
    previous, outputs = step.previous, step.previous_outputs
    step.previous = step.previous_outputs = None  # no chain of steps kept alive
    if isinstance(outputs, Future):
        outputs = outputs.result()
    final = final_rows(outputs)
    row_of = {req_id: row for row, req_id in enumerate(previous.req_ids)}
    wanted = {row_of[req_id] for item in step.planned for _, req_id in item.fills}
    tokens: dict[int, int] = {}
    for call_index in sorted({final[row][0] for row in wanted}):
        out = outputs[call_index]
        sampled = out.real(out.token_ids, neuron_device.to_host).tolist()
        tokens |= {row: sampled[j] for j, row in enumerate(out.batch_rows) if final[row][0] == call_index}
    if any(tokens[row] == sampling.NO_TOKEN for row in wanted):
        previous.tokens_ready.wait()
        if previous.tokens is None:
            raise RuntimeError("the previous step failed: its tokens are missing")
        tokens = {row: int(previous.tokens[row]) for row in wanted}
    for item in step.planned:
        if item.fills:
            input_ids = item.inputs.host_input_ids.copy()
            for index, req_id in item.fills:
                input_ids[index] = tokens[row_of[req_id]]
            item.inputs.input_ids = torch.from_numpy(input_ids).to(device)
