"""One scheduler step on static shapes, as a short story: update the persistent batch, plan the step's
bucketed calls with their inputs (worker/step/call_planner.py), run the compiled model and its sampler
(worker/step/forward.py), bring the tokens to the host (worker/step/outputs.py) and make vLLM's output; with
async scheduling the calls run while the engine schedules the next step (worker/step/async_steps.py).

The runner's other jobs live beside it: readiness (warm-up and background compiles,
worker/compiles/readiness.py), the KV cache (worker/kv/kv_caches.py), sleep mode (worker/kv/sleep_mode.py),
speculative decoding (worker/spec_decode/speculation.py, worker/spec_decode/draft_model.py) and step metrics
(worker/metrics/step_metrics.py)."""

import os
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

from vllm_neuron import device as neuron_device
from vllm_neuron import envs, metrics
from vllm_neuron.buckets import GraphKey
from vllm_neuron.call_costs import PROFILES, profile_for
from vllm_neuron.calls import Call
from vllm_neuron.config import NeuronConfig
from vllm_neuron.graph_plan import GraphPlan
from vllm_neuron.upstream.vllm_runner import Sampler, strip_speculative_padding
from worker.compiles import warmup
from worker.compiles.background import compile_workers
from worker.compiles.readiness import Readiness, lowered_graphs
from worker.kv.kv_caches import KVCaches
from worker.kv.kv_transfer import KVTransfer
from worker.kv.sleep_mode import SleepMode
from worker.lora.slots import LoRASlots
from worker.metrics.step_metrics import StepMetrics
from worker.spec_decode import draft_model, speculation
from worker.step import sampling_rows, token_slots
from worker.step.async_steps import DeviceThread, RunningSteps, StepOutput
from worker.step.call_inputs import CallInputs, Chunk
from worker.step.call_planner import CallPlanner, StepRows
from worker.step.forward import CompiledModel
from worker.step.outputs import TokenCollector
from worker.step.persistent_batch import PersistentBatch
from worker.step.step_state import CallOutputs, RunningStep, ToHost, start_reads

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

logger = init_logger("vllm.vllm_neuron.model_runner")


class NeuronModelRunner:
    def __init__(self, vllm_config: "VllmConfig", device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.neuron_config = NeuronConfig.of(vllm_config)
        self.buckets = self.neuron_config.buckets
        self.block_size = vllm_config.cache_config.block_size
        self.batch = PersistentBatch(vllm_config, self.block_size)
        self.host_sampler_only = sampling_rows.host_only(self.model_config)
        self.tokens = TokenCollector(
            Sampler(logprobs_mode=self.model_config.logprobs_mode), self.model_config.get_vocab_size()
        )
        self.slot_halves = token_slots.Halves(self.neuron_config.max_num_seqs)
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
        self.stats = metrics.CallStats()
        self.step_calls: list[Call] = []  # the calls of the latest step (tests, debugging, the step trace)
        # Every rank runs every call; only the driver rank (TP rank 0) records traffic.
        self.tp_rank = get_tensor_model_parallel_rank()
        self.step_metrics = StepMetrics(records_traffic=self.tp_rank == 0)
        self.steps = RunningSteps(self._output, self.step_metrics.record, self.readiness.activity.busy)
        # Async scheduling (vLLM's default): on Trainium a step's calls run on this thread while the engine
        # schedules the next one and processes the previous one's output (worker/step/async_steps.py).
        self.device_thread = (
            DeviceThread(threaded=neuron_device.calls_on_a_thread())
            if vllm_config.scheduler_config.async_scheduling
            else None
        )
        # Speculative decoding: the n-gram drafter, or a draft model (worker/spec_decode/draft_model.py),
        # proposes draft tokens after each step; the scheduler takes them.
        self.drafter = speculation.Drafter.for_config(vllm_config)
        self.lora = LoRASlots(vllm_config, device, self.device_thread) if vllm_config.lora_config else None
        self._model_drafts: DraftTokenIds | None = None

    @property
    def serving(self) -> bool:
        return self.readiness.serving

    @property
    def model(self) -> torch.nn.Module | None:
        return self.compiled.model if self.compiled is not None else None

    @property
    def recorder(self):
        return self.compiled.recorder if self.compiled is not None else None

    # ---- set-up -------------------------------------------------------------------------------------

    def load_model(self) -> None:
        self.compiled = CompiledModel(
            self.vllm_config,
            self.neuron_config.compile_backend,
            self.buckets.num_graphs,
            self.readiness.compile_workers,
            self.tp_rank,
            self.device,
            self.lora,
        )

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.kv_cache.spec()

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self._allocate_kv_cache(kv_cache_config)
        metrics.KV_BLOCKS_TOTAL.set(kv_cache_config.num_blocks - 1)
        logger.info(
            "KV cache: %d blocks of %d tokens in %d layers",
            kv_cache_config.num_blocks,
            self.block_size,
            len(self.kv_cache.layers),
        )

    def _allocate_kv_cache(self, config: KVCacheConfig) -> None:
        self.kv_cache.allocate(config, self.compiled.recorder.zeros)
        self.compiled.attention_layers = self.kv_cache.layers

    def warm_up(self) -> float:
        """Compile a KV connector's block copies, then the graphs serving needs
        (worker/compiles/readiness.py); returns the seconds until serving may start."""
        plan = GraphPlan(self.buckets, self.compiled.draft is not None, self.kv_transfer.copy_buckets)
        seconds = self.kv_transfer.warm_up() + self.readiness.warm_up(
            self.compiled.recorder,
            self._warm_up_step,
            self._compile_in_background,
            max_model_len=self.model_config.max_model_len,
            block_size=self.block_size,
            one_rank=self.vllm_config.parallel_config.tensor_parallel_size == 1,
            plan=plan,
        )
        if self.lora is not None:
            self.lora.warm_up()
        self._log_ready()
        return seconds

    def _warm_up_step(self, item: warmup.WarmupStep) -> None:
        if self.execute_model(item.step) is None:
            self.sample_tokens(None)
        self.execute_model(warmup.finish_step(item.request_ids))
        neuron_device.synchronize()

    @torch.no_grad()  # the grad mode serving runs in: dynamo guards on it
    def _compile_in_background(self, graph: GraphKey) -> None:
        """Compile one graph in this (background) thread by running it on synthetic requests whose blocks are
        all the null block, as warm-up does, beside serving."""
        call, parts, rows = warmup.synthetic_call(
            graph,
            self.buckets,
            max_model_len=self.model_config.max_model_len,
            blocks_per_request=self.batch.block_table.shape[1],
        )
        inputs = self.planner.inputs(call, parts, rows)
        with self.compiled.recorder.expecting(call):
            self.compiled.forward(inputs)
        neuron_device.synchronize()

    def compile_progress(self) -> dict[str, object]:
        return self.readiness.summary()

    def lowered_graphs(self) -> list[dict[str, object]]:
        return lowered_graphs(self.recorder)

    def _log_ready(self) -> None:
        max_len = self.model_config.max_model_len
        blocks = self.kv_cache.usable_blocks
        logger.info(
            "Ready: %s mode, %d graphs, KV cache %d blocks of %d tokens (%.1f requests of max_model_len %d "
            "at once), max_num_seqs %d, at most %s prefill tokens per step while requests decode",
            neuron_device.mode(),
            self.compiled.recorder.num_graphs,
            blocks,
            self.block_size,
            blocks * self.block_size / max_len,
            max_len,
            self.neuron_config.max_num_seqs,
            self.buckets.prefill_tokens_while_decoding or "unlimited",
        )
        logger.info("%s", sampling_rows.start_up_line(self.host_sampler_only))

    def shutdown(self) -> None:
        if self.device_thread is not None:
            self.device_thread.close()
        self.readiness.stop()
        if self.recorder is not None:
            self.recorder.close()
        self.step_metrics.close()

    # ---- sleep mode (worker/kv/sleep_mode.py) ------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        self.steps.finish_in_flight()
        self.readiness.pause()  # background compiles run the model on its weights and KV cache
        self.sleep_mode.sleep(level, self.compiled.models)

    def release_kv_cache(self) -> None:
        self.sleep_mode.release_kv_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleep_mode.wake_up(tags, lambda: self._allocate_kv_cache(self.kv_cache.config))
        if not self.sleep_mode.sleeping:
            self.readiness.resume()

    # ---- one step -----------------------------------------------------------------------------------

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
        fills = token_slots.Fills()  # rows whose token the previous step is still sampling
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

        sampling_rows = self._sampling_rows(partial)
        slot_base = self.slot_halves.next()
        planned = self.planner.plan(
            StepRows(decode, prefill, sampling_rows, fills, row_drafts, self._random_draws, slot_base)
        )
        host_rows = [
            self.host_sampler_only or self.batch.sampling[req_id].host_reason is not None
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
            final_slots=token_slots.final_slots(
                input_batch.req_ids, sampling_rows, partial, row_drafts, slot_base
            ),
        )
        if fills.from_host:
            step.previous, step.previous_outputs = previous, previous.outputs
        self.step_calls = [item.call for item in planned]
        step.prepare_seconds = time.perf_counter() - started
        return step

    def _calls_on_a_thread(self) -> bool:
        return self.device_thread is not None and self.device_thread.threaded and self.serving

    def _sampling_rows(self, partial_prefill_rows: list[int]) -> np.ndarray:
        """[rows, sampling.PARAMS]: each batch row's sampling parameters and uniform draw. A row the host
        samples, or whose sample is discarded, draws nothing: a seeded request's generator advances once per
        token the graph samples for it."""
        input_batch = self.batch.input_batch
        rows = [self.batch.sampling[req_id] for req_id in input_batch.req_ids]
        skip = set(partial_prefill_rows)
        draw_from = [
            False
            if self.host_sampler_only or row.host_reason or index in skip
            else input_batch.generators.get(index, True)
            for index, row in enumerate(rows)
        ]
        return sampling_rows.build(rows, draw_from)

    def _run_step(self, step: RunningStep) -> list[CallOutputs]:
        """Run a step's calls (in the device thread with async scheduling), and start the reads of the
        outputs the step's output needs."""
        if step.previous is not None:
            token_slots.fill_previous_tokens(step)
        step.device_started = time.perf_counter()
        with self.kv_transfer.around(step.scheduler_output) as step.kv_connector_output:
            staging = self.planner.staging
            outputs = [
                CallOutputs(item.batch_rows, *self._run(item.send(staging), item.call), item.call.queries)
                for item in step.planned
            ]
        start_reads(step, outputs)
        step.device_ended = time.perf_counter()
        step.forward_seconds = step.device_ended - step.device_started
        return outputs

    @torch.no_grad()  # one grad mode for warm-up and serving: dynamo guards on it and would recompile
    def _run(self, inputs: CallInputs, call: Call) -> tuple[torch.Tensor, ...]:
        """One compiled call; returns its outputs (ForwardAndSample's)."""
        recorder = self.compiled.recorder
        recorder.current_call = call
        if self.serving and self.step_metrics.records_traffic:
            self.stats.record(call)
        start, graphs = time.perf_counter(), recorder.num_graphs
        try:
            outputs = self.compiled.forward(inputs)
        except Exception as error:
            # A Neuron runtime error says nothing of our shapes: name the call (phase and bucket).
            logger.error("Compiled call failed: %s: %s", call, error)
            raise
        if recorder.num_graphs > graphs:
            metrics.COMPILE_SECONDS.labels(phase=call.phase).inc(time.perf_counter() - start)
        return outputs

    @torch.no_grad()
    def sample_tokens(self, grammar_output: "GrammarOutput | None") -> ModelRunnerOutput | StepOutput:
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
        drafting = self.serving and (self.compiled.draft is not None or self.drafter is not None)
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
                step, sampled_ids, self.batch, speculating, self.planner, self._run_draft
            )
        if self.drafter is not None and self.serving:
            wanted = step.scheduler_output.num_spec_tokens_to_schedule
            self.drafter.propose(self.batch.input_batch, step.req_ids, sampled_ids, speculating, wanted)
        step.tokens = collected.tokens
        self.step_metrics.output_made(step, start, to_host.bytes, collected.on_host, self.serving)
        return output

    def _run_draft(self, call: Call, inputs: CallInputs) -> torch.Tensor:
        self.compiled.recorder.current_call = call
        return self.compiled.draft_tokens(inputs)

    def _speculates(self, req_id: str) -> bool:
        request = self.batch.requests[req_id]
        return speculation.speculates(
            request.sampling_params, self.batch.sampling[req_id], self.host_sampler_only
        )

    def _random_draws(self, row: int) -> torch.Generator | bool | None:
        """A verify row's source of uniform draws if its drafts are accepted by their probability (a random
        request that speculates); None otherwise."""
        req_id = self.batch.input_batch.req_ids[row]
        if not self._speculates(req_id) or speculation.is_greedy(self.batch.sampling[req_id]):
            return None
        return self.batch.input_batch.generators.get(row, True)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The draft tokens proposed after the latest step, for the scheduler (None: speculation off)."""
        if self.compiled.draft is not None:
            drafts, self._model_drafts = self._model_drafts, None
            return drafts
        return self.drafter.take() if self.drafter is not None else None
