"""The sampler's top-k in stages no wider than neuronx-cc sorts (vllm_neuron.sampling.staged_top_k): equal to
a one-stage torch.topk, ties included, and lowered to sorts of at most 16,384 elements; XLA's preparation
turns each sort-and-slice back into a top-k (vllm_neuron/compiler/top_k.py), as neuronx-cc does."""

import pytest
import torch

from vllm_neuron import sampling, trn2
from vllm_neuron.compiler.stablehlo import StableHLOBackend

ROWS = 3
# SmolLM2, Llama 3 (even chunks of 16,032), Qwen (a shorter last chunk), one just past a chunk.
VOCABS = [49152, 128256, 151936, trn2.SORT_LIMIT + 1]


def distinct_rows(vocab: int, seed: int) -> torch.Tensor:
    """Rows whose values are all different: one top-k order only."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=gen).float() for _ in range(ROWS)]) / vocab


def tied_rows(vocab: int, seed: int) -> torch.Tensor:
    """Four values only: every top-k choice among ties, across chunks."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (ROWS, vocab), generator=gen).float()


def stable_top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k with the lower index first among equal values."""
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[:, :k], ids[:, :k]


@pytest.mark.parametrize("vocab", VOCABS)
def test_staged_top_k_equals_a_one_stage_top_k(vocab):
    x = distinct_rows(vocab, seed=vocab)
    values, ids = sampling.staged_top_k(x, sampling.TOP_K_CAP)
    expected_values, expected_ids = torch.topk(x, sampling.TOP_K_CAP)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)
    # torch's CPU top-k orders equal values as it likes: on ties, the same values at ids that hold them.
    x = tied_rows(vocab, seed=vocab)
    values, ids = sampling.staged_top_k(x, sampling.TOP_K_CAP)
    assert torch.equal(values, stable_top_k(x, sampling.TOP_K_CAP)[0])
    assert torch.equal(x.gather(1, ids), values)
    assert all(len(set(row)) == sampling.TOP_K_CAP for row in ids.tolist())


def lowered(function, *args):
    backend = StableHLOBackend(execute="xla")
    outputs = torch.compile(function, backend=backend, fullgraph=True, dynamic=False)(*args)
    (graph,) = backend.graphs
    return graph, outputs


@pytest.mark.parametrize("vocab", [128256, 151936])
def test_staged_top_k_lowers_to_sorts_neuronx_cc_takes_and_is_stable_on_ties(vocab):
    """What neuronx-cc gets: sorts of at most 16,384 elements (NCC_EVRF014 holds). What XLA runs (the
    sorts made top-k, as neuronx-cc makes them its own top-k): the lower index first among equal values,
    exactly a stable one-stage top-k."""
    x = tied_rows(vocab, seed=1)
    graph, (values, ids) = lowered(lambda x: sampling.staged_top_k(x, sampling.TOP_K_CAP), x)
    assert graph.broken_rules == []
    assert graph.op_histogram["stablehlo.sort"] >= 2 and "chlo.top_k" not in graph.op_histogram
    assert graph.xla_stablehlo.count("chlo.top_k") == graph.op_histogram["stablehlo.sort"]
    expected_values, expected_ids = stable_top_k(x, sampling.TOP_K_CAP)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)


def test_a_one_stage_top_k_of_a_vocabulary_breaks_evrf014_by_name():
    backend = StableHLOBackend(execute="none")
    compiled = torch.compile(lambda x: torch.topk(x, 256), backend=backend, fullgraph=True, dynamic=False)
    with pytest.raises(Exception, match="NCC_EVRF014") as failure:
        compiled(torch.randn(2, 49152))
    assert "a top-k of k=49152" in str(failure.value)
    assert "test_top_k.py:" in str(failure.value)  # the line that made it


def tied_logits_and_params(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits whose three largest are equal in every row (ties for the top-k and the argmax), and
    rows of each kind: greedy, temperature, top-k, top-p, min-p."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen)
    logits[:, [vocab - 5, 20, trn2.SORT_LIMIT + 3]] = 6.0
    params = torch.zeros(6, sampling.PARAMS)
    params[:, sampling.TOP_P] = 1.0  # off
    params[1:, sampling.TEMPERATURE] = 0.8
    params[2, sampling.TOP_K] = 5
    params[3, sampling.TOP_P] = 0.9
    params[4, sampling.MIN_P] = 0.1
    params[:, sampling.UNIFORM] = torch.rand(6, generator=gen)
    return logits, params


def sample_outputs(logits: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    rows = sampling.sample(logits, params)
    return rows.token_ids, rows.logprob_token_ids, rows.logprobs, rows.ranks, rows.draft_probs


@pytest.mark.parametrize("vocab", [49152, 128256])
def test_the_sampler_over_a_large_vocabulary_meets_the_rules_and_runs_as_the_torch_sampler(vocab):
    """SmolLM2's and Llama 3's vocabularies: every graph ends in this sampler."""
    logits, params = tied_logits_and_params(vocab)
    graph, (tokens, top_ids, logprobs, ranks, draft_probs) = lowered(sample_outputs, logits, params)
    assert graph.broken_rules == []
    expected = sample_outputs(logits, params)
    torch.testing.assert_close(tokens, expected[0])
    torch.testing.assert_close(logprobs, expected[2])
    torch.testing.assert_close(ranks, expected[3])
    torch.testing.assert_close(draft_probs, expected[4])
    assert top_ids[:, 1:4].tolist() == [[20, trn2.SORT_LIMIT + 3, vocab - 5]] * 6  # lower index first
    assert tokens[0].item() == 20  # greedy: argmax's first index of the largest
    for row in range(6):
        assert sorted(top_ids[row, 1:].tolist()) == sorted(expected[1][row, 1:].tolist())


def test_xla_preparation_leaves_a_sort_that_is_not_a_top_k():
    def sort_and_top_k(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sort(x, dim=-1, descending=True).values, torch.topk(y, 3).indices

    x, y = torch.randn(4, 50), torch.randn(4, 50)
    graph, (values, indices) = lowered(sort_and_top_k, x, y)
    assert graph.op_histogram.get("stablehlo.sort") == 2  # what neuronx-cc gets
    assert graph.xla_stablehlo.count("chlo.top_k") == 1 and graph.xla_stablehlo.count('"stablehlo.sort"') == 1
    torch.testing.assert_close(values, torch.sort(x, dim=-1, descending=True).values)
    torch.testing.assert_close(indices, torch.topk(y, 3).indices)
