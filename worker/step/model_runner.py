"""One scheduler step on static shapes, as a short story: update the persistent batch, plan the step's
bucketed calls with their inputs (worker/step/persistent_batch.py), run the compiled model and its sampler
(worker/step/forward.py), bring the tokens to the host (worker/step/step_state.py) and make vLLM's output.

With vLLM's async scheduler (its default) the engine schedules step N+1, and processes step N-1's outputs,
while step N runs. The runner prepares N+1 once N's tokens are on the host (its decode rows' input tokens are
N's samples): what stays on the host's critical path, with the device idle, is the copy of N's token ids and
N+1's input preparation. On Trainium the calls go to a thread of their own (`DeviceThread`), so that
execute_model returns while the device runs them. In CPU mode they run in the caller's thread: the device is
the host's cores, and a second thread doing torch work gets an OpenMP team of its own, which throttles both
teams' spinning (more OpenMP threads than cores) and makes each call slower than inline.
VLLM_NEURON_DEVICE_THREAD=on runs Trainium's arrangement in CPU mode, for its tests and to measure the host
time it leaves between calls.

The runner's other jobs (set-up, warm-up, sleep mode, drafts, shutdown): worker/step/runner_setup.py."""

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    DraftTokenIds,
    ModelRunnerOutput,
)

from vllm_neuron import device as neuron_device
from vllm_neuron import envs
from vllm_neuron.call_costs import PROFILES, profile_for
from vllm_neuron.calls import Call
from vllm_neuron.config import NeuronConfig
from vllm_neuron.upstream.vllm_runner import Sampler, strip_speculative_padding
from worker.compiles.background import compile_workers
from worker.compiles.readiness import Readiness
from worker.kv.kv_caches import KVCaches
from worker.kv.kv_transfer import KVTransfer
from worker.kv.sleep_mode import SleepMode
from worker.lora.slots import LoRASlots
from worker.metrics.step_metrics import CallStats, StepMetrics
from worker.spec_decode import draft_model, eagle3, speculation
from worker.step.call_inputs import Chunk
from worker.step.forward import CompiledModel
from worker.step.persistent_batch import CallPlanner, PersistentBatch, StepRows
from worker.step.runner_setup import RunnerSetup
from worker.step.step_state import (
    CallOutputs,
    Fills,
    Halves,
    RunningStep,
    ToHost,
    TokenCollector,
    fill_previous_tokens,
    final_slots,
    start_reads,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

logger = init_logger("vllm.vllm_neuron.model_runner")


class NeuronModelRunner(RunnerSetup):
    def __init__(self, vllm_config: "VllmConfig", device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.neuron_config = NeuronConfig.of(vllm_config)
        self.buckets = self.neuron_config.buckets
        self.block_size = vllm_config.cache_config.block_size
        self.batch = PersistentBatch(vllm_config, self.block_size)
        self.tokens = TokenCollector(
            Sampler(logprobs_mode=self.model_config.logprobs_mode), self.model_config.get_vocab_size()
        )
        self.slot_halves = Halves(self.neuron_config.max_num_seqs)
        self.compiled: CompiledModel | None = None
        self.kv_cache = KVCaches(vllm_config, device)
        self.sleep_mode = SleepMode(self.kv_cache)
        self.kv_transfer = KVTransfer(vllm_config, self.kv_cache)  # --kv-transfer-config's connector
        workers = compile_workers(
            envs.VLLM_NEURON_COMPILE_WORKERS, neuron_device.mode() == "neuron", os.cpu_count() or 1
        )
        self.readiness = Readiness(self.buckets, workers, PROFILES[profile_for(neuron_device.target())])
        self.planner = CallPlanner(
            self.buckets, self.block_size, device, self.readiness, lora=bool(vllm_config.lora_config)
        )
        self.stats = CallStats()
        self.step_calls: list[Call] = []  # the calls of the latest step (tests, debugging, the step trace)
        # Every rank runs every call; only the driver rank (TP rank 0) records traffic.
        self.tp_rank = get_tensor_model_parallel_rank()
        self.step_metrics = StepMetrics(records_traffic=self.tp_rank == 0)
        self.steps = RunningSteps(self._output, self.step_metrics.record, self.readiness.activity.busy)
        self.device_thread = (
            DeviceThread(threaded=neuron_device.calls_on_a_thread())
            if vllm_config.scheduler_config.async_scheduling
            else None
        )
        # Speculative decoding: the n-gram drafter, or a draft model (worker/spec_decode/draft_model.py),
        # proposes draft tokens after each step; the scheduler takes them.
        self.drafter = speculation.Drafter.for_config(vllm_config)
        threaded = self.device_thread is not None and self.device_thread.threaded
        submit = self.device_thread.submit if threaded else None
        self.lora = LoRASlots(vllm_config, device, submit) if vllm_config.lora_config else None
        self._model_drafts: DraftTokenIds | None = None

    @property
    def serving(self) -> bool:
        return self.readiness.serving

    @torch.no_grad()
    def execute_model(self, scheduler_output: "SchedulerOutput") -> ModelRunnerOutput | None:
        # With the calls on a thread of their own (Trainium), this step is prepared while the previous one
        # runs: the decode rows whose token is its sample get it on the device thread, once its calls end, so
        # the device waits only for that copy. Otherwise the previous step's output is made first. Either way
        # its figures are recorded once this step's calls run, off the host's critical path.
        previous = self.steps.in_flight if self._calls_on_a_thread() else None
        if previous is None:
            self.steps.finish_in_flight(record_later=True)
        started, schedule = self.step_metrics.step_started(scheduler_output)
        self.readiness.activity.busy.set()  # until the step's output is made
        self.batch.update(scheduler_output)
        if self.planner.head is not None:  # an EAGLE3 head's kept hidden states of requests that left
            left = scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set())
            self.planner.head.release(left)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self._without_forward(scheduler_output)
        self.steps.pending = step = self._prepare(scheduler_output, previous, started, schedule)
        if self.device_thread is not None and self.serving:
            step.outputs = self.device_thread.submit(lambda: self._run_step(step))
        else:
            step.outputs = self._run_step(step)
        self.steps.finish_in_flight(record_later=True)  # the previous step, while this one's calls run
        self.steps.record_unrecorded()
        if self.serving:
            self.step_metrics.sample_usage(started, self.batch.block_table[: self.batch.input_batch.num_reqs])
        self.step_metrics.execute_returned()
        return None

    def _without_forward(self, scheduler_output: "SchedulerOutput") -> ModelRunnerOutput:
        """A step that runs no token (requests finished or preempted only): the previous step's output is
        made, and a KV connector's transfers go on."""
        self.steps.finish_in_flight(record_later=True)
        self.readiness.activity.busy.clear()
        self.steps.record_unrecorded()
        self.step_metrics.execute_returned()
        return self.kv_transfer.without_forward(scheduler_output)

    def _prepare(
        self,
        scheduler_output: "SchedulerOutput",
        previous: RunningStep | None,
        started: float,
        schedule: float | None,
    ) -> RunningStep:
        """The step's rows as decode rows (one token, or a verify row's last token and drafts) and prefill
        chunks, and its planned calls."""
        input_batch = self.batch.input_batch
        decode: list[tuple[int, Chunk]] = []
        prefill: list[tuple[int, Chunk]] = []
        partial: list[int] = []
        fills = Fills()  # rows whose token the previous step is still sampling
        drafts = scheduler_output.scheduled_spec_decode_tokens
        row_drafts: dict[int, list[int]] = {}  # batch row -> its drafts, of decode rows to verify
        lora_slots = self.lora.activate(input_batch) if self.lora is not None else [0] * input_batch.num_reqs
        for row, req_id in enumerate(input_batch.req_ids):
            count = scheduler_output.num_scheduled_tokens[req_id]
            start = int(input_batch.num_computed_tokens_cpu[row])
            if count == 1 and start == input_batch.num_tokens_no_spec[row]:
                fills.add(row, req_id, previous)
            if req_id in drafts:  # a decode row to verify: its last token, then its draft tokens
                assert count == 1 + len(drafts[req_id]), (req_id, count, drafts[req_id])
                # vLLM's scheduler pads a request that joins as a decode row (its whole prompt cached)
                # with -1 placeholders: no draft to check, all rejected.
                real = strip_speculative_padding(drafts[req_id])
                token_ids = np.array([input_batch.token_ids_cpu[row, start], *real], dtype=np.int64)
                if real:
                    row_drafts[row] = real
            else:
                token_ids = input_batch.token_ids_cpu[row, start : start + count]
            chunk = Chunk(token_ids, start, self.batch.block_table[row], lora_slots[row])
            (decode if count == 1 or req_id in drafts else prefill).append((row, chunk))
            if start + count < input_batch.num_tokens_no_spec[row]:
                partial.append(row)  # prefill not finished: this row's sample is discarded

        sampling_rows = self.batch.sampling_rows(partial)
        slot_base = self.slot_halves.next()
        planned = self.planner.plan(
            StepRows(
                decode,
                prefill,
                sampling_rows,
                fills,
                row_drafts,
                self._random_draws,
                slot_base,
                list(input_batch.req_ids),
            )
        )
        host_rows = [
            self.batch.host_only or self.batch.sampling[req_id].host_reason is not None
            for req_id in input_batch.req_ids
        ]
        logprobs = input_batch.sampling_metadata.max_num_logprobs
        step = RunningStep(
            scheduler_output,
            planned,
            partial,
            list(input_batch.req_ids),
            host_rows,
            logprobs,
            started,
            schedule,
            drafts=row_drafts,
            final_slots=final_slots(
                input_batch.req_ids,
                [self.batch.sampling[req_id].may_overflow for req_id in input_batch.req_ids],
                partial,
                row_drafts,
                slot_base,
            ),
        )
        if fills.from_host:
            step.previous, step.previous_outputs = previous, previous.outputs
        self.step_calls = [item.call for item in planned]
        step.prepare_seconds = time.perf_counter() - started
        return step

    def _calls_on_a_thread(self) -> bool:
        return self.device_thread is not None and self.device_thread.threaded and self.serving

    def _run_step(self, step: RunningStep) -> list[CallOutputs]:
        """Run a step's calls (in the device thread with async scheduling), and start the reads of the
        outputs the step's output needs."""
        if step.previous is not None:
            fill_previous_tokens(step)
        step.device_started = time.perf_counter()
        # A KV connector's loads before the calls and saves after them (none without a connector).
        transfers = step.scheduler_output.kv_connector_metadata is not None
        around = self.kv_transfer.around(step.scheduler_output) if transfers else nullcontext()
        with around as step.kv_connector_output:
            outputs = []
            for item in step.planned:
                if self.serving and self.step_metrics.records_traffic:
                    self.stats.record(item.call)
                out = self.compiled.run(item.call, item.send(self.planner.staging))
                outputs.append(CallOutputs(item.batch_rows, *out, item.call.queries))
        start_reads(step, outputs)
        step.device_ended = time.perf_counter()
        step.forward_seconds = step.device_ended - step.device_started
        return outputs

    @torch.no_grad()
    def sample_tokens(self, grammar_output: "GrammarOutput | None") -> "ModelRunnerOutput | StepOutput":
        return self.steps.sample(grammar_output)

    @torch.no_grad()  # made in the engine's output thread too: dynamo guards on the grad mode
    def _output(self, step: RunningStep) -> ModelRunnerOutput:
        """The step's tokens on the host, its drafts accepted, and vLLM's output; then the next drafts."""
        start, to_host = time.perf_counter(), ToHost()
        collected = self.tokens.collect(step, self.batch.input_batch, to_host)
        sampled_ids = [[token] for token in collected.tokens.tolist()]
        for row in step.partial_prefill_rows:
            sampled_ids[row] = []
        # Which rows may speculate: only asked when speculative decoding is on (not per step otherwise).
        drafting = self.serving and (self.compiled.drafts or self.drafter is not None)
        speculating = [self._speculates(req_id) for req_id in step.req_ids] if drafting else []
        if step.drafts and self.serving:
            # (Warm-up's verify rows end at max_model_len: their one token is all the batch holds.)
            greedy = [speculation.is_greedy(self.batch.sampling[req_id]) for req_id in step.req_ids]
            generators = self.batch.input_batch.generators
            speculation.accept_drafts(step, sampled_ids, to_host, speculating, greedy, generators)
        logprobs = collected.logprobs
        output = ModelRunnerOutput(
            req_ids=list(step.req_ids),
            req_id_to_index={req_id: row for row, req_id in enumerate(step.req_ids)},
            sampled_token_ids=sampled_ids,
            logprobs=logprobs.tolists() if logprobs is not None else None,
            prompt_logprobs_dict={},
            kv_connector_output=step.kv_connector_output,
        )
        self.batch.append_sampled(step.req_ids, sampled_ids)
        if self.compiled.draft is not None and self.serving:
            self._model_drafts = draft_model.propose(
                step, sampled_ids, self.batch, speculating, self.planner, self.compiled.run_draft
            )
        if self.compiled.head is not None and self.serving:
            self._model_drafts = eagle3.propose(
                step,
                sampled_ids,
                self.batch,
                speculating,
                self.planner,
                self.compiled.hidden_slots.index,
                self._run_propose,
                self.compiled.hidden_slots.entries - 1,
            )
        if self.drafter is not None and self.serving:
            wanted = step.scheduler_output.num_spec_tokens_to_schedule
            self.drafter.propose(self.batch.input_batch, step.req_ids, sampled_ids, speculating, wanted)
        step.tokens = collected.tokens
        self.step_metrics.output_made(step, start, to_host.bytes, collected.on_host, self.serving)
        return output


class DeviceThread:
    """One thread that runs the compiled calls of one step at a time, in submission order (started at the
    first step, and again at the first step after close()); or, not threaded, the caller's thread."""

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, calls: Callable[[], object]) -> Future:
        def run() -> object:
            with torch.no_grad():  # grad mode is per thread, and dynamo guards on it
                return calls()

        if not self.threaded:
            done: Future = Future()
            done.set_result(run())
            return done
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neuron-device")
        return self._executor.submit(run)

    def close(self) -> None:
        """Wait for the calls under way and end the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class StepOutput(AsyncModelRunnerOutput):
    """A step's output, made when the engine asks for it (or earlier, when the next step needs its tokens)."""

    def __init__(self, resolve: Callable[[], ModelRunnerOutput]) -> None:
        self._resolve = resolve

    def get_output(self) -> ModelRunnerOutput:
        return self._resolve()


class RunningSteps:
    """The runner's steps under way: the one prepared, from execute_model until sample_tokens; with async
    scheduling the one in flight, until the engine or the next step asks for its output (made once, by
    `make_output`); and one whose output is made but whose figures wait until the next step's calls run,
    off the host's critical path (`record`)."""

    def __init__(
        self,
        make_output: Callable[[RunningStep], ModelRunnerOutput],
        record: Callable[[RunningStep], None],
        busy: threading.Event,
    ) -> None:
        self._make_output = make_output
        self._record = record
        self._busy = busy  # set while a step runs: background compiles give way
        self.pending: RunningStep | None = None
        self.in_flight: RunningStep | None = None
        self._unrecorded: RunningStep | None = None

    def sample(self, grammar_output: "GrammarOutput | None") -> ModelRunnerOutput | StepOutput:
        """sample_tokens: the pending step's output; one sampled in the graph on the device thread is made
        when the engine asks for it, so that the engine goes on while its calls run."""
        step, self.pending = self.pending, None
        if step is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        step.grammar_output = grammar_output
        if isinstance(step.outputs, Future) and not step.host_bound and grammar_output is None:
            self.in_flight = step
            return StepOutput(lambda: self.finish(step))
        return self.finish(step)

    def finish_in_flight(self, record_later: bool = False) -> None:
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self.finish(step, record_later)

    def finish(self, step: RunningStep, record_later: bool = False) -> ModelRunnerOutput:
        """Make the step's output once, whoever asks first: the engine (in its output thread with several
        ranks) or the next step (which records its figures after its own calls started)."""
        with step.lock:
            if step.result is None:
                try:
                    if isinstance(step.outputs, Future):
                        step.outputs = step.outputs.result()
                    step.result = self._make_output(step)
                except Exception as error:
                    # A device error can surface at the copy of the outputs, after the call returned.
                    calls = "; ".join(str(item.call) for item in step.planned)
                    logger.error("Step failed (its compiled calls: %s): %s", calls, error)
                    raise
                finally:
                    step.tokens_ready.set()
                    if self.pending is None:  # no later step prepared: the device is idle
                        self._busy.clear()
                if record_later:
                    self._unrecorded = step
                else:
                    self._record(step)
            return step.result

    def record_unrecorded(self) -> None:
        step, self._unrecorded = self._unrecorded, None
        if step is not None:
            self._record(step)
