"""Async scheduling's two pieces on the runner side: a thread that runs a step's compiled calls, so that
execute_model returns while they run, and the output vLLM's engine waits on only when it needs the tokens.

With vLLM's async scheduler the engine schedules step N+1, and processes step N-1's outputs, while step N
runs. The runner prepares N+1 once N's tokens are on the host (its decode rows' input tokens are N's
samples): what stays on the host's critical path, with the device idle, is the copy of N's token ids and
N+1's input preparation. On Trainium the calls go to a thread of their own, so that execute_model returns
while the device runs them. In CPU mode they run in the caller's thread: the device is the host's cores,
and a second thread doing torch work gets an OpenMP team of its own, which throttles both teams' spinning
(more OpenMP threads than cores): a batch-1 decode call took 57 ms on the thread against 38 ms inline.
VLLM_NEURON_DEVICE_THREAD=on runs Trainium's arrangement in CPU mode, for its tests and to measure the
host time it leaves between calls."""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput


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
