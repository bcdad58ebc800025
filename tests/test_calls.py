"""vllm_neuron.calls: a call as a value, and how a step's decode rows and prefill chunks become calls."""

from vllm_neuron.buckets import BucketConfig
from vllm_neuron.calls import Call, CallPlan, plan_step

BLOCK_SIZE = 32
# The suite's engine buckets (tests/conftest.py), mixed calls for batch buckets 1 and 2 with 64-token chunks.
BUCKETS = BucketConfig(
    prefill_tokens=(32, 64),
    decode_batch=(1, 2, 4),
    context_tokens=(128, 256),
    page_tokens=128,
    mixed_tokens=64,
    mixed_batch=(1, 2),
)


def test_a_call_describes_itself_its_bucket_and_its_padding():
    prefill = Call.prefill(tokens=29, token_bucket=32, context=128, start=64)
    packed = Call.prefill(tokens=15, token_bucket=32, context=128, chunks=3)
    decode = Call.decode(rows=3, batch=4, context=256)
    mixed = Call.decode(rows=2, batch=2, context=128).with_chunk(
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
            Call.decode(rows=2, batch=2, context=128).with_chunk(5, 0, 64, 256),
            decode_rows=(0, 1),
            parts=((1, 0, 5),),
        ),
        CallPlan(Call.prefill(tokens=64, token_bucket=64, context=128), parts=((0, 0, 64),)),
        CallPlan(Call.prefill(tokens=36, token_bucket=64, context=128, start=64), parts=((0, 64, 36),)),
        CallPlan(Call.prefill(tokens=7, token_bucket=32, context=128), parts=((2, 0, 7),)),
    ]


def test_without_mixed_calls_for_the_batch_bucket_every_chunk_is_a_prefill_call():
    plans = plan_step([10, 20, 30], [(0, 10), (0, 5)], BUCKETS, BLOCK_SIZE)
    assert [plan.call for plan in plans] == [
        Call.decode(rows=3, batch=4, context=128),
        Call.prefill(tokens=15, token_bucket=32, context=128, chunks=2),
    ]
    assert plans[1].parts == ((0, 0, 10), (1, 0, 5))


def test_decode_rows_beyond_the_largest_batch_bucket_run_in_several_calls():
    plans = plan_step([200] * 5, [], BUCKETS, BLOCK_SIZE)
    assert [(plan.call, plan.decode_rows) for plan in plans] == [
        (Call.decode(rows=4, batch=4, context=256), (0, 1, 2, 3)),
        (Call.decode(rows=1, batch=1, context=256), (4,)),
    ]
