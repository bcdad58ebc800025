"""Async scheduling's pieces on the runner side: a thread that runs a step's compiled calls, so that
execute_model returns while they run, the output vLLM's engine waits on only when it needs the tokens, and
the steps under way between execute_model and their figures on /metrics.

With vLLM's async scheduler the engine schedules step N+1, and processes step N-1's outputs, while step N
runs. The runner prepares N+1 once N's tokens are on the host (its decode rows' input tokens are N's
samples): what stays on the host's critical path, with the device idle, is the copy of N's token ids and
N+1's input preparation. On Trainium the calls go to a thread of their own, so that execute_model returns
while the device runs them. In CPU mode they run in the caller's thread: the device is the host's cores,
and a second thread doing torch work gets an OpenMP team of its own, which throttles both teams' spinning
(more OpenMP threads than cores) and makes each call slower than inline.
VLLM_NEURON_DEVICE_THREAD=on runs Trainium's arrangement in CPU mode, for its tests and to measure the
host time it leaves between calls."""

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
)

from worker.step.step_state import RunningStep

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput


logger = init_logger("vllm.vllm_neuron.async_steps")


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
