"""One scheduler step on static shapes: update the persistent batch, split the step into bucketed calls,
run the compiled model and its sampler (vllm_neuron/sampling.py), and bring the token ids to the host; a step
with a request the graph cannot sample copies its logits to the host for vLLM's Sampler.

Warm-up compiles every graph before serving (VLLM_NEURON_READINESS=full), or (staged, the default) only the
bucket set's minimal graphs, which serve every step; the others then compile in background threads
(worker/background.py) and steps use each once it is ready, so no request waits for a compile."""

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.forward_context import ForwardContext, create_forward_context, override_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.model_loader import get_model
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, LogprobsTensors, ModelRunnerOutput
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask, strip_speculative_padding
from vllm.v1.worker.utils import bind_kv_cache

from kv_cache import layout
from kv_cache.backend import NeuronAttentionMetadata
from vllm_neuron import device as neuron_device
from vllm_neuron import envs, fused_moe, metrics, sampling
from vllm_neuron.buckets import GraphKey
from vllm_neuron.call_costs import PROFILES, profile_for
from vllm_neuron.calls import Call, CallPlan, plan_step
from vllm_neuron.compiler import compile as neuron_compile
from vllm_neuron.config import NeuronConfig
from worker import call_inputs, draft_model, sampling_rows, speculation, warmup
from worker.async_steps import DeviceThread, StepOutput
from worker.background import BackgroundCompiler, CompileProgress, ServingActivity, compile_workers
from worker.call_inputs import CallInputs, Chunk
from worker.input_batch import PersistentBatch
from worker.step_trace import StepTrace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

logger = init_logger("vllm.vllm_neuron.model_runner")


def _full_attention(spec: KVCacheSpec) -> KVCacheSpec:
    """A sliding-window layer's cache is managed as full attention (blocks kept for every position), its
    window applied by the attention masks: one KV cache group, one block table per request, and no block
    swapped for the null block as it leaves the window. Costs KV memory past the window (vLLM does the same
    when its hybrid KV cache manager is off)."""
    if not isinstance(spec, SlidingWindowSpec):
        return spec
    shared = {f.name: getattr(spec, f.name) for f in fields(AttentionSpec)}
    return FullAttentionSpec(**shared, sliding_window=spec.sliding_window)


class ForwardAndSample(torch.nn.Module):
    """What gets compiled: the model forward, the logits of the rows we keep, and a token sampled from each
    (with each row's parameters, vllm_neuron/sampling.py). The logits stay on the device unless a step needs
    vLLM's host sampler."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        sampling_params: torch.Tensor,
        forward_context: ForwardContext,
    ) -> tuple[torch.Tensor, ...]:
        # vLLM's layers read the forward context from a global; set here, in the traced code, dynamo takes
        # the attention metadata from this argument, so serving and a background compile, in two threads,
        # each run with their own.
        with override_forward_context(forward_context):
            hidden = self.model(input_ids=input_ids, positions=positions)
            logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        sampled = sampling.sample(logits, sampling_params)
        return (
            logits,
            sampled.token_ids,
            sampled.logprob_token_ids,
            sampled.logprobs,
            sampled.ranks,
            sampled.draft_probs,
        )


@dataclass
class CallOutputs:
    """A compiled call's outputs (device tensors), for the batch rows its first rows are."""

    batch_rows: list[int]
    logits: torch.Tensor
    token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    draft_probs: torch.Tensor
    queries: int = 1  # logits rows a batch row has (a verify call's: its last token's, then its drafts')

    def real(self, tensor: torch.Tensor) -> torch.Tensor:
        """The batch rows' outputs: of each row's first query (a verify row's last token)."""
        return tensor[: len(self.batch_rows) * self.queries : self.queries]

    def all_queries(self, tensor: torch.Tensor) -> torch.Tensor:
        """[batch rows, queries, ...]: every query's output (a verify call's)."""
        rows = len(self.batch_rows)
        return tensor[: rows * self.queries].view(rows, self.queries, *tensor.shape[1:])


class _ToHost:
    """Device-to-host copies of one step, counted in bytes."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += tensor.numel() * tensor.element_size()
        return neuron_device.to_host(tensor)


@dataclass
class _PlannedCall:
    """One compiled call of a step, its inputs on the device, and the batch rows of its first logits rows."""

    call: Call
    inputs: CallInputs
    params: torch.Tensor
    batch_rows: list[int]
    # Decode rows whose token is the previous step's sample, not yet on the host when the call was prepared:
    # (index in input_ids, request id), filled in on the device thread.
    fills: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class _Step:
    """A step from execute_model until its output is made: its calls run (on the device thread with async
    scheduling), then sample_tokens or, with async scheduling, the engine or the next step asks for its
    output (the grammar bitmask arrives in between). Times are time.perf_counter()."""

    scheduler_output: "SchedulerOutput"
    planned: list[_PlannedCall]
    partial_prefill_rows: list[int]
    # The batch as the step was prepared (the next step may update it before this one's output is made).
    req_ids: list[str]
    host_rows: list[bool]  # rows that need vLLM's host sampler: their logits come to the host
    num_logprobs: int | None  # the most logprobs a row asks for (None: no row asks)
    started: float  # execute_model
    schedule_seconds: float | None  # the engine's time since the previous step (None: it may have idled)
    prepare_seconds: float = 0.0
    outputs: list[CallOutputs] | Future = field(default_factory=list)  # in call order: later rows win
    forward_seconds: float = 0.0
    device_started: float = 0.0
    device_ended: float = 0.0
    grammar_output: "GrammarOutput | None" = None
    result: ModelRunnerOutput | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    figures: "_StepFigures | None" = None  # what /metrics and the step trace get, once the output is made
    tokens: np.ndarray | None = None  # each row's token, once the output is made
    tokens_ready: threading.Event = field(default_factory=threading.Event)  # set then (or on failure)
    # The step still running when this one was prepared, and its outputs: fills come from them.
    previous: "_Step | None" = None
    previous_outputs: "list[CallOutputs] | Future | None" = None
    drafts: dict[int, list[int]] = field(default_factory=dict)  # batch row -> the draft tokens it verifies

    @property
    def host_bound(self) -> bool:
        return any(self.host_rows)


@dataclass
class _StepFigures:
    ended: float  # time.perf_counter() when the output was made
    sample_seconds: float
    host_seconds: float | None  # the device's idle time since the previous step's calls (None: not after one)
    to_host_bytes: int
    sampled_on_host: bool


@dataclass
class _ReleasedTensor:
    """A weight or buffer while sleep mode has released it: its awake place and layout, and whether its data
    was kept (in host memory) or discarded (sleep level 2's weights)."""

    tensor: torch.Tensor
    device: torch.device
    size: torch.Size
    stride: tuple[int, ...]
    kept: bool


class NeuronModelRunner:
    def __init__(self, vllm_config: "VllmConfig", device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.neuron_config = NeuronConfig.from_vllm_config(vllm_config)
        self.buckets = self.neuron_config.buckets
        self.block_size = vllm_config.cache_config.block_size
        self.batch = PersistentBatch(vllm_config, self.block_size)
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        self.host_sampler_only = sampling_rows.host_only(self.model_config)
        self.model: torch.nn.Module | None = None
        self.compiled_step = None
        self.recorder: neuron_compile.CompileRecorder | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.attention_layers: list[str] = []
        self.kv_cache_config: KVCacheConfig | None = None
        self.sleeping: set[str] = set()  # sleep mode: "weights" and/or "kv_cache" while released
        self._weights_released: list[_ReleasedTensor] = []
        self.stats = metrics.CallStats()
        self.step_calls: list[Call] = []  # the calls of the latest step (tests, debugging, the step trace)
        self.serving = False  # warm-up calls are not traffic: tally calls only once it is over
        # The graphs steps may use: every graph once warm-up is over, or while staged readiness compiles in
        # the background, those ready so far (replaced, never mutated: the serving thread reads it unlocked).
        self.ready_graphs: frozenset[GraphKey] = frozenset(self.buckets.graphs())
        self.background: BackgroundCompiler | None = None
        self._paused_graphs: list[GraphKey] = []  # background compiles stopped by sleep mode
        self.activity = ServingActivity()  # background compiles give way while a step runs
        self._warmup_started = self._seconds_per_graph = 0.0
        self.compile_workers = compile_workers(
            envs.VLLM_NEURON_COMPILE_WORKERS, neuron_device.mode() == "neuron", os.cpu_count() or 1
        )
        self.progress = CompileProgress(total=self.buckets.num_graphs, ready=0, pending=0)
        self._costs = PROFILES[profile_for(neuron_device.target())]
        # Every rank runs every call; only the driver rank (TP rank 0) records traffic series, so that
        # Prometheus counters count steps once, not once per rank.
        self.tp_rank = get_tensor_model_parallel_rank()
        self.records_traffic = self.tp_rank == 0
        self._pending: _Step | None = None  # between execute_model and sample_tokens
        self._in_flight: _Step | None = None  # async scheduling: sampled on the device, output not yet made
        # Async scheduling (vLLM's default): on Trainium a step's calls run on this thread while the engine
        # schedules the next one and processes the previous one's output (worker/async_steps.py).
        self.device_thread = (
            DeviceThread(threaded=neuron_device.calls_on_a_thread())
            if vllm_config.scheduler_config.async_scheduling
            else None
        )
        # Speculative decoding: the n-gram drafter, or a draft model (worker/draft_model.py), proposes draft
        # tokens after each step; the scheduler takes them.
        self.drafter = speculation.Drafter.for_config(vllm_config)
        speculative = vllm_config.speculative_config
        self.uses_draft_model = speculative is not None and speculative.method == "draft_model"
        self.draft_model: torch.nn.Module | None = None
        self.compiled_draft = None
        self._model_drafts: DraftTokenIds | None = None
        self._step_ended = 0.0  # when the latest step's output was made
        self._execute_returned = 0.0  # when execute_model last returned
        self._unrecorded: _Step | None = None  # made by the next step; recorded once that one's calls run
        self._device_ended = 0.0  # when the latest step's calls finished
        self._memory_sampled_at = 0.0
        trace_path = envs.VLLM_NEURON_STEP_TRACE
        self.trace = StepTrace(trace_path) if trace_path and self.records_traffic else None

    # ---- set-up -------------------------------------------------------------------------------------

    def load_model(self) -> None:
        start = time.perf_counter()
        fused_moe.register()  # before vLLM builds the model's MoE layers
        self.model = get_model(vllm_config=self.vllm_config)
        dump_dir = envs.VLLM_NEURON_DUMP_GRAPHS
        if dump_dir and self.vllm_config.parallel_config.tensor_parallel_size > 1:
            dump_dir = f"{dump_dir}/rank-{self.tp_rank}"
        self.compiled_step, self.recorder = neuron_compile.compile_static(
            ForwardAndSample(self.model),
            neuron_device.compile_backend(),
            self.buckets.num_graphs,
            strict=envs.VLLM_NEURON_STRICT_SHAPES,
            dump_dir=Path(dump_dir) if dump_dir else None,
            compile_workers=self.compile_workers,
        )
        if self.uses_draft_model:
            self.draft_model = draft_model.load_draft_model(self.vllm_config)
            self.compiled_draft, _ = neuron_compile.compile_static(
                draft_model.DraftForward(self.draft_model),
                neuron_device.compile_backend(),
                self.buckets.num_graphs,
                recorder=self.recorder,
            )
        logger.info("Model loaded on %s in %.1f s", self.device, time.perf_counter() - start)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        layers = self.vllm_config.compilation_config.static_forward_context
        return {
            name: _full_attention(spec)
            for name, layer in layers.items()
            if isinstance(layer, Attention)
            and (spec := layer.get_kv_cache_spec(self.vllm_config)) is not None
        }

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config
        caches = self._allocate_kv_cache()
        metrics.KV_BLOCKS_TOTAL.set(kv_cache_config.num_blocks - 1)
        logger.info(
            "KV cache: %d blocks of %d tokens in %d layers",
            kv_cache_config.num_blocks,
            self.block_size,
            len(caches),
        )

    def _allocate_kv_cache(self) -> dict[str, torch.Tensor]:
        """Allocate every layer's cache, zeroed, and bind it to the runner and the attention layers."""
        kv_cache_config = self.kv_cache_config
        caches: dict[str, torch.Tensor] = {}
        for group in kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                spec = group.kv_cache_spec
                if isinstance(spec, UniformTypeKVCacheSpecs):  # a draft model's layers of another size
                    spec = spec.kv_cache_specs[name]
                assert isinstance(spec, AttentionSpec)
                caches[name] = layout.allocate(
                    kv_cache_config.num_blocks,
                    spec.block_size,
                    spec.num_kv_heads,
                    spec.head_size,
                    spec.dtype,
                    self.device,
                    self.recorder.zeros,
                )
        bind_kv_cache(caches, self.vllm_config.compilation_config.static_forward_context, self.kv_caches)
        self.attention_layers = list(caches)  # every call gives each of them the same metadata
        return caches

    def warm_up(self) -> float:
        """Compile the graphs serving needs by pushing synthetic scheduler steps through execute_model, arm
        the recompile guard, and (staged readiness) start compiling the others in the background. Returns
        the seconds until serving may start."""
        start = time.perf_counter()
        staged = envs.VLLM_NEURON_READINESS == "staged"
        one_rank = self.vllm_config.parallel_config.tensor_parallel_size == 1
        if staged and not one_rank:
            # Every rank must plan the same calls, so they must agree on the ready graphs at each step.
            logger.info("Staged readiness needs one rank; with tensor parallelism every graph compiles first")
            staged = False
        # Full readiness with several compiles at once: the minimal graphs through warm-up's steps, then the
        # others in the background threads, all before serving. One rank only: ranks running graphs in
        # several threads could order their collectives differently and wait on each other for ever.
        parallel = not staged and one_rank and self.compile_workers > 1
        first = self.buckets.minimal_graphs() if staged or parallel else self.buckets.graphs()
        pending = [graph for graph in self.buckets.graphs() if graph not in first]
        self.progress = CompileProgress(
            total=self.buckets.num_graphs, ready=0, pending=self.buckets.num_graphs
        )
        self._publish_progress()
        logger.info(
            "Graph plan: %d graphs (%s); %d before serving%s",
            self.buckets.num_graphs,
            ", ".join(f"{phase} {count}" for phase, count in _by_phase(self.buckets.graphs()).items()),
            len(first) if staged else self.buckets.num_graphs,
            f", {len(pending)} in the background" if staged and pending else "",
        )
        seconds, graphs = self._warm_up_graphs(first)
        self.ready_graphs = frozenset(first)
        self._warmup_started, self._seconds_per_graph = start, (time.perf_counter() - start) / len(first)
        if parallel and pending:
            self._start_background(pending)
            self.background.wait()
            self.background = None
            if self.progress.failed:
                raise RuntimeError(f"Warm-up could not compile {'; '.join(self.progress.failed)}")
            pending = []
        self.recorder.armed = True
        self.recorder.on_unexpected = lambda shapes: metrics.UNEXPECTED_RECOMPILES.inc()
        self.serving = True
        metrics.COMPILED_GRAPHS.set(self.recorder.num_graphs)
        for phase, phase_seconds in seconds.items():
            metrics.WARMUP_SECONDS.labels(phase=phase).set(phase_seconds)
        logger.info(
            "Warm-up compiled %d graphs (%s) for %s",
            self.recorder.num_graphs,
            ", ".join(f"{phase} {graphs[phase]} in {seconds[phase]:.1f} s" for phase in graphs),
            self.buckets.describe(),
        )
        ready_seconds = time.perf_counter() - start
        self.progress.seconds_to_ready = ready_seconds
        self.progress.seconds_to_all = None if pending else ready_seconds
        if pending:
            self._start_background(pending)
        self._log_effective_configuration()
        return ready_seconds

    def _warm_up_graphs(self, graphs: list[GraphKey]) -> tuple[dict[str, float], dict[str, int]]:
        """Run the warm-up steps of `graphs`; seconds and new graphs per phase."""
        seconds = dict.fromkeys(_by_phase(graphs), 0.0)
        compiled = dict.fromkeys(_by_phase(graphs), 0)
        steps = warmup.warmup_steps(
            self.buckets,
            max_model_len=self.model_config.max_model_len,
            block_size=self.block_size,
            graphs=graphs,
        )
        for item in steps:
            before, start = self.recorder.num_graphs, time.perf_counter()
            if self.execute_model(item.step) is None:
                self.sample_tokens(None)
            self.execute_model(warmup.finish_step(item.request_ids))
            neuron_device.synchronize()
            seconds[item.phase] += time.perf_counter() - start
            compiled[item.phase] += self.recorder.num_graphs - before
            self._log_lowered(before)
            self.progress.ready += 1
            self.progress.pending -= 1
            self._publish_progress()
            logger.info(
                "Graph %d/%d ready: %s (%.1f s)",
                self.progress.ready,
                self.progress.total,
                _describe((item.phase, *item.shape)),
                time.perf_counter() - start,
            )
        return seconds, compiled

    def _start_background(self, pending: list[GraphKey]) -> None:
        start, seconds_per_graph = self._warmup_started, self._seconds_per_graph
        workers = self.compile_workers
        logger.info(
            "%s on %d graphs; compiling %d more in the background (%d at once), about %.0f s at the "
            "warm-up's %.1f s per graph",
            "Serving" if self.serving else "Warmed up",
            len(self.ready_graphs),
            len(pending),
            workers,
            len(pending) * seconds_per_graph / workers,
            seconds_per_graph,
        )
        lock = threading.Lock()

        def on_done(graph: GraphKey, error: str | None) -> None:
            with lock:
                progress = self.progress
                progress.pending -= 1
                if error is None:
                    self.ready_graphs = self.ready_graphs | {graph}
                    progress.ready += 1
                else:
                    progress.failed.append(f"{_describe(graph)}: {error}")
                if not progress.pending:
                    progress.seconds_to_all = time.perf_counter() - start
            where = "background" if self.serving else f"{workers} at once"
            if error is None:
                logger.info(
                    "Graph %d/%d ready: %s (%s)", progress.ready, progress.total, _describe(graph), where
                )
            if progress.seconds_to_all is not None:
                logger.info("Compiles done %.1f s after warm-up started", progress.seconds_to_all)
                self.recorder.close()  # no compile processes idle beside serving
            self._publish_progress()

        self.background = BackgroundCompiler(
            pending,
            self._compile_in_background,
            on_done,
            workers,
            neuron_compile.compile_config(),
            self.activity,
        )
        self.background.start()

    @torch.no_grad()  # the grad mode serving runs in: dynamo guards on it
    def _compile_in_background(self, graph: GraphKey) -> float:
        """Compile one graph in this (background) thread by running it on synthetic requests whose blocks are
        all the null block, as warm-up does, beside serving. Returns its seconds."""
        call, parts, rows = warmup.synthetic_call(
            graph,
            self.buckets,
            max_model_len=self.model_config.max_model_len,
            blocks_per_request=self.batch.block_table.shape[1],
        )
        start = time.perf_counter()
        inputs = self._inputs(call, parts, rows)
        with self.recorder.expecting(call):
            self._forward(inputs, self._greedy_rows(len(inputs.logits_indices)))
        neuron_device.synchronize()
        seconds = time.perf_counter() - start
        metrics.COMPILE_SECONDS.labels(phase=call.phase).inc(seconds)
        metrics.COMPILED_GRAPHS.set(self.recorder.num_graphs)
        return seconds

    def _publish_progress(self) -> None:
        metrics.GRAPHS_READY.set(self.progress.ready)
        metrics.GRAPHS_PENDING.set(self.progress.pending)

    def compile_progress(self) -> dict[str, object]:
        """Graphs ready and pending (/v1/neuron/info), as this rank compiled them."""
        progress, pool = self.progress, self.recorder.compile_pool if self.recorder else None
        return {
            "readiness": "staged" if self.background is not None else "full",
            "graphs_total": progress.total,
            "graphs_ready": progress.ready,
            "graphs_pending": progress.pending,
            "graphs_failed": list(progress.failed),
            "seconds_to_ready": round(progress.seconds_to_ready, 3),
            "compile_workers": self.compile_workers,
            # inductor (CPU mode): graphs loaded from the compile cache, and compiled in compile processes
            "graphs_from_cache": pool.cache_hits if pool else None,
            "graphs_compiled_in_processes": pool.compiles if pool else None,
            "rests_for_serving": self.activity.rests,
            "seconds_to_all_graphs": None
            if progress.seconds_to_all is None
            else round(progress.seconds_to_all, 3),
        }

    def _log_lowered(self, first: int) -> None:
        """What a Neuron engineer asks of each graph the stablehlo backend lowered since graph `first` (and,
        under xla, of what XLA compiled)."""
        for graph in self.lowered_graphs()[first:]:
            largest = graph["largest_tensor"]
            logger.info(
                "Lowered %s to StableHLO in %.2f s: %d ops, largest intermediate %s %s (%.1f MiB)",
                graph["call"],
                graph["lowering_seconds"],
                graph["stablehlo_ops"],
                largest["dtype"],
                largest["shape"],
                largest["bytes"] / 2**20,
            )
            if "flops" in graph:
                logger.info(
                    "XLA compiled it in %.2f s: %.3g flops, %.3g bytes accessed, %d alias and %d temp bytes, "
                    "caches %s; trn2 estimate %.3f ms per call (minimum %s ms)",
                    graph["xla_compile_seconds"],
                    graph["flops"],
                    graph["bytes_accessed"],
                    graph["alias_bytes"],
                    graph["temp_bytes"],
                    "in place"
                    if graph["caches_in_place"]
                    else f"NOT in place ({graph['cache_problems'][0]})",
                    graph["trn2_estimate_ms"],
                    graph["minimum_ms"],
                )

    def lowered_graphs(self) -> list[dict[str, object]]:
        """Each compiled graph's lowering figures (the stablehlo backend; empty for the others)."""
        lowering = self.recorder.lowering if self.recorder is not None else None
        return [graph.summary() for graph in lowering.graphs] if lowering is not None else []

    def _log_effective_configuration(self) -> None:
        blocks = self.kv_caches[0].shape[1] - 1 if self.kv_caches else 0
        max_len = self.model_config.max_model_len
        logger.info(
            "Ready: %s mode, %d graphs, KV cache %d blocks of %d tokens (%.1f requests of max_model_len %d "
            "at once), max_num_seqs %d, at most %s prefill tokens per step while requests decode",
            neuron_device.mode(),
            self.recorder.num_graphs,
            blocks,
            self.block_size,
            blocks * self.block_size / max_len,
            max_len,
            self.vllm_config.scheduler_config.max_num_seqs,
            self.neuron_config.prefill_tokens_while_decoding or "unlimited",
        )
        if self.host_sampler_only:
            logger.info(
                "Sampling: every step on the host, with vLLM's sampler (VLLM_NEURON_SAMPLER=host "
                "or logits processors)"
            )
        else:
            logger.info(
                "Sampling in the compiled graph: %s; with vLLM's host sampler, on the steps they are in: %s",
                ", ".join(sampling_rows.ON_DEVICE),
                "; ".join(sampling_rows.ON_HOST),
            )

    def shutdown(self) -> None:
        if self.device_thread is not None:
            self.device_thread.close()
        if self.background is not None:
            self.background.stop()
        if self.recorder is not None:
            self.recorder.close()
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    # ---- sleep mode ---------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode. Level 1: free the KV cache (its contents are lost; vLLM resets the prefix cache
        before it sleeps) and move the weights to host memory. Level 2: the same, but the model's weights
        are discarded (buffers and a draft model's weights still move to the host): reload them after wake_up
        (reload_weights). The compiled
        graphs take the weights and the KV cache as inputs and guard on their shapes, strides, dtypes and
        devices only, so wake_up's tensors run them as they are: no recompile."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: the worker sleeps at level 1 or 2")
        self._finish_in_flight()
        # Background compiles run the model on its weights and KV cache: finish the one under way, and
        # take up the others at wake-up.
        if self.background is not None and not self.background.done.is_set():
            self._paused_graphs = self.background.stop(wait=True)
        self.release_kv_cache()
        if "weights" in self.sleeping:
            return
        models = [self.model, *([self.draft_model] if self.draft_model is not None else [])]
        parameters = {id(t): t for model in models for t in model.parameters()}
        buffers = [
            t
            for t in {id(t): t for model in models for t in model.buffers()}.values()
            if id(t) not in parameters
        ]
        # reload_weights loads the target's: a draft model's weights are kept at level 2 too.
        discarded = {id(t) for t in self.model.parameters()} if level == 2 else set()
        self._weights_released = []
        for tensor in [*parameters.values(), *buffers]:
            keep = id(tensor) not in discarded
            self._weights_released.append(
                _ReleasedTensor(tensor, tensor.device, tensor.shape, tensor.stride(), keep)
            )
            if keep:
                tensor.data = neuron_device.to_host(tensor.data)
            else:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        self.sleeping.add("weights")

    def release_kv_cache(self) -> None:
        """Drop every layer's KV cache (the runner and the attention layers hold its only references)."""
        if "kv_cache" in self.sleeping:
            return
        layers = self.vllm_config.compilation_config.static_forward_context
        for name in self.attention_layers:
            layers[name].kv_cache = torch.tensor([])  # what an attention layer holds before bind_kv_cache
        self.kv_caches.clear()
        self.sleeping.add("kv_cache")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep released: the weights to their devices (after level 2: zeroed, to be loaded
        again), and a new zeroed KV cache of as many blocks. `tags` (vLLM's): "weights", "kv_cache", or None
        for both."""
        wanted = set(tags) if tags is not None else {"weights", "kv_cache"}
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown sleep-mode tags {sorted(unknown)}: use 'weights' and 'kv_cache'")
        if "weights" in wanted & self.sleeping:
            for released in self._weights_released:
                tensor, device = released.tensor, released.device
                if released.kept:
                    tensor.data = tensor.data.to(device)
                else:  # level 2: zeros until the weights are loaded again
                    empty = torch.empty_strided(
                        released.size, released.stride, dtype=tensor.dtype, device=device
                    )
                    tensor.data = empty.zero_()
            self._weights_released = []
            self.sleeping.discard("weights")
        if "kv_cache" in wanted & self.sleeping:
            self._allocate_kv_cache()
            self.sleeping.discard("kv_cache")
        neuron_device.synchronize()
        if self._paused_graphs and not self.sleeping:
            paused, self._paused_graphs = self._paused_graphs, []
            self._start_background(paused)

    # ---- one step -----------------------------------------------------------------------------------

    @torch.no_grad()
    def execute_model(self, scheduler_output: "SchedulerOutput") -> ModelRunnerOutput | None:
        # With the calls on a thread of their own (Trainium), this step is prepared while the previous one
        # runs: the decode rows whose token is its sample get it on the device thread, once its calls end, so
        # the device waits only for that copy. Otherwise the previous step's output is made first. Either way
        # its figures are recorded once this step's calls run, off the host's critical path.
        previous = self._in_flight if self._calls_on_a_thread() else None
        if previous is None:
            self._finish_in_flight(record_later=True)
        step_start = time.perf_counter()
        # The engine's time since the previous step (its output made, or with the calls on a thread, since
        # execute_model returned: its output is made later), while requests kept running (not an idle wait).
        continuing = bool(scheduler_output.scheduled_cached_reqs.req_ids) and self._step_ended > 0
        schedule = step_start - max(self._step_ended, self._execute_returned) if continuing else None
        self.activity.busy.set()  # until the step's output is made
        self.batch.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._finish_in_flight(record_later=True)
            self.activity.busy.clear()
            self._record_unrecorded()
            self._execute_returned = time.perf_counter()
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.batch.batch
        decode: list[tuple[int, Chunk]] = []
        prefill: list[tuple[int, Chunk]] = []
        partial: list[int] = []
        fills: dict[int, str] = {}  # batch row -> request id, of rows whose token is still on the device
        drafts = scheduler_output.scheduled_spec_decode_tokens
        row_drafts: dict[int, list[int]] = {}  # batch row -> its drafts, of decode rows to verify
        for row, req_id in enumerate(batch.req_ids):
            count = scheduler_output.num_scheduled_tokens[req_id]
            start = int(batch.num_computed_tokens_cpu[row])
            if count == 1 and start == batch.num_tokens_no_spec[row]:
                if previous is None:
                    raise RuntimeError(f"request {req_id}: its next token is neither known nor being sampled")
                fills[row] = req_id
            if req_id in drafts:  # a decode row to verify: its last token, then its draft tokens
                assert count == 1 + len(drafts[req_id]), (req_id, count, drafts[req_id])
                # vLLM's scheduler pads a request that joins as a decode row (its whole prompt cached)
                # with -1 placeholders: no draft to check, all rejected.
                real = strip_speculative_padding(drafts[req_id])
                token_ids = np.array([batch.token_ids_cpu[row, start], *real], dtype=np.int64)
                if real:
                    row_drafts[row] = real
            else:
                token_ids = batch.token_ids_cpu[row, start : start + count]
            chunk = Chunk(token_ids, start, self.batch.block_table[row])
            (decode if count == 1 or req_id in drafts else prefill).append((row, chunk))
            if start + count < batch.num_tokens_no_spec[row]:
                partial.append(row)  # prefill not finished: this row's sample is discarded

        parameters = self._sampling_parameters(partial)
        planned = self._plan_calls(decode, prefill, parameters, fills, row_drafts)
        host_rows = [
            self.host_sampler_only or self.batch.sampling[req_id].host_reason is not None
            for req_id in batch.req_ids
        ]
        logprobs = batch.sampling_metadata.max_num_logprobs
        step = _Step(
            scheduler_output, planned, partial, list(batch.req_ids), host_rows, logprobs, step_start, schedule
        )
        step.drafts = row_drafts
        if fills:
            step.previous, step.previous_outputs = previous, previous.outputs
        self.step_calls = [item.call for item in planned]
        step.prepare_seconds = time.perf_counter() - step_start
        self._pending = step
        if self.device_thread is not None and self.serving:
            step.outputs = self.device_thread.submit(lambda: self._run_step(step))
        else:
            step.outputs = self._run_step(step)
        self._finish_in_flight(record_later=True)  # the previous step, while this one's calls run
        self._record_unrecorded()
        if self.serving and self.records_traffic:
            self._sample_usage(step_start)
        self._execute_returned = time.perf_counter()
        return None

    def _calls_on_a_thread(self) -> bool:
        return self.device_thread is not None and self.device_thread.threaded and self.serving

    def _sampling_parameters(self, partial_prefill_rows: list[int]) -> np.ndarray:
        """[rows, sampling.PARAMS]: each batch row's sampling parameters and uniform draw. A row the host
        samples, or whose sample is discarded, draws nothing: a seeded request's generator advances once per
        token the graph samples for it."""
        batch = self.batch.batch
        rows = [self.batch.sampling[req_id] for req_id in batch.req_ids]
        skip = set(partial_prefill_rows)
        draw_from = [
            False
            if self.host_sampler_only or row.host_reason or index in skip
            else batch.generators.get(index, True)
            for index, row in enumerate(rows)
        ]
        return sampling_rows.parameter_rows(rows, draw_from)

    def _greedy_rows(self, rows: int) -> torch.Tensor:
        """Sampling parameters of `rows` greedy rows (warm-up's synthetic calls, padding)."""
        return torch.zeros(rows, sampling.PARAMS, dtype=torch.float32, device=self.device)

    def _sample_usage(self, now: float) -> None:
        """KV blocks held by the batch's requests, and device memory (at most once a second)."""
        batch = self.batch.batch
        blocks = self.batch.block_table[: batch.num_reqs]
        metrics.KV_BLOCKS_USED.set(len(np.unique(blocks[blocks != layout.NULL_BLOCK])))
        if now - self._memory_sampled_at >= 1.0:
            self._memory_sampled_at = now
            metrics.DEVICE_MEMORY_USED.set(neuron_device.memory_in_use())
            metrics.sample_process("engine")

    def _plan_calls(
        self,
        decode: list[tuple[int, Chunk]],
        prefill: list[tuple[int, Chunk]],
        parameters: np.ndarray,
        fills: dict[int, str],
        drafts: dict[int, list[int]],
    ) -> list[_PlannedCall]:
        """The step's calls as `calls.plan_step` plans them, with their inputs on the device; each samples
        the rows of its requests (a sub-chunk's row is sampled again by the next: the last part of a chunk
        gives its token; a verify call samples every query of its rows). `fills`: decode rows (batch row ->
        request id) whose token the device thread fills in; `drafts`: decode rows' draft tokens (batch row
        -> drafts): the decode rows run in verify calls."""
        verify = bool(drafts)
        contexts = [chunk.start + len(chunk.token_ids) for _, chunk in decode]
        chunks = [(chunk.start, len(chunk.token_ids)) for _, chunk in prefill]
        ready = self.ready_graphs
        staging = self.background is not None and len(ready) < self.progress.total
        plans = plan_step(
            contexts, chunks, self.buckets, self.block_size, ready if staging else None, verify=verify
        )
        if staging and self.serving:
            ideal = plan_step(contexts, chunks, self.buckets, self.block_size, verify=verify)
            self._report_demand(plans, ideal, ready)
        planned = []
        for plan in plans:
            parts = []
            for index, start, length in plan.parts:
                chunk = prefill[index][1]
                offset = start - chunk.start
                parts.append(Chunk(chunk.token_ids[offset : offset + length], start, chunk.block_row))
            rows = [decode[index][1] for index in plan.decode_rows]
            inputs = self._inputs(plan.call, parts, rows)
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
                req_id = self.batch.batch.req_ids[row]
                if row in drafts and self._speculates(req_id) and not self._greedy(req_id):
                    source = self.batch.batch.generators.get(row, True)
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
            planned.append(_PlannedCall(plan.call, inputs, params, batch_rows, call_fills))
        return planned

    def _run_step(self, step: _Step) -> list[CallOutputs]:
        """Run a step's calls (in the device thread with async scheduling); their outputs stay on the
        device."""
        if step.previous is not None:
            self._fill_previous_tokens(step)
        step.device_started = time.perf_counter()
        outputs = []
        for item in step.planned:
            outputs.append(
                CallOutputs(
                    item.batch_rows, *self._run(item.inputs, item.params, item.call), item.call.queries
                )
            )
        step.device_ended = time.perf_counter()
        step.forward_seconds = step.device_ended - step.device_started
        return outputs

    def _fill_previous_tokens(self, step: _Step) -> None:
        """On the device thread, once the previous step's calls ended: its samples into this step's decode
        rows that wait for them. A row the graph left to the host (NO_TOKEN) waits for that step's output."""
        previous, outputs = step.previous, step.previous_outputs
        step.previous = step.previous_outputs = None  # no chain of steps kept alive
        if isinstance(outputs, Future):
            outputs = outputs.result()
        final = _final_rows(outputs)
        row_of = {req_id: row for row, req_id in enumerate(previous.req_ids)}
        wanted = {row_of[req_id] for item in step.planned for _, req_id in item.fills}
        tokens: dict[int, int] = {}
        for call_index in sorted({final[row][0] for row in wanted}):
            out = outputs[call_index]
            sampled = neuron_device.to_host(out.real(out.token_ids)).tolist()
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
                item.inputs.input_ids = torch.from_numpy(input_ids).to(self.device)

    def _report_demand(
        self, plans: list[CallPlan], ideal: list[CallPlan], ready: frozenset[GraphKey]
    ) -> None:
        """What the step would have saved with every graph (estimated call costs), shared among the pending
        graphs it would have used: the background compiles those first."""
        missing = {plan.call.graph for plan in ideal} - ready
        if not missing:
            return
        page = self.buckets.page_tokens
        saved = sum(self._costs.of(p.call, page) for p in plans) - sum(
            self._costs.of(p.call, page) for p in ideal
        )
        self.background.add_demand(dict.fromkeys(missing, max(saved, 0.0) / len(missing)))

    def _inputs(self, call: Call, parts: list[Chunk], rows: list[Chunk]) -> CallInputs:
        if call.phase == "prefill":
            return call_inputs.prefill_inputs(
                parts,
                token_bucket=call.token_bucket,
                context_bucket=call.context,
                block_size=self.block_size,
                device=self.device,
            )
        pages = self.buckets.decode_pages(call.batch, call.context)
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

    @torch.no_grad()  # one grad mode for warm-up and serving: dynamo guards on it and would recompile
    def _run(self, inputs: CallInputs, params: torch.Tensor, call: Call) -> tuple[torch.Tensor, ...]:
        """One compiled call; returns its outputs (ForwardAndSample's)."""
        self.recorder.current_call = call
        if self.serving and self.records_traffic:
            self.stats.record(call)
        start, graphs = time.perf_counter(), self.recorder.num_graphs
        try:
            outputs = self._forward(inputs, params)
        except Exception as error:
            # A Neuron runtime error says nothing of our shapes: name the call (phase and bucket).
            logger.error("Compiled call failed: %s: %s", call, error)
            raise
        seconds = time.perf_counter() - start
        if self.recorder.num_graphs > graphs:
            metrics.COMPILE_SECONDS.labels(phase=call.phase).inc(seconds)
        return outputs

    def _forward(self, inputs: CallInputs, params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The compiled model and sampler on one call's inputs, then the draft model's on the same inputs
        (its KV cache follows the target's); the outputs (the target's) stay on the device."""
        outputs = self.compiled_step(
            inputs.input_ids, inputs.positions, inputs.logits_indices, params, self._context(inputs.metadata)
        )
        if self.compiled_draft is not None:
            self._draft_forward(inputs)
        return outputs

    def _context(self, metadata: NeuronAttentionMetadata) -> ForwardContext:
        # Every attention layer, the draft model's too, reads the call's metadata: they share block tables.
        return create_forward_context(dict.fromkeys(self.attention_layers, metadata), self.vllm_config)

    def _draft_forward(self, inputs: CallInputs) -> torch.Tensor:
        """The compiled draft model on a call's inputs: each logits row's greedy token, on the device."""
        return self.compiled_draft(
            inputs.input_ids,
            inputs.positions,
            inputs.logits_indices,
            self._context(inputs.metadata.without_masks()),
        )

    @torch.no_grad()
    def sample_tokens(self, grammar_output: "GrammarOutput | None") -> ModelRunnerOutput | StepOutput:
        step, self._pending = self._pending, None
        if step is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        step.grammar_output = grammar_output
        if isinstance(step.outputs, Future) and not step.host_bound and grammar_output is None:
            # Sampled in the graph: the engine goes on while the calls run, and asks for the output later.
            self._in_flight = step
            return StepOutput(lambda: self._finish(step))
        return self._finish(step)

    def _finish_in_flight(self, record_later: bool = False) -> None:
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._finish(step, record_later)

    @torch.no_grad()
    def _finish(self, step: _Step, record_later: bool = False) -> ModelRunnerOutput:
        """Make the step's output once, whoever asks first: the engine (in its output thread with several
        ranks) or the next step (which records its figures after its own calls started)."""
        with step.lock:
            if step.result is None:
                try:
                    if isinstance(step.outputs, Future):
                        step.outputs = step.outputs.result()
                    step.result = self._sample(step)
                except Exception as error:
                    # A device error can surface at the copy of the outputs, after the call returned.
                    calls = "; ".join(str(item.call) for item in step.planned)
                    logger.error("Step failed (its compiled calls: %s): %s", calls, error)
                    raise
                finally:
                    step.tokens_ready.set()
                    if self._pending is None:  # no later step prepared: the device is idle
                        self.activity.busy.clear()
                if record_later:
                    self._unrecorded = step
                else:
                    self._record_step(step)
            return step.result

    def _record_unrecorded(self) -> None:
        step, self._unrecorded = self._unrecorded, None
        if step is not None:
            self._record_step(step)

    def _sample(self, step: _Step) -> ModelRunnerOutput:
        """The step's tokens to the host, vLLM's sampler where a row needs it, and the step's output."""
        start, grammar_output = time.perf_counter(), step.grammar_output
        rows = len(step.req_ids)
        to_host = _ToHost()
        tokens = np.empty(rows, dtype=np.int64)
        for out in step.outputs:
            tokens[out.batch_rows] = to_host(out.real(out.token_ids)).numpy()
        device_logprobs = self._device_logprobs(step, to_host)
        discarded = set(step.partial_prefill_rows)
        overflowed = [
            row
            for row in range(rows)
            if tokens[row] == sampling.NO_TOKEN and row not in discarded and not step.host_rows[row]
        ]
        if overflowed:
            self._complete_overflowed(step, overflowed, tokens, device_logprobs, to_host)
        if step.host_bound:
            if self.batch.batch.req_ids != step.req_ids:
                raise RuntimeError("a step for vLLM's host sampler outlived its batch")
            sampled, logprobs = self._sample_on_host(step, grammar_output, to_host)
            device_rows = [row for row, host in enumerate(step.host_rows) if not host]
            sampled[device_rows] = tokens[device_rows]
            if logprobs is not None and device_logprobs is not None and step.num_logprobs >= 0:
                # The top logprobs are the same raw ones; the sampled token's come from the graph.
                ids, values, ranks = device_logprobs
                for host_values, graph_values in zip(logprobs[:2], (ids, values), strict=True):
                    host_values[device_rows, 0] = graph_values[device_rows, 0].to(host_values.dtype)
                host_ranks = logprobs.selected_token_ranks
                host_ranks[device_rows] = ranks[device_rows].to(host_ranks.dtype)
        else:
            if grammar_output is not None:
                raise RuntimeError("a grammar bitmask for a step the graph sampled: its rows take the host")
            sampled = tokens
            logprobs = None if device_logprobs is None else LogprobsTensors(*device_logprobs)

        sampled_ids = [[token] for token in sampled.tolist()]
        for row in step.partial_prefill_rows:
            sampled_ids[row] = []
        if step.drafts and self.serving:
            # (Warm-up's verify rows end at max_model_len: their one token is all the batch holds.)
            self._accept_drafts(step, sampled_ids, to_host)
        output = ModelRunnerOutput(
            req_ids=list(step.req_ids),
            req_id_to_index={req_id: row for row, req_id in enumerate(step.req_ids)},
            sampled_token_ids=sampled_ids,
            logprobs=logprobs.tolists() if logprobs is not None else None,
            prompt_logprobs_dict={},
        )
        self.batch.append_sampled(step.req_ids, sampled_ids)
        if self.draft_model is not None and self.serving:
            self._propose_with_draft_model(step, sampled_ids)
        if self.drafter is not None and self.serving:
            self.drafter.propose(
                self.batch.batch,
                step.req_ids,
                sampled_ids,
                [self._speculates(req_id) for req_id in step.req_ids],
                step.scheduler_output.num_spec_tokens_to_schedule,
            )
        step.tokens = sampled
        # The host's share: the device's idle time since the previous step's calls ended, while requests kept
        # running (with async scheduling the engine schedules and processes outputs during calls).
        host_seconds = None
        if step.schedule_seconds is not None and self._device_ended:
            host_seconds = step.device_started - self._device_ended
        self._device_ended = step.device_ended
        self._step_ended = ended = time.perf_counter()
        if self.serving and self.records_traffic:
            on_host = step.host_bound or bool(overflowed)
            step.figures = _StepFigures(ended, ended - start, host_seconds, to_host.bytes, on_host)
        return output

    def _speculates(self, req_id: str) -> bool:
        request = self.batch.requests[req_id]
        return speculation.speculates(
            request.sampling_params, self.batch.sampling[req_id], self.host_sampler_only
        )

    def _greedy(self, req_id: str) -> bool:
        """Whether a request's drafts are checked by equality (greedy) rather than by their probability."""
        return speculation.is_greedy(self.batch.sampling[req_id])

    def _accept_drafts(self, step: _Step, sampled_ids: list[list[int]], to_host: _ToHost) -> None:
        """Verify rows' tokens in place of their one token: a greedy row's drafts equal to the target's
        token, then the target's token (speculation.accepted_tokens); a random row's drafts accepted by
        their probability, then the target's token drawn without the first rejected one
        (speculation.accepted_sampled). Only requests that speculate get drafts (speculation.speculates)."""
        generators = self.batch.batch.generators
        for call_index, out in enumerate(step.outputs):
            if out.queries == 1:
                continue
            targets = to_host(out.all_queries(out.token_ids)).numpy()
            draft_probs = None
            for index, row in enumerate(out.batch_rows):
                req_id = step.req_ids[row]
                row_drafts = step.drafts.get(row)
                if not row_drafts or not self._speculates(req_id):
                    continue  # (a request that may not speculate gets no drafts: its one token stands)
                if self._greedy(req_id):
                    sampled_ids[row] = speculation.accepted_tokens(row_drafts, targets[index])
                    continue
                if draft_probs is None:
                    draft_probs = to_host(out.all_queries(out.draft_probs)).numpy()
                row_targets, row_probs = targets[index], draft_probs[index]
                if (row_targets[: len(row_drafts) + 1] == sampling.NO_TOKEN).any():
                    # A top-p cut beyond the graph's candidates: the row's queries again over the whole
                    # vocabulary, with their own parameters and draws.
                    queries = slice(index * out.queries, (index + 1) * out.queries)
                    logits = to_host(out.logits[queries]).float()
                    params = to_host(step.planned[call_index].params[queries])
                    done = sampling.sample(logits, params, candidates=logits.shape[-1])
                    row_targets, row_probs = done.token_ids.numpy(), done.draft_probs.numpy()
                source = generators.get(row, True)
                sampled_ids[row] = speculation.accepted_sampled(row_drafts, row_targets, row_probs, source)

    def _propose_with_draft_model(self, step: _Step, sampled_ids: list[list[int]]) -> None:
        """The draft model's greedy drafts for the step's rows that sampled a token and may speculate: decode
        calls of the draft alone, the first from each row's newest token, each next from the draft before,
        up to the scheduler's number of drafts and the model's length. The scheduler reserved KV slots for
        them (vLLM's lookahead tokens); the draft's cache already holds every earlier position."""
        batch = self.batch.batch
        assert batch.req_ids == step.req_ids, "the batch changed between a step and its drafts"
        wanted = step.scheduler_output.num_spec_tokens_to_schedule
        max_model_len = self.model_config.max_model_len
        drafts: list[list[int]] = [[] for _ in step.req_ids]
        newest: dict[int, int] = {}  # batch row -> its newest token's position
        for row, req_id in enumerate(step.req_ids):
            position = int(batch.num_tokens_no_spec[row]) - 1
            if sampled_ids[row] and self._speculates(req_id) and position < max_model_len - 1:
                newest[row] = position
        staging = self.background is not None and len(self.ready_graphs) < self.progress.total
        for index in range(wanted):
            rows = [row for row, position in newest.items() if position + index < max_model_len - 1]
            chunks = [
                Chunk(
                    np.array([drafts[row][-1] if index else batch.token_ids_cpu[row, newest[row]]]),
                    newest[row] + index,
                    self.batch.block_table[row],
                )
                for row in rows
            ]
            contexts = [chunk.start + 1 for chunk in chunks]
            ready = self.ready_graphs if staging else None
            for plan in plan_step(contexts, [], self.buckets, self.block_size, ready):
                inputs = self._inputs(plan.call, [], [chunks[j] for j in plan.decode_rows])
                self.recorder.current_call = plan.call
                tokens = neuron_device.to_host(self._draft_forward(inputs)[: len(plan.decode_rows)])
                for j, token in zip(plan.decode_rows, tokens.tolist(), strict=True):
                    drafts[rows[j]].append(token)
        self._model_drafts = DraftTokenIds(list(step.req_ids), drafts)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The draft tokens proposed after the latest step, for the scheduler (None: speculation off)."""
        if self.draft_model is not None:
            drafts, self._model_drafts = self._model_drafts, None
            return drafts
        return self.drafter.take() if self.drafter is not None else None

    def _record_step(self, step: _Step) -> None:
        """The step's parts on /metrics and in the step trace."""
        figures = step.figures
        if figures is None:  # warm-up, or a rank that records no traffic
            return
        sample_seconds, host_seconds, host = (
            figures.sample_seconds,
            figures.host_seconds,
            figures.sampled_on_host,
        )
        to_host_bytes = figures.to_host_bytes
        parts = {"prepare": step.prepare_seconds, "forward": step.forward_seconds, "sample": sample_seconds}
        parts |= {"schedule": step.schedule_seconds, "host": host_seconds}
        for part, seconds in parts.items():
            if seconds is not None:
                metrics.STEP_SECONDS.labels(part=part).observe(seconds)
        metrics.DEVICE_TO_HOST_BYTES.observe(to_host_bytes)
        metrics.SAMPLED_STEPS.labels(sampler="host" if host else "device").inc()
        if self.trace is not None:
            self.trace.record(
                step.started,
                figures.ended,
                [str(item.call) for item in step.planned],
                decode_rows=sum(item.call.rows for item in step.planned),  # verify rows too
                prefill_tokens=sum(item.call.tokens for item in step.planned),
                prepare_s=step.prepare_seconds,
                forward_s=step.forward_seconds,
                sample_s=sample_seconds,
                host_s=host_seconds,
                to_host_bytes=to_host_bytes,
                sampler="host" if host else "device",
            )

    def _device_logprobs(
        self, step: _Step, to_host: _ToHost
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The graph's logprobs of each row (token ids, logprobs, ranks), as many as the batch asks for (the
        sampled token's and up to LOGPROBS_CAP top ones); None if no request asked."""
        if step.num_logprobs is None:
            return None
        columns = 1 + min(max(step.num_logprobs, 0), sampling.LOGPROBS_CAP)
        rows = len(step.req_ids)
        ids = torch.zeros(rows, columns, dtype=torch.int64)
        values = torch.zeros(rows, columns, dtype=torch.float32)
        ranks = torch.zeros(rows, dtype=torch.int64)
        for out in step.outputs:
            ids[out.batch_rows] = to_host(out.real(out.logprob_token_ids)[:, :columns]).long()
            values[out.batch_rows] = to_host(out.real(out.logprobs)[:, :columns])
            ranks[out.batch_rows] = to_host(out.real(out.ranks)).long()
        return ids, values, ranks

    def _complete_overflowed(
        self,
        step: _Step,
        rows: list[int],
        tokens: np.ndarray,
        device_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        to_host: _ToHost,
    ) -> None:
        """Rows whose top-p cut lay beyond the graph's candidates (NO_TOKEN): the same sampler on the host,
        over the whole vocabulary, with each row's parameters and uniform draw (so a seeded request's
        generator advances once either way). Writes their tokens and logprobs in place."""
        final = _final_rows(step.outputs)
        logits, params = [], []
        for row in rows:
            call_index, j = final[row]
            logits.append(to_host(step.outputs[call_index].logits[j : j + 1]).float())
            params.append(to_host(step.planned[call_index].params[j : j + 1]))
        logits = torch.cat(logits)
        done = sampling.sample(logits, torch.cat(params), candidates=logits.shape[-1])
        tokens[rows] = done.token_ids.numpy()
        if device_logprobs is not None:
            ids, values, ranks = device_logprobs
            columns = ids.shape[1]
            ids[rows] = done.logprob_token_ids[:, :columns].long()
            values[rows] = done.logprobs[:, :columns]
            ranks[rows] = done.ranks.long()

    def _sample_on_host(
        self, step: _Step, grammar_output: "GrammarOutput | None", to_host: _ToHost
    ) -> tuple[np.ndarray, LogprobsTensors | None]:
        """vLLM's Sampler over the step's logits, copied to the host; returns every row's token and logprobs
        (the rows the graph sampled keep its tokens: the caller puts them back)."""
        batch = self.batch.batch
        logits = torch.empty(batch.num_reqs, self.model_config.get_vocab_size(), dtype=torch.float32)
        for out in step.outputs:
            logits[out.batch_rows] = to_host(out.real(out.logits)).float()
        if grammar_output is not None:
            apply_grammar_bitmask(step.scheduler_output, grammar_output, batch, logits)
        # Generators of the rows whose tokens are not the host's must not advance here: a discarded sample
        # (a prompt chunked differently), or a token the graph sampled (drawn from the generator already).
        kept = set(step.partial_prefill_rows) | {row for row, host in enumerate(step.host_rows) if not host}
        saved_rng = {row: batch.generators[row].get_state() for row in kept if row in batch.generators}
        sampler_output = self.sampler(logits=logits, sampling_metadata=batch.sampling_metadata)
        for row, state in saved_rng.items():
            batch.generators[row].set_state(state)
        sampled = sampler_output.sampled_token_ids[:, 0].numpy().astype(np.int64)
        return sampled, sampler_output.logprobs_tensors


def _final_rows(outputs: list[CallOutputs]) -> dict[int, tuple[int, int]]:
    """Batch row -> (call, row in the call) of the call whose sample is the row's: the last one (a prompt's
    sub-chunks each sample its row; the last part gives its token)."""
    final = {}
    for call_index, out in enumerate(outputs):
        for j, row in enumerate(out.batch_rows):
            final[row] = (call_index, j * out.queries)  # a verify row's first query
    return final


def _by_phase(graphs: list[GraphKey]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for phase, _, _ in graphs:
        counts[phase] = counts.get(phase, 0) + 1
    return counts


def _describe(graph: GraphKey) -> str:
    phase, size, context = graph
    return f"{phase} {'tokens' if phase == 'prefill' else 'batch'} {size} x context {context}"
