"""The trn2 capacity model (vllm_neuron/planning/capacity.py) against the figures docs/performance.md
publishes."""

from vllm_neuron.planning import capacity
from vllm_neuron.trn2 import GIB, KVSettings


def test_capacity_model_gives_the_published_figures():
    """docs/performance.md's table: Llama-3.1-8B at TP=4, 70B at TP=16 and 64, with the plugin's defaults."""
    from benchmarks.capacity import LLAMA_8B, LLAMA_70B

    assert LLAMA_8B.parameters == 8_030_261_248  # Meta's published count
    settings = KVSettings()
    cases = [(LLAMA_8B, 4, 3.74, 32, 235_929, 28), (LLAMA_70B, 16, 8.21, 40, 188_743, 23)]
    cases.append((LLAMA_70B, 64, 2.05, 40, 188_743, 23))
    for llama, tp, weights_gib, kv_kib, kv_tokens, requests_8k in cases:
        rank = capacity.rank_capacity(llama.figures(), tp, settings)
        assert round(rank.weight_bytes / GIB, 2) == weights_gib
        assert rank.kv_bytes_per_token == kv_kib * 1024
        assert rank.kv_tokens == kv_tokens
        assert rank.requests(8192) == requests_8k
    # The roofline's batch-32 step over 2048 positions, 8B at TP=4: 8.50 ms, 3,765 tokens/s.
    model = LLAMA_8B.figures()
    assert round(capacity.step_seconds(model, 4, 32, 2048) * 1e3, 2) == 8.50
    assert round(capacity.decode_tokens_per_s(model, 4, 32, 32, 2048)) == 3765


def test_a_rank_that_does_not_fit_holds_no_kv_and_the_suggestion_skips_it():
    from benchmarks.capacity import LLAMA_70B

    model = LLAMA_70B.figures()
    options = []
    for tp in capacity.tensor_parallel_sizes(model, 64):
        rank = capacity.rank_capacity(model, tp, KVSettings())
        options.append((rank, capacity.throughput(model, rank, 32, 8192, 8192)))
    assert [rank.tp for rank, _ in options] == [1, 2, 4, 8, 16, 32, 64]
    assert [rank.kv_tokens for rank, _ in options[:4]] == [0, 0, 0, 0]  # 141 GB over 8 cores or fewer
    # 23 requests of 8k fit from TP=16 on; each chip decodes most at TP=16.
    assert capacity.suggest_tensor_parallel(options) == 16
