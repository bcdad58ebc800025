"""VLLM_NEURON_STEP_TRACE's file: one JSON line per step, written as it happens, closed at worker shutdown.
(tests/engine/test_server.py checks the lines a served request leaves.)"""

import json
import time

import pytest

from tests.conftest import model_runner
from worker.metrics.step_trace import StepTrace


def test_each_record_is_a_line_on_disk_at_once_and_close_closes_the_file(tmp_path):
    path = tmp_path / "trace" / "steps.jsonl"
    trace = StepTrace(str(path))
    start = time.perf_counter()
    trace.record(start, start + 0.004, ["decode"], 1, 0, 0.001, 0.002, 0.0005, 0.0017, 4, 1, 0, "device")
    [line] = path.read_text().splitlines()  # line-buffered: nothing waits for close
    step = json.loads(line)
    assert step["calls"] == ["decode"] and (step["step_ms"], step["host_ms"]) == (4.0, 1.7)
    assert (step["to_host_bytes"], step["to_device_transfers"], step["sampler"]) == (4, 1, "device")
    trace.close()
    assert trace._file.closed


@pytest.mark.slow
def test_the_runner_closes_its_trace_at_shutdown(llm, tmp_path):
    from tests.engine.test_engine import generate_ids, greedy

    runner = model_runner(llm)
    assert runner.step_metrics.trace is None  # the shared engine traces nothing
    trace = runner.step_metrics.trace = StepTrace(str(tmp_path / "steps.jsonl"))
    try:
        generate_ids(llm, [[11, 12, 13]], greedy(3))
    finally:
        runner.shutdown()  # what NeuronWorker.shutdown calls; the engine serves on, untraced
    assert trace._file.closed and runner.step_metrics.trace is None
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 3
