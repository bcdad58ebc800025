"""A failure inside a compiled call (on Trainium, a Neuron runtime error) is logged with the call it happened
in: phase and bucket, which the runtime's own message does not say."""

import logging

import pytest

from tests.conftest import model_runner
from vllm_neuron.calls import Call


def test_a_failing_call_is_logged_with_its_phase_and_bucket(llm, monkeypatch, caplog):
    runner = model_runner(llm)

    def fail(inputs):
        raise RuntimeError("NRT_EXEC_ERROR: simulated Neuron runtime failure")

    monkeypatch.setattr(runner.compiled, "forward", fail)
    monkeypatch.setattr(runner.step_metrics, "records_traffic", False)  # no call counted on /metrics
    call = Call.decode(rows=3, batch=4, decode_context=256)
    with (
        caplog.at_level(logging.ERROR, logger="vllm.vllm_neuron.forward"),
        pytest.raises(RuntimeError, match="NRT_EXEC_ERROR"),
    ):
        runner.compiled.run(call, None)
    assert "decode of 3 requests: batch 4 x context 256" in caplog.text and "NRT_EXEC_ERROR" in caplog.text
