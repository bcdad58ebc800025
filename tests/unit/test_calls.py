"""vllm_neuron.calls: a call as a value, and how a step's decode rows and prefill chunks become calls."""

import random
from dataclasses import replace

from vllm_neuron.buckets import BucketConfig
from vllm_neuron.calls import Call, CallPlan, most_calls_per_step, plan_step
from vllm_neuron.graph_plan import GraphPlan

BLOCK_SIZE = 32
# The suite's engine buckets (tests/conftest.py), mixed calls for batch buckets 1 and 2 with 64-token chunks.
BUCKETS = BucketConfig(
    prefill_buckets=(32, 64),
    decode_batch_buckets=(1, 2, 4),
    context_buckets=(128, 256),
    page_tokens=128,
    prefill_tokens_while_decoding=64,
    mixed_batch_buckets=(1, 2),
)


def test_a_call_describes_itself_its_bucket_and_its_padding():
    prefill = Call.prefill(tokens=29, token_bucket=32, chunk_context=128, start=64)
    packed = Call.prefill(tokens=15, token_bucket=32, chunk_context=128, chunks=3)
    decode = Call.decode(rows=3, batch=4, decode_context=256)
    mixed = Call.decode(rows=2, batch=2, decode_context=128).with_chunk(
        tokens=5, start=0, token_bucket=64, chunk_context=256
    )
    assert str(prefill) == "prefill of 29 tokens at 64: tokens 32 x context 128"
    assert str(packed) == "prefill of 3 requests, 15 tokens: tokens 32 x context 128"
    assert str(decode) == "decode of 3 requests: batch 4 x context 256"
    assert str(mixed) == (
        "decode of 2 requests: batch 2 x context 128, with prefill of 5 tokens at 0: tokens 64 x context 256"
    )
    assert [c.bucket for c in (prefill, decode, mixed)] == ["32x128", "4x256", "2x128+64"]
    assert prefill.padding() == {"prefill": (29, 32)}
    assert decode.padding() == {"decode": (3, 4)}
    assert mixed.padding() == {"decode": (2, 2), "prefill": (5, 64)}


def test_a_short_chunk_rides_with_the_first_decode_call_that_has_mixed_calls():
    plans = plan_step([41, 9], [(0, 100), (0, 5), (0, 7)], BUCKETS, BLOCK_SIZE)
    assert plans == [
        CallPlan(
            Call.decode(rows=2, batch=2, decode_context=128).with_chunk(5, 0, 64, 256),
            decode_rows=(0, 1),
            parts=((1, 0, 5),),
        ),
        CallPlan(Call.prefill(tokens=64, token_bucket=64, chunk_context=128), parts=((0, 0, 64),)),
        CallPlan(Call.prefill(tokens=36, token_bucket=64, chunk_context=128, start=64), parts=((0, 64, 36),)),
        CallPlan(Call.prefill(tokens=7, token_bucket=32, chunk_context=128), parts=((2, 0, 7),)),
    ]


def test_without_mixed_calls_for_the_batch_bucket_every_chunk_is_a_prefill_call():
    plans = plan_step([10, 20, 30], [(0, 10), (0, 5)], BUCKETS, BLOCK_SIZE)
    assert [plan.call for plan in plans] == [
        Call.decode(rows=3, batch=4, decode_context=128),
        Call.prefill(tokens=15, token_bucket=32, chunk_context=128, chunks=2),
    ]
    assert plans[1].parts == ((0, 0, 10), (1, 0, 5))


def test_decode_rows_beyond_the_largest_batch_bucket_run_in_several_calls():
    plans = plan_step([200] * 5, [], BUCKETS, BLOCK_SIZE)
    assert [(plan.call, plan.decode_rows) for plan in plans] == [
        (Call.decode(rows=4, batch=4, decode_context=256), (0, 1, 2, 3)),
        (Call.decode(rows=1, batch=1, decode_context=256), (4,)),
    ]


def test_the_minimal_graphs_serve_any_step_as_more_calls():
    """Staged readiness plans with only the ready graphs: with the minimal two, a 4-row decode batch runs as
    four calls of batch 1 over the largest decode context, and prompts as 32-token chunks over the largest
    context, the same rows and tokens as with every graph."""
    minimal = BUCKETS.minimal_graphs()
    assert minimal == [("prefill", 32, 256), ("decode", 1, 256)]
    contexts, chunks = [41, 9, 200, 256], [(0, 100), (0, 5), (96, 7)]
    plans = plan_step(contexts, chunks, BUCKETS, BLOCK_SIZE, ready=minimal)
    assert {plan.call.graph for plan in plans} <= set(minimal)
    assert [plan.decode_rows for plan in plans if plan.decode_rows] == [(0,), (1,), (2,), (3,)]
    ran = sorted((index, start, length) for plan in plans for index, start, length in plan.parts)
    assert ran == [(0, 0, 32), (0, 32, 32), (0, 64, 32), (0, 96, 4), (1, 0, 5), (2, 96, 7)]
    # Every graph ready: the plan of the whole bucket set, whether given as None or as the full list.
    full = plan_step(contexts, chunks, BUCKETS, BLOCK_SIZE)
    assert plan_step(contexts, chunks, BUCKETS, BLOCK_SIZE, ready=BUCKETS.graphs()) == full
    assert full[0].call.graph == ("decode", 4, 256) and full[0].decode_rows == (0, 1, 2, 3)


def test_a_ready_graph_is_used_as_soon_as_it_joins():
    ready = [*BUCKETS.minimal_graphs(), ("decode", 2, 128)]
    plans = plan_step([41, 9, 30], [], BUCKETS, BLOCK_SIZE, ready=ready)
    assert [(plan.call.graph, plan.decode_rows) for plan in plans] == [
        (("decode", 2, 128), (0, 1)),
        (("decode", 1, 256), (2,)),
    ]
    # A mixed graph joins too: the short chunk rides with the decode call of its shape.
    plans = plan_step([41, 9], [(0, 5)], BUCKETS, BLOCK_SIZE, ready=[*ready, ("mixed", 2, 128)])
    assert [plan.call.graph for plan in plans] == [("mixed", 2, 128)]


# The suite's buckets with a fresh graph for the 64-token bucket (tests/conftest.py's engine has it too).
FRESH = replace(BUCKETS, fresh_buckets=(64,))


def test_a_request_whose_first_chunk_has_a_fresh_graph_runs_alone_over_its_own_keys():
    # (start, length): a first chunk of the fresh bucket, one of the 32 bucket, a prefix hit, and a first
    # chunk longer than the largest bucket (its rest after the fresh call, reading it back from the cache)
    plans = plan_step([], [(0, 40), (0, 20), (32, 40), (0, 90)], FRESH, BLOCK_SIZE)
    assert plans == [
        CallPlan(Call.prefill(40, 64, 0), parts=((0, 0, 40),)),
        CallPlan(Call.prefill(64, 64, 0), parts=((3, 0, 64),)),
        CallPlan(Call.prefill(60, 64, 128, chunks=2), parts=((1, 0, 20), (2, 32, 40))),
        CallPlan(Call.prefill(26, 32, 128, start=64), parts=((3, 64, 26),)),
    ]
    fresh = plans[0].call
    assert fresh.fresh and fresh.graph == ("prefill", 64, 0) and fresh.bucket == "64x0"
    assert str(fresh) == "fresh prefill of 40 tokens: tokens 64, over its own keys"
    assert fresh.chunk_pairs == 64 * 65 // 2  # the causal triangle, not a context bucket
    assert FRESH.graphs()[4] == ("prefill", 64, 0) and FRESH.num_graphs == BUCKETS.num_graphs + 1


def test_a_fresh_graph_not_ready_yet_leaves_the_chunk_to_the_packed_calls():
    ready = {*FRESH.minimal_graphs(), ("prefill", 64, 256)}
    plans = plan_step([], [(0, 40)], FRESH, BLOCK_SIZE, ready)
    assert plans == [CallPlan(Call.prefill(40, 64, 256), parts=((0, 0, 40),))]
    assert [
        p.call.graph for p in plan_step([], [(0, 40)], FRESH, BLOCK_SIZE, {*ready, ("prefill", 64, 0)})
    ] == [("prefill", 64, 0)]


def test_a_step_makes_at_most_the_calls_the_bound_says_whatever_graphs_are_ready():
    # 4 requests at most and 96 tokens: each request a call, and 92 tokens more in calls of 32 (the smallest
    # prefill bucket): 3 rows decoded one a call and a chunk of 93 tokens in three, with the minimal graphs.
    bound = most_calls_per_step(BUCKETS, max_num_seqs=4, max_num_batched_tokens=96, staged=True)
    assert bound == 4 + 92 // 32
    minimal = BUCKETS.minimal_graphs()
    assert len(plan_step([100, 120, 200], [(0, 93)], BUCKETS, BLOCK_SIZE, minimal)) == bound
    generator = random.Random(0)
    for buckets in [BUCKETS, FRESH] * 150:  # FRESH: a first chunk may take a fresh call and packed ones
        graphs, minimal = buckets.graphs(), buckets.minimal_graphs()
        ready = minimal + generator.sample(graphs, generator.randrange(len(graphs)))
        requests = generator.randint(1, 4)
        decode = generator.randint(0, requests)
        contexts = [generator.randint(1, 256) for _ in range(decode)]
        tokens = 96 - decode
        chunks = []
        for left in range(requests - decode, 0, -1):
            length = generator.randint(1, tokens - (left - 1))
            start = generator.randint(0, 256 - length)
            chunks.append((start, length))
            tokens -= length
        plans = plan_step(contexts, chunks, buckets, BLOCK_SIZE, ready)
        assert len(plans) <= bound, (contexts, chunks, ready)


def test_with_every_graph_ready_the_bound_is_the_largest_prefill_buckets_and_a_step_reaches_it():
    # Each request a call still (one-token chunks past half the largest context, 256, fill a call each), the
    # 92 tokens beyond them in calls of 64: one of 64 and one of 29 for the chunk of 93.
    bound = most_calls_per_step(BUCKETS, max_num_seqs=4, max_num_batched_tokens=96, staged=False)
    assert bound == 4 + 92 // 64
    assert len(plan_step([], [(200, 1), (210, 1), (220, 1), (0, 93)], BUCKETS, BLOCK_SIZE)) == bound
    generator = random.Random(1)
    for _ in range(300):
        requests = generator.randint(1, 4)
        decode = generator.randint(0, requests)
        contexts = [generator.randint(1, 256) for _ in range(decode)]
        tokens, chunks = 96 - decode, []
        for left in range(requests - decode, 0, -1):
            length = generator.randint(1, min(tokens - (left - 1), 256))
            chunks.append((generator.randint(0, 256 - length), length))
            tokens -= length
        assert len(plan_step(contexts, chunks, BUCKETS, BLOCK_SIZE)) <= bound, (contexts, chunks)


def test_a_draft_model_doubles_the_calls_and_adds_a_decode_pass_a_draft_token():
    # 2 draft tokens (verify rows of 3 queries): the draft runs beside each call of the model, then 2 passes
    # over the 4 rows, in calls of the smallest batch bucket (1) with the minimal graphs, else the largest.
    verify = replace(BUCKETS, verify_tokens=3)
    minimal = verify.minimal_graphs()
    rows = [200, 120, 60, 250]
    assert len(plan_step(rows, [], verify, BLOCK_SIZE, minimal)) == 4
    assert len(plan_step(rows, [], verify, BLOCK_SIZE)) == 1
    staged = most_calls_per_step(verify, 4, 96, staged=True, draft_model=True)
    assert staged == 2 * (4 + 92 // 32) + 2 * 4
    assert most_calls_per_step(verify, 4, 96, staged=False, draft_model=True) == 2 * (4 + 92 // 64) + 2 * 1


def test_an_eagle3_head_adds_one_propose_call_per_decode_call():
    # The head's first pass rides in the model's calls; its passes run in one call per decode call of at most
    # max_num_seqs rows: 4 calls of the smallest batch bucket (1) with the minimal graphs, else 1.
    verify = replace(BUCKETS, verify_tokens=4)
    assert most_calls_per_step(verify, 4, 96, staged=True, head=True) == (4 + 92 // 32) + 4
    assert most_calls_per_step(verify, 4, 96, staged=False, head=True) == (4 + 92 // 64) + 1
    plan = GraphPlan(verify, propose=True)
    assert plan.by_kind()["propose"] == len(verify.decode_shapes())
    assert [plan.graphs_of(graph) for graph in verify.graphs()] == [
        1 + (graph[0] == "decode") for graph in verify.graphs()
    ]
