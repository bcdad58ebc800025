"""A JSON-lines trace of scheduler steps (VLLM_NEURON_STEP_TRACE), for finding what makes a slow token.

Each served step appends one line: when it ended (wall clock, so it lines up with client-side token
times), its compiled calls, its decode rows and prefill tokens, the milliseconds of each part, the
milliseconds between the end of the previous step and the start of this one (the engine's own work:
scheduling, output processing, messages to the API server, and any wait for the CPU or for requests), the
host's share (the device's idle time since the previous step's calls, while requests kept running), the
bytes copied from the device, the transfers to it (one per call: its packed inputs), the decode rows whose
token came through the host (worker/step/step_state.py: the rest took the previous step's on the device), and
where the step sampled (device: the graph; host: vLLM's sampler).
"""

import json
import time
from pathlib import Path


class StepTrace:
    def __init__(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (open until close(), at worker shutdown)
        self._previous_end: float | None = None

    def record(
        self,
        start: float,
        end: float,
        calls: list[str],
        decode_rows: int,
        prefill_tokens: int,
        prepare_s: float,
        forward_s: float,
        sample_s: float,
        host_s: float | None,
        to_host_bytes: int,
        to_device_transfers: int,
        tokens_from_host: int,
        sampler: str,
    ) -> None:
        """One step that started at `start` and ended at `end` (time.perf_counter(); with async scheduling
        a step is recorded once the next one's calls run)."""
        between = None if self._previous_end is None else 1e3 * (start - self._previous_end)
        self._previous_end = end
        line = {
            "time": round(time.time() - (time.perf_counter() - end), 4),
            "calls": calls,
            "decode_rows": decode_rows,
            "prefill_tokens": prefill_tokens,
            "prepare_ms": round(1e3 * prepare_s, 2),
            "forward_ms": round(1e3 * forward_s, 2),
            "sample_ms": round(1e3 * sample_s, 2),
            "step_ms": round(1e3 * (end - start), 2),
            "since_previous_ms": None if between is None else round(between, 2),
            "host_ms": None if host_s is None else round(1e3 * host_s, 3),
            "to_host_bytes": to_host_bytes,
            "to_device_transfers": to_device_transfers,
            "tokens_from_host": tokens_from_host,
            "sampler": sampler,
        }
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        """Called at worker shutdown; the lines are already written (line-buffered)."""
        self._file.close()
