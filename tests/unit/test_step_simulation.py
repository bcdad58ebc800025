"""vllm_neuron.planning.step_simulation: the bucket policy's model of the scheduler and the runner, checked
against the calls the runner makes for a scripted workload (tests/scripted_steps.py, which
tests/engine/test_scheduler_steps.py proves on a running engine)."""

from dataclasses import replace

from tests.conftest import ENGINE_KWARGS
from tests.scripted_steps import ARRIVALS, CANCELLED, EXPECTED
from vllm_neuron.buckets import BucketConfig, decode_page_tokens, light_load_batches
from vllm_neuron.calls import Call
from vllm_neuron.config import DEFAULT_BLOCK_SIZE
from vllm_neuron.planning.step_simulation import SchedulerModel, SimulatedStep, scripted_calls

# The suite's engine (tests/conftest.py), with the mixed calls the server gives its buckets by default.
SETTINGS = ENGINE_KWARGS["additional_config"]
SHARE = SETTINGS["prefill_tokens_while_decoding"]
LIMITS = dict(
    max_num_seqs=ENGINE_KWARGS["max_num_seqs"], max_num_batched_tokens=ENGINE_KWARGS["max_num_batched_tokens"]
)
BUCKETS = BucketConfig(
    prefill_buckets=tuple(SETTINGS["prefill_buckets"]),
    decode_batch_buckets=tuple(SETTINGS["decode_batch_buckets"]),
    context_buckets=tuple(SETTINGS["context_buckets"]),
    page_tokens=decode_page_tokens(DEFAULT_BLOCK_SIZE),
    prefill_tokens_while_decoding=SHARE,
    mixed_batch_buckets=light_load_batches(SETTINGS["decode_batch_buckets"], LIMITS["max_num_seqs"]),
    fresh_buckets=tuple(SETTINGS["fresh_prefill_buckets"]),
)


def simulated(arrivals, steps, buckets=BUCKETS, cancellations=None) -> list[list[Call]]:
    return scripted_calls(
        arrivals,
        buckets,
        steps=steps,
        **LIMITS,
        block_size=DEFAULT_BLOCK_SIZE,
        cancellations=cancellations,
    )


def test_simulated_calls_are_the_runners_calls_for_the_scripted_workload():
    # Capped steps (1, 2, 5), mixed calls (1, 2, 5), an uncapped step with sub-chunks beside a batch without
    # mixed calls (4), and a cancellation (6).
    assert simulated(ARRIVALS, len(EXPECTED), cancellations=CANCELLED) == EXPECTED


def test_stock_scheduling_or_no_mixed_calls_would_not_match():
    """What the policy simulated before: vLLM's scheduler without the light-load share, and a capped chunk
    as a call of its own."""
    stock = simulated(
        ARRIVALS,
        len(EXPECTED),
        buckets=replace(BUCKETS, prefill_tokens_while_decoding=0, mixed_batch_buckets=()),
    )
    assert stock[1] == [
        Call.decode(rows=1, batch=1, decode_context=128),
        Call.prefill(tokens=44, token_bucket=64, chunk_context=128, start=56),
    ]
    separate = simulated(ARRIVALS, len(EXPECTED), buckets=replace(BUCKETS, mixed_batch_buckets=()))
    assert separate[5] == [
        Call.decode(rows=1, batch=1, decode_context=128),
        Call.prefill(tokens=57, token_bucket=64, chunk_context=256, start=93),
    ]


def test_a_short_chunk_beside_a_batch_without_mixed_calls_runs_on_its_own():
    # tests/engine/test_scheduler_steps.py's second workload: three short prompts, then a fourth while they
    # decode.
    arrivals = {0: [(f"busy-{i}", 5, 6) for i in range(3)], 1: [("short", 10, 2)]}
    assert simulated(arrivals, 2) == [
        [Call.prefill(tokens=15, token_bucket=32, chunk_context=128, chunks=3)],
        [
            Call.decode(rows=3, batch=4, decode_context=128),
            Call.prefill(tokens=10, token_bucket=32, chunk_context=128),
        ],
    ]


def test_light_load_caps_prefill_and_a_queue_lifts_the_cap():
    model = SchedulerModel(max_num_seqs=8, max_num_batched_tokens=64, prefill_tokens_while_decoding=16)
    model.add("short", 10, 8)
    model.add("long", 200, 4)
    assert model.step() == (SimulatedStep((), ((0, 10), (0, 54))), [])  # nothing decodes: the whole budget
    # one stream decoding beside one prompt: light load, the chunk capped at the share of 16 tokens
    assert model.step() == (SimulatedStep((11,), ((54, 16),)), [])
    model.add("late", 30, 2)  # two prompts waiting beside one stream: a queue, vLLM's whole budget
    assert model.step() == (SimulatedStep((12,), ((70, 63),)), [])


def test_decode_only_stretches_run_in_one_go_and_end_where_a_request_finishes():
    model = SchedulerModel(max_num_seqs=2, max_num_batched_tokens=64, prefill_tokens_while_decoding=16)
    model.add("a", 10, 5)
    model.add("b", 20, 3)
    model.step()
    assert model.decode_only_steps() == 2  # b has 2 tokens left to generate
    step, finished = model.decode_steps(2)
    assert step == SimulatedStep((11, 21), (), repeat=2) and finished == ["b"]
    assert list(step.unrolled()) == [SimulatedStep((11, 21), ()), SimulatedStep((12, 22), ())]
    assert model.running == ["a"]
