"""The prefill share of a step (vllm_neuron/scheduler.py): capped while a few prompts arrive beside running
streams, vLLM's whole budget when nothing decodes, the decode batch is more than half full, or prompts
queue."""

import pytest

from vllm_neuron.prefill_share import prefill_share

MAX_NUM_SEQS, SHARE, BUDGET = 32, 16, 512


@pytest.mark.parametrize(
    ("decoding", "prefilling", "expected"),
    [
        (0, 1, 0),  # nothing decodes: prefill takes the whole budget
        (1, 0, SHARE),  # nobody waiting: the cap changes nothing, but applies
        (1, 1, SHARE),  # one prompt beside one stream
        (4, 1, SHARE),  # a long prompt arriving beside a few streams
        (7, 2, 0),  # two prompts beside seven streams: a queue
        (8, 2, SHARE),  # ... but not beside eight
        (16, 4, SHARE),  # half the batch decoding, a prompt per four streams
        (16, 16, 0),  # the ramp of a busy server: half decoding, half waiting
        (17, 1, 0),  # more than half of max_num_seqs decoding: throughput wins
    ],
)
def test_prefill_share_follows_the_load(decoding, prefilling, expected):
    assert prefill_share(decoding, prefilling, MAX_NUM_SEQS, SHARE, BUDGET) == expected


def test_the_share_never_exceeds_the_budget_and_zero_turns_it_off():
    assert prefill_share(4, 1, MAX_NUM_SEQS, 1024, BUDGET) == BUDGET
    assert prefill_share(4, 1, MAX_NUM_SEQS, 0, BUDGET) == 0
