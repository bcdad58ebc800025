"""What each served step leaves on /metrics (vllm_neuron:* series) and in the step trace
(VLLM_NEURON_STEP_TRACE): its parts' seconds, the bytes it copied to the host, where it sampled, and the KV
blocks and device memory in use. Only the driver rank (TP rank 0) records, so that Prometheus counters count
steps once, not once per rank. Times are time.perf_counter()."""

import time
from typing import TYPE_CHECKING

import numpy as np

from kv_cache import layout
from vllm_neuron import device as neuron_device
from vllm_neuron import envs, metrics
from vllm_neuron.calls import Call
from worker.metrics.step_trace import StepTrace
from worker.step.step_state import StepFigures

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from worker.step.step_state import RunningStep


class StepMetrics:
    def __init__(self, records_traffic: bool) -> None:
        self.records_traffic = records_traffic
        path = envs.VLLM_NEURON_STEP_TRACE
        self.trace = StepTrace(path) if path and records_traffic else None
        self._memory_sampled_at = 0.0
        self._step_ended = 0.0  # when the latest step's output was made
        self._execute_returned = 0.0  # when execute_model last returned
        self._device_ended = 0.0  # when the latest step's calls finished

    def step_started(self, scheduler_output: "SchedulerOutput") -> tuple[float, float | None]:
        """A step's start, and the engine's time since the previous step (its output made, or with the calls
        on a thread, since execute_model returned: its output is made later), while requests kept running
        (None: it may have idled)."""
        start = time.perf_counter()
        continuing = bool(scheduler_output.scheduled_cached_reqs.req_ids) and self._step_ended > 0
        return start, start - max(self._step_ended, self._execute_returned) if continuing else None

    def execute_returned(self) -> None:
        self._execute_returned = time.perf_counter()

    def output_made(
        self, step: "RunningStep", started: float, to_host_bytes: int, on_host: bool, serving: bool
    ) -> None:
        """The step's output is made (its making `started`): its figures, once serving. The host's share is
        the device's idle time since the previous step's calls ended, while requests kept running (with
        async scheduling the engine schedules and processes outputs during calls)."""
        host_seconds = None
        if step.schedule_seconds is not None and self._device_ended:
            host_seconds = step.device_started - self._device_ended
        self._device_ended = step.device_ended
        self._step_ended = ended = time.perf_counter()
        if serving and self.records_traffic:
            step.figures = StepFigures(ended, ended - started, host_seconds, to_host_bytes, on_host)

    def record(self, step: "RunningStep") -> None:
        """The step's parts on /metrics and in the step trace."""
        figures = step.figures
        if figures is None:  # warm-up, or a rank that records no traffic
            return
        host = figures.sampled_on_host
        parts = {
            "prepare": step.prepare_seconds,
            "forward": step.forward_seconds,
            "sample": figures.sample_seconds,
        }
        parts |= {"schedule": step.schedule_seconds, "host": figures.host_seconds}
        for part, seconds in parts.items():
            if seconds is not None:
                metrics.STEP_SECONDS.labels(part=part).observe(seconds)
        metrics.DEVICE_TO_HOST_BYTES.observe(figures.to_host_bytes)
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
                sample_s=figures.sample_seconds,
                host_s=figures.host_seconds,
                to_host_bytes=figures.to_host_bytes,
                to_device_transfers=len(step.planned),  # each call's packed inputs, sent once
                tokens_from_host=sum(len(item.fills) for item in step.planned),
                sampler="host" if host else "device",
            )

    def sample_usage(self, now: float, block_table: np.ndarray) -> None:
        """KV blocks held by the batch's requests (`block_table`: their rows), and device memory (at most
        once a second)."""
        if not self.records_traffic:
            return
        metrics.KV_BLOCKS_USED.set(len(np.unique(block_table[block_table != layout.NULL_BLOCK])))
        if now - self._memory_sampled_at >= 1.0:
            self._memory_sampled_at = now
            metrics.DEVICE_MEMORY_USED.set(neuron_device.memory_in_use())
            metrics.sample_process("engine")

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None


class CallStats:
    """Per-process tallies of compiled calls while serving, mirrored into their Prometheus series
    (vllm_neuron/metrics.py)."""

    def __init__(self) -> None:
        self.real_tokens = {"prefill": 0, "decode": 0}
        self.slots = {"prefill": 0, "decode": 0}

    def record_propose(self, call: Call) -> None:
        """An EAGLE3 head's propose call of `call`'s decode shape (worker/spec_decode/eagle3.py)."""
        metrics.BUCKET_CALLS.labels(phase="propose", bucket=call.bucket).inc()

    def record(self, call: Call) -> None:
        metrics.BUCKET_CALLS.labels(phase=call.phase, bucket=call.bucket).inc()
        for phase, (real, slots) in call.padding().items():
            self.real_tokens[phase] += real
            self.slots[phase] += slots
            metrics.PADDING_REAL_TOKENS.labels(phase=phase).inc(real)
            metrics.PADDING_SLOTS.labels(phase=phase).inc(slots)
