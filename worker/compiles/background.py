"""Staged readiness's background compiles: the graphs warm-up left pending, compiled in threads beside
serving, each joining the runner's usable set once it has run.

The order follows the traffic: the serving thread reports, per step, the work each pending graph would have
saved (`add_demand`), and the next compile is the pending graph with the most saved so far (the bucket set's
order breaks ties, smallest shapes first). Several workers compile at once (`VLLM_NEURON_COMPILE_WORKERS`):
dynamo traces one graph at a time, and the backend's compile runs in another process, in parallel
(neuronx-cc; in CPU mode inductor, vllm_neuron/compiler/compile_pool.py).

Tracing a graph is Python, and a thread running Python holds the GIL for the interpreter's switch interval
(5 ms) whenever another thread asks for it: the serving thread, which takes and releases the GIL around every
op it runs, would then wait up to 5 ms per op (a step of 900 small ops went from 0.1 s to 5 s beside a trace).
So a compile thread yields: while a step runs (`ServingActivity`), dynamo's tracer in that thread runs at most
`SLICE_SECONDS` at a time and then sleeps `REST_SECONDS`, giving the serving thread the GIL; between steps it
runs at full speed. The tracer is paused between two bytecode instructions it traces (a wrapper of dynamo's
`InstructionTranslatorBase.step`, torch's private API: vllm_neuron/upstream/torch_compile.py): a profile hook
in the thread would do the same at every Python call, but made tracing 2.5 times slower.

Shutting down (`shutdown`) cancels the compiles and joins their threads. A thread still running when the
interpreter finalizes is ended by CPython as it next takes the GIL; inside torch's C++ (an op that released
the GIL and takes it back) that unwinding meets a noexcept frame, and std::terminate aborts the process
("terminate called without an active exception"). So the trace stops at its next instruction (the same
wrapper raises `CompileCancelled`), the backend's compile processes are ended (`cancel_compiles`), and what
cannot be cancelled (XLA's compile in the thread) is waited for, at the latest before the interpreter
finalizes.
"""

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_neuron.buckets import GraphKey
from vllm_neuron.upstream import torch_compile

logger = logging.getLogger("vllm.vllm_neuron.background")

# While a step runs, a compile thread traces 3 ms and rests 5 ms (the toy step above: 0.36 s instead of 5 s).
SLICE_SECONDS = 0.003
REST_SECONDS = 0.005


class ServingActivity:
    """Whether the serving thread is in a step (set by the runner from execute_model to sample_tokens), and
    how often compile threads rested for it."""

    def __init__(self) -> None:
        self.busy = threading.Event()
        self.rests = 0


class CompileCancelled(Exception):
    """Raised in a background compile's trace once its compiler shuts down."""


_compile_thread = threading.local()  # .cancelled, .activity and .since in compile threads


def _before_step() -> None:
    cancelled: threading.Event | None = getattr(_compile_thread, "cancelled", None)
    if cancelled is None:
        return
    if cancelled.is_set():
        raise CompileCancelled("background compiles cancelled: the engine is shutting down")
    activity: ServingActivity | None = _compile_thread.activity
    if activity is None:
        return
    now = time.perf_counter()
    if now - _compile_thread.since < SLICE_SECONDS:
        return
    if activity.busy.is_set():
        time.sleep(REST_SECONDS)
        activity.rests += 1
    _compile_thread.since = time.perf_counter()


def _enter_compile_thread(cancelled: threading.Event, activity: ServingActivity | None) -> None:
    """Make dynamo's tracing in the calling thread stop once `cancelled` is set and give way to serving
    (see the module's docstring)."""
    torch_compile.wrap_dynamo_step(_before_step)
    _compile_thread.cancelled, _compile_thread.activity = cancelled, activity
    _compile_thread.since = time.perf_counter()


@dataclass
class CompileProgress:
    """What staged readiness has compiled: read by /v1/neuron/info and the start-up log."""

    total: int
    ready: int
    pending: int
    failed: list[str] = field(default_factory=list)
    seconds_to_ready: float = 0.0  # from warm-up's start to the minimal set
    seconds_to_all: float | None = None  # from warm-up's start to every graph; None while pending


class BackgroundCompiler:
    def __init__(
        self,
        pending: list[GraphKey],
        compile_graph: Callable[[GraphKey], float],
        on_done: Callable[[GraphKey, str | None], None],
        workers: int,
        thread_setup: Callable[[], None] = lambda: None,
        activity: ServingActivity | None = None,
        cancel_compiles: Callable[[], None] = lambda: None,
    ) -> None:
        """`compile_graph` compiles and runs one graph, returning its seconds; `on_done` gets each graph with
        its error (None: compiled, to be made usable);
        `thread_setup` runs first in each worker thread (the serving thread's compile configuration);
        `cancel_compiles` ends the backend's compiles under way and refuses later ones (`shutdown`)."""
        self._order = {graph: index for index, graph in enumerate(pending)}
        self._pending = list(pending)
        self._demand: dict[GraphKey, float] = {}
        self._compile_graph = compile_graph
        self._on_done = on_done
        self._thread_setup = thread_setup
        self._activity = activity
        self._cancel_compiles = cancel_compiles
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._cancelled = threading.Event()
        # Daemon threads, so that an interpreter exit without `shutdown` does not wait for every pending
        # graph: the exit hook below shuts them down instead.
        self._threads = [
            threading.Thread(target=self._work, name=f"neuron-compile-{index}", daemon=True)
            for index in range(min(workers, len(pending)))
        ]
        self.in_flight = 0
        self.done = threading.Event()
        if not pending:
            self.done.set()

    def start(self) -> None:
        _started.add(self)
        for thread in self._threads:
            thread.start()

    def stop(self, wait: bool = False) -> list[GraphKey]:
        """Take no further graph; a compile under way finishes (`wait`: before this returns). Returns the
        graphs left pending."""
        self._stopping.set()
        if wait:
            self._join(None)
        return self.pending

    def shutdown(self, timeout: float | None) -> bool:
        """Stop for good: take no further graph, cancel the compiles under way (a trace at its next
        instruction, the backend's compile processes ended) and join the threads, for at most `timeout`
        seconds (None: until they end). False if a thread still runs."""
        self._stopping.set()
        self._cancelled.set()
        if not self.compiling:
            return True
        self._cancel_compiles()
        if self._join(timeout):
            logger.info("Background compiles stopped, %d graphs left uncompiled", len(self.pending))
            return True
        logger.warning(
            "A background compile did not stop within %.0f s; the process waits for it at exit", timeout
        )
        return False

    def _join(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    @property
    def compiling(self) -> bool:
        """A compile thread still runs."""
        return any(thread.is_alive() for thread in self._threads)

    @property
    def pending(self) -> list[GraphKey]:
        with self._lock:
            return list(self._pending)

    def add_demand(self, saved: dict[GraphKey, float]) -> None:
        """Work the pending graphs of `saved` would have saved in a step (the serving thread, per step)."""
        with self._lock:
            for graph, amount in saved.items():
                self._demand[graph] = self._demand.get(graph, 0.0) + amount

    def _take(self) -> GraphKey | None:
        with self._lock:
            if not self._pending or self._stopping.is_set():
                return None
            graph = min(self._pending, key=lambda g: (-self._demand.get(g, 0.0), self._order[g]))
            self._pending.remove(graph)
            self.in_flight += 1
            return graph

    def _work(self) -> None:
        self._thread_setup()
        _enter_compile_thread(self._cancelled, self._activity)
        while (graph := self._take()) is not None:
            try:
                self._compile_graph(graph)
            except Exception as error:
                if self._cancelled.is_set():  # shutting down: the graph stays pending, nothing failed
                    logger.debug("Background compile of graph %s cancelled: %s", graph, error)
                    with self._lock:
                        self._pending.append(graph)
                    continue
                # A graph that does not compile is never used; serving goes on.
                logger.exception("Background compile of graph %s failed; it will not be used", graph)
                self._on_done(graph, f"{type(error).__name__}: {error}")
            else:
                self._on_done(graph, None)
            finally:
                with self._lock:
                    self.in_flight -= 1
                    finished = not self._pending and not self.in_flight
                if finished:
                    self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every graph is compiled (or failed); False on timeout."""
        return self.done.wait(timeout)


# Compilers started in this process. An engine shuts its own down (worker/compiles/readiness.py:
# Readiness.stop); one whose engine never did (an in-process LLM at a script's end) is shut down, and its
# threads joined, before the interpreter finalizes (atexit handlers run first, while daemon threads still
# run).
_started: "weakref.WeakSet[BackgroundCompiler]" = weakref.WeakSet()


@atexit.register
def _shut_down_at_exit() -> None:
    for compiler in list(_started):
        compiler.shutdown(None)


def compile_workers(requested: int, neuron: bool, cpus: int) -> int:
    """Compiles at once: `requested`, or by default one per 16 host CPUs (1 to 8) on Trainium, where each is
    a neuronx-cc process, and 1 in CPU mode, where compiles share the cores serving uses."""
    if requested:
        return requested
    return min(8, max(1, cpus // 16)) if neuron else 1
