"""The sampler's top-k lowers as a top-k (`chlo.top_k`), not a sort of the vocabulary
(vllm_neuron/compiler/top_k.py), and XLA's program of it samples what the torch sampler does."""

import torch

from vllm_neuron import sampling
from vllm_neuron.compiler.stablehlo import StableHLOBackend

ROWS, VOCAB = 6, 1000


def sample_outputs(logits: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    rows = sampling.sample(logits, params)
    return rows.token_ids, rows.logprob_token_ids, rows.logprobs, rows.ranks, rows.draft_probs


def tied_logits_and_params() -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits whose three largest are equal in every row (ties for the top-k and the argmax), and
    rows of each kind: greedy, temperature, top-k, top-p, min-p."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, generator=gen)
    logits[:, [700, 20, 310]] = 6.0
    params = torch.zeros(ROWS, sampling.PARAMS)
    params[:, sampling.TOP_P] = 1.0  # off
    params[1:, sampling.TEMPERATURE] = 0.8
    params[2, sampling.TOP_K] = 5
    params[3, sampling.TOP_P] = 0.9
    params[4, sampling.MIN_P] = 0.1
    params[:, sampling.UNIFORM] = torch.rand(ROWS, generator=gen)
    return logits, params


def test_the_sampler_lowers_to_one_top_k_and_runs_as_the_torch_sampler():
    backend = StableHLOBackend(execute="xla")
    compiled = torch.compile(sample_outputs, backend=backend, fullgraph=True, dynamic=False)
    logits, params = tied_logits_and_params()
    tokens, top_ids, logprobs, ranks, draft_probs = compiled(logits, params)
    (graph,) = backend.graphs
    assert graph.op_histogram.get("chlo.top_k") == 1
    assert "stablehlo.sort" not in graph.op_histogram
    expected = sample_outputs(logits, params)
    torch.testing.assert_close(tokens, expected[0])
    torch.testing.assert_close(logprobs, expected[2])
    torch.testing.assert_close(ranks, expected[3])
    torch.testing.assert_close(draft_probs, expected[4])
    # On ties the top-k is stable, lower index first (torch's CPU top-k leaves that order open): the ids
    # are the torch sampler's up to the order among equal logits.
    assert top_ids[:, 1:4].tolist() == [[20, 310, 700]] * ROWS
    assert tokens[0].item() == 20  # greedy: argmax's first index of the largest
    for row in range(ROWS):
        assert sorted(top_ids[row, 1:].tolist()) == sorted(expected[1][row, 1:].tolist())


def test_a_sort_that_is_not_a_top_k_stays_a_sort():
    def sort_and_top_k(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sort(x, dim=-1, descending=True).values, torch.topk(y, 3).indices

    backend = StableHLOBackend(execute="xla")
    x, y = torch.randn(4, 50), torch.randn(4, 50)
    compiled = torch.compile(sort_and_top_k, backend=backend, fullgraph=True, dynamic=False)
    values, indices = compiled(x, y)
    (graph,) = backend.graphs
    assert graph.op_histogram.get("chlo.top_k") == 1
    assert graph.op_histogram.get("stablehlo.sort") == 1
    torch.testing.assert_close(values, torch.sort(x, dim=-1, descending=True).values)
    torch.testing.assert_close(indices, torch.topk(y, 3).indices)
