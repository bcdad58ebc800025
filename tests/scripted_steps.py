"""A scripted workload and the calls the runner makes at each step of it: tests/engine/test_scheduler_steps.py
runs it through the engine, tests/unit/test_step_simulation.py through the bucket policy's simulation.

Engine: max_num_batched_tokens 96, max_num_seqs 4; buckets prefill [32, 64], decode [1, 2, 4],
context [128, 256], prefill share 64 (tests/conftest.py). vLLM's scheduler serves running requests first,
then waiting ones, within the 96-token budget. Under light load (at most 2 of 4 requests decoding, and a
prompt waiting beside them, not a queue) our scheduler holds prefill to 64 tokens a step
(vllm_neuron/scheduler.py), and a chunk of at most 64 tokens rides in the call of 1 or 2 decode rows (a
mixed call, vllm_neuron/buckets.py), attending over the largest context bucket. The other prefill chunks of
a step are packed into calls that fit the largest prefill and context buckets."""

from vllm_neuron.calls import Call

ARRIVALS = {  # step -> [(request id, prompt tokens, max tokens)]
    0: [("a", 40, 30), ("b", 100, 4)],
    2: [("c", 5, 3)],
    4: [("d", 150, 2)],
}
CANCELLED = {6: ["a"]}

EXPECTED = [
    # step 0: nothing decodes yet: a's whole prompt and the first 56 tokens of b fill the 96-token budget,
    # each its request's first chunk in the 64 bucket: a fresh call each, over its own keys
    [
        Call.prefill(tokens=40, token_bucket=64, chunk_context=0),
        Call.prefill(tokens=56, token_bucket=64, chunk_context=0),
    ],
    # step 1: a decodes while b's prefill finishes, in one call
    [
        Call.decode(rows=1, batch=1, decode_context=128).with_chunk(
            tokens=44, start=56, token_bucket=64, chunk_context=256
        )
    ],
    # step 2: c arrives and prefills beside two decodes
    [
        Call.decode(rows=2, batch=2, decode_context=128).with_chunk(
            tokens=5, start=0, token_bucket=64, chunk_context=256
        )
    ],
    # step 3: three decodes pad to the batch bucket of 4
    [Call.decode(rows=3, batch=4, decode_context=128)],
    # step 4: d arrives while three of four requests decode (more than half: no cap): its first 93 tokens
    # (96 minus 3 decodes) run as sub-chunks of 64 (fresh) and 29, apart from the decode rows (batch 4 has
    # no mixed calls: steps that full are not capped); b and c finish
    [
        Call.decode(rows=3, batch=4, decode_context=128),
        Call.prefill(tokens=64, token_bucket=64, chunk_context=0),
        Call.prefill(tokens=29, token_bucket=32, chunk_context=128, start=64),
    ],
    # step 5: light load (a decodes, d prefills): d's prefill may take 64 tokens, and its last 57 need the
    # 256 context bucket
    [
        Call.decode(rows=1, batch=1, decode_context=128).with_chunk(
            tokens=57, start=93, token_bucket=64, chunk_context=256
        )
    ],
    # step 6: a was cancelled; d decodes alone and finishes
    [Call.decode(rows=1, batch=1, decode_context=256)],
    # step 7: nothing left
    [],
]
