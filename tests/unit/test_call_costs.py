"""vllm_neuron.call_costs: what a call costs, and the named profiles the bucket policy plans with."""

import pytest

from vllm_neuron.call_costs import CPU_SMOLLM2, PROFILES, TRN2_ESTIMATE, CallCosts, profile_for
from vllm_neuron.calls import Call

COSTS = CallCosts(call=10.0, token=0.5, row=2.0, kv_position=0.01, attention=0.001)


def test_a_call_costs_its_pass_over_the_weights_and_what_its_shape_computes():
    prefill = Call.prefill(tokens=20, token_bucket=32, chunk_context=256)
    decode = Call.decode(rows=3, batch=4, decode_context=200)  # 2 pages of 128 a row
    assert COSTS.of(prefill, page_tokens=128) == pytest.approx(10 + 32 * 0.5 + 32 * 256 * 0.001)
    assert COSTS.of(decode, page_tokens=128) == pytest.approx(10 + 4 * 2.0 + 4 * 256 * 0.01)
    # A mixed call pays one pass over the weights for both: what it saves over two calls.
    mixed = decode.with_chunk(tokens=20, start=0, token_bucket=32, chunk_context=256)
    assert COSTS.of(mixed, page_tokens=128) == pytest.approx(
        COSTS.of(decode, page_tokens=128) + COSTS.of(prefill, page_tokens=128) - COSTS.call
    )


def test_the_trn2_estimate_is_the_rooflines_step_time():
    # docs/performance.md: Llama-3.1-8B at TP=4, a batch-32 decode step over the 512 context bucket, 6.28 ms
    # (weights and KV reads; the estimate's row term adds the rows' matmuls on top).
    assert TRN2_ESTIMATE.call + 32 * 512 * TRN2_ESTIMATE.kv_position == pytest.approx(6.28, abs=0.01)
    # Where a pass over the weights is worth as many token slots as the matmuls take: ~220 on trn2, 64 on CPU.
    assert TRN2_ESTIMATE.call / TRN2_ESTIMATE.token == pytest.approx(218, rel=0.01)
    assert CPU_SMOLLM2.call / CPU_SMOLLM2.token == pytest.approx(64, rel=0.01)


def test_each_device_mode_plans_with_its_own_profile():
    assert PROFILES[profile_for("neuron")] is TRN2_ESTIMATE
    assert PROFILES[profile_for("cpu")] is CPU_SMOLLM2
