"""Readiness: the graphs steps may use. Warm-up compiles the graphs serving needs by running synthetic steps
through the runner (VLLM_NEURON_READINESS=full: every graph; staged, the default: the bucket set's minimal
graphs, which serve every step), arms the recompile guard, and with staged readiness compiles the others in
background threads (worker/compiles/background.py) while serving, each usable once it has run. Its progress
counts every graph of the plan (vllm_neuron/graph_plan.py): a draft model's beside each of the model's, NIXL's
block copies (compiled before it starts)."""

import threading
import time
from collections.abc import Callable

from vllm.distributed.kv_transfer import has_kv_transfer_group
from vllm.logger import init_logger

from vllm_neuron import envs, metrics
from vllm_neuron.buckets import BucketConfig, GraphKey
from vllm_neuron.call_costs import CallCosts
from vllm_neuron.calls import CallPlan
from vllm_neuron.compiler import compile as neuron_compile
from vllm_neuron.graph_plan import GraphPlan, staging_refused
from worker.compiles.background import BackgroundCompiler, CompileProgress, ServingActivity
from worker.compiles.warmup import WarmupStep, warmup_steps

logger = init_logger("vllm.vllm_neuron.readiness")

# How long an engine's shutdown waits for its background compiles to stop (Readiness.stop).
STOP_SECONDS = 3.0


class Readiness:
    def __init__(self, buckets: BucketConfig, compile_workers: int, costs: CallCosts) -> None:
        self.buckets = buckets
        self.compile_workers = compile_workers
        self._costs = costs
        # Every graph once warm-up is over, or while staged readiness compiles in the background, those
        # ready so far (replaced, never mutated: the serving thread reads it unlocked).
        self.ready_graphs: frozenset[GraphKey] = frozenset(buckets.graphs())
        # What a step may plan with: the ready graphs while staged readiness compiles the others, None once
        # every graph may be used (set with ready_graphs and the background compiles, _refresh_usable).
        self.usable: frozenset[GraphKey] | None = None
        self.serving = False  # warm-up is over: its calls are not traffic
        self.progress = CompileProgress(total=buckets.num_graphs, ready=0, pending=0)
        self.background: BackgroundCompiler | None = None
        self.activity = ServingActivity()  # background compiles give way while a step runs
        self._paused: list[GraphKey] = []  # background compiles stopped by sleep mode
        self._recorder: neuron_compile.CompileRecorder | None = None
        self._compile_graph: Callable[[GraphKey], None] | None = None
        self._warmup_started = self._seconds_per_graph = 0.0
        self._plan: GraphPlan | None = None  # the rank's graphs (set at warm-up)

    @property
    def staging(self) -> bool:
        """Graphs are still compiling in the background: steps plan with the ready ones only."""
        return self.usable is not None

    def _refresh_usable(self) -> None:
        staging = self.background is not None and len(self.ready_graphs) < self.buckets.num_graphs
        self.usable = self.ready_graphs if staging else None

    def warm_up(
        self,
        recorder: neuron_compile.CompileRecorder,
        run_step: Callable[[WarmupStep], None],
        compile_graph: Callable[[GraphKey], None],
        max_model_len: int,
        block_size: int,
        one_rank: bool,
        plan: GraphPlan,
    ) -> float:
        """Compile the graphs serving needs with `run_step` (a synthetic scheduler step through the runner),
        arm the recompile guard, and (staged readiness) start compiling the others in the background with
        `compile_graph`. `plan`: every graph of the rank, its block copies compiled already. Returns the
        seconds until serving may start."""
        start = time.perf_counter()
        self._recorder, self._compile_graph = recorder, compile_graph
        self._plan = plan
        staged = envs.VLLM_NEURON_READINESS == "staged"
        refused = staging_refused(one_rank, has_kv_transfer_group())
        if staged and refused:
            logger.info("Staged readiness is off (%s): every graph compiles first", refused)
            staged = False
        # Full readiness with several compiles at once: the minimal graphs through warm-up's steps, then the
        # others in the background threads, all before serving. One rank only: ranks running graphs in
        # several threads could order their collectives differently and wait on each other for ever.
        parallel = not staged and one_rank and self.compile_workers > 1
        buckets = self.buckets
        first = buckets.minimal_graphs() if staged or parallel else buckets.graphs()
        pending = [graph for graph in buckets.graphs() if graph not in first]
        copies = plan.block_copies
        self.progress = CompileProgress(total=plan.total, ready=copies, pending=plan.total - copies)
        self._publish_progress()
        logger.info(
            "Graph plan: %d graphs (%s); %d before serving%s",
            plan.total,
            ", ".join(f"{kind} {count}" for kind, count in plan.by_kind().items() if count),
            copies + sum(map(plan.graphs_of, first)) if staged else plan.total,
            f", {sum(map(plan.graphs_of, pending))} in the background" if staged and pending else "",
        )
        seconds, graphs = self._warm_up_graphs(first, run_step, max_model_len, block_size)
        self.ready_graphs = frozenset(first)
        self._refresh_usable()
        self._warmup_started, self._seconds_per_graph = start, (time.perf_counter() - start) / len(first)
        if parallel and pending:
            self._start_background(pending)
            self.background.wait()
            self.background = None
            self._refresh_usable()
            if self.progress.failed:
                raise RuntimeError(f"Warm-up could not compile {'; '.join(self.progress.failed)}")
            pending = []
        recorder.armed = True
        recorder.on_unexpected = lambda shapes: metrics.UNEXPECTED_RECOMPILES.inc()
        self.serving = True
        metrics.COMPILED_GRAPHS.set(recorder.num_graphs)
        for phase, phase_seconds in seconds.items():
            metrics.WARMUP_SECONDS.labels(phase=phase).set(phase_seconds)
        logger.info(
            "Warm-up compiled %d graphs (%s) for %s",
            recorder.num_graphs,
            ", ".join(f"{phase} {graphs[phase]} in {seconds[phase]:.1f} s" for phase in graphs),
            buckets.describe(),
        )
        ready_seconds = time.perf_counter() - start
        self.progress.seconds_to_ready = ready_seconds
        self.progress.seconds_to_all = None if pending else ready_seconds
        if pending:
            self._start_background(pending)
        return ready_seconds

    def _warm_up_graphs(
        self,
        graphs: list[GraphKey],
        run_step: Callable[[WarmupStep], None],
        max_model_len: int,
        block_size: int,
    ) -> tuple[dict[str, float], dict[str, int]]:
        """Run the warm-up steps of `graphs`; seconds and new graphs per phase."""
        recorder = self._recorder
        seconds = dict.fromkeys(_by_phase(graphs), 0.0)
        compiled = dict.fromkeys(_by_phase(graphs), 0)
        for item in warmup_steps(
            self.buckets, max_model_len=max_model_len, block_size=block_size, graphs=graphs
        ):
            before, start = recorder.num_graphs, time.perf_counter()
            run_step(item)
            seconds[item.phase] += time.perf_counter() - start
            compiled[item.phase] += recorder.num_graphs - before
            _log_lowered(lowered_graphs(recorder)[before:])
            graphs_of = self._plan.graphs_of((item.phase, *item.shape))
            self.progress.ready += graphs_of
            self.progress.pending -= graphs_of
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
                progress.pending -= self._plan.graphs_of(graph)
                if error is None:
                    self.ready_graphs = self.ready_graphs | {graph}
                    self._refresh_usable()
                    progress.ready += self._plan.graphs_of(graph)
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
                self._recorder.close()  # no compile processes idle beside serving
            self._publish_progress()

        self.background = BackgroundCompiler(
            pending,
            self._timed_compile,
            on_done,
            workers,
            neuron_compile.compile_config(),
            self.activity,
            self._recorder.cancel,
        )
        self._refresh_usable()
        self.background.start()

    def _timed_compile(self, graph: GraphKey) -> float:
        start = time.perf_counter()
        self._compile_graph(graph)
        seconds = time.perf_counter() - start
        metrics.COMPILE_SECONDS.labels(phase=graph[0]).inc(seconds)
        metrics.COMPILED_GRAPHS.set(self._recorder.num_graphs)
        return seconds

    def report_demand(self, plans: list[CallPlan], ideal: list[CallPlan]) -> None:
        """While staging: what a step would have saved with every graph (`ideal`, estimated call costs),
        shared among the pending graphs it would have used: the background compiles those first."""
        missing = {plan.call.graph for plan in ideal} - self.ready_graphs
        if not missing:
            return
        page = self.buckets.page_tokens
        saved = sum(self._costs.of(p.call, page) for p in plans) - sum(
            self._costs.of(p.call, page) for p in ideal
        )
        self.background.add_demand(dict.fromkeys(missing, max(saved, 0.0) / len(missing)))

    def pause(self) -> None:
        """Sleep mode: finish the background compile under way (it runs the model on its weights and KV
        cache) and keep the others for resume()."""
        if self.background is not None and not self.background.done.is_set():
            self._paused = self.background.stop(wait=True)

    def resume(self) -> None:
        if self._paused:
            paused, self._paused = self._paused, []
            self._start_background(paused)

    def stop(self) -> None:
        """Engine shutdown: cancel the background compiles and join their threads
        (worker/compiles/background.py says why), for at most STOP_SECONDS: vLLM gives an engine process 5 s
        after its SIGTERM (an LLM's default) before it kills it. A compile that could not be cancelled in time
        is waited for at exit."""
        if self.background is not None:
            self.background.shutdown(STOP_SECONDS)

    def _publish_progress(self) -> None:
        metrics.GRAPHS_READY.set(self.progress.ready)
        metrics.GRAPHS_PENDING.set(self.progress.pending)

    def summary(self) -> dict[str, object]:
        """Graphs ready and pending (/v1/neuron/info), as this rank compiled them."""
        progress = self.progress
        pool = self._recorder.compile_pool if self._recorder else None
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


def lowered_graphs(recorder: neuron_compile.CompileRecorder | None) -> list[dict[str, object]]:
    """Each compiled graph's lowering figures (the stablehlo and xla backends; empty for the others)."""
    lowering = recorder.lowering if recorder is not None else None
    return [graph.summary() for graph in lowering.graphs] if lowering is not None else []


def _log_lowered(graphs: list[dict[str, object]]) -> None:
    """What a Neuron engineer asks of each graph the stablehlo backend lowered (and, under xla, of what XLA
    compiled)."""
    for graph in graphs:
        largest = graph["largest_tensor"]
        rules = graph["neuronx_cc_rules"]
        logger.info(
            "Lowered %s to StableHLO in %.2f s: %d ops, largest intermediate %s %s (%.1f MiB); "
            "neuronx-cc's rules: %d checked, %s",
            graph["call"],
            graph["lowering_seconds"],
            graph["stablehlo_ops"],
            largest["dtype"],
            largest["shape"],
            largest["bytes"] / 2**20,
            rules["checked"],
            "all hold" if not rules["broken"] else "; ".join(rules["broken"]),
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
                "in place" if graph["caches_in_place"] else f"NOT in place ({graph['cache_problems'][0]})",
                graph["trn2_estimate_ms"],
                graph["minimum_ms"],
            )


def _by_phase(graphs: list[GraphKey]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for phase, _, _ in graphs:
        counts[phase] = counts.get(phase, 0) + 1
    return counts


def _describe(graph: GraphKey) -> str:
    phase, size, context = graph
    if phase == "prefill" and not context:
        return f"fresh prefill tokens {size}"
    return f"{phase} {'tokens' if phase == 'prefill' else 'batch'} {size} x context {context}"
