"""A step's compiled calls with their inputs on the device: `calls.plan_step` splits the step's decode rows
and prefill chunks into bucketed calls, and each call's padded inputs and sampling rows are built
here and packed for one transfer. A decode row whose token the previous step is still sampling takes it
through the token slots (worker/step/token_slots.py)."""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_neuron import sampling
from vllm_neuron.buckets import BucketConfig
from vllm_neuron.calls import Call, plan_step
from worker.compiles.readiness import Readiness
from worker.spec_decode import speculation
from worker.step import call_inputs, token_slots
from worker.step.call_inputs import CallInputs, Chunk, HostInputs
from worker.step.packed_inputs import StagingBuffers
from worker.step.step_state import PlannedCall
from worker.step.token_slots import Fills

Rows = list[tuple[int, Chunk]]  # (batch row, its chunk of tokens)


@dataclass
class StepRows:
    """What a step runs, by batch row: the planner's one argument."""

    decode: Rows  # one token each, or a verify row's last token and its drafts
    prefill: Rows
    sampling_rows: np.ndarray  # [batch rows, sampling.PARAMS]: each row's sampling row
    fills: Fills  # decode rows whose token the previous step is still sampling
    drafts: dict[int, list[int]]  # decode rows to verify -> their draft tokens
    # A verify row's source of uniform draws when its drafts are accepted by their probability (None: by
    # equality).
    random_draws: Callable[[int], torch.Generator | bool | None]
    slot_base: int  # where the step's tokens go in the token slots


class CallPlanner:
    def __init__(
        self,
        buckets: BucketConfig,
        block_size: int,
        device: torch.device,
        readiness: Readiness,
        lora: bool = False,
    ) -> None:
        self.buckets = buckets
        self.block_size = block_size
        self.device = device
        self.readiness = readiness  # the graphs a step may use
        self.lora = lora  # send each call's LoRA slots (--enable-lora)
        self.staging = StagingBuffers(device)  # where each call's inputs land (worker/step/packed_inputs.py)

    def plan(self, step: StepRows) -> list[PlannedCall]:
        """The step's calls, each sampling the rows of its requests (a sub-chunk's row is sampled again by
        the next: the last part of a chunk gives its token; a verify call samples every query of its rows;
        decode rows with drafts run in verify calls). A call is packed once planned, or with fills from the
        host, on the device thread once they are in; the thread that runs it sends it."""
        decode, prefill, drafts = step.decode, step.prefill, step.drafts
        contexts = [chunk.start + len(chunk.token_ids) for _, chunk in decode]
        chunks = [(chunk.start, len(chunk.token_ids)) for _, chunk in prefill]
        plans = self.readiness.plan_calls(
            lambda ready: plan_step(
                contexts, chunks, self.buckets, self.block_size, ready, verify=bool(drafts)
            )
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
            decode_rows = [decode[index][0] for index in plan.decode_rows]
            batch_rows = [prefill[index][0] for index, _, _ in plan.parts] + decode_rows
            sampling_rows = np.zeros((host.rows, sampling.PARAMS), dtype=np.float32)
            # A verify row's queries each sample with the row's parameters; a random row's also leave out
            # their draft and get draws of their own (speculation.set_drafts).
            queries = plan.call.queries
            sampling_rows[: host.num_real_rows * queries] = np.repeat(
                step.sampling_rows[batch_rows], queries, axis=0
            )
            for index, row in enumerate(batch_rows if queries > 1 else ()):
                source = step.random_draws(row) if row in drafts else None
                if source is not None:
                    speculation.set_drafts(
                        sampling_rows[index * queries : (index + 1) * queries], drafts[row], source
                    )
            feed, host_fills = step.fills.feed(decode_rows, host.decode_token_index, len(host.input_ids))
            keep = token_slots.keep(step.slot_base, batch_rows, host.rows, queries)
            item = PlannedCall(plan.call, host, sampling_rows, feed, keep, batch_rows, host_fills, self.lora)
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
