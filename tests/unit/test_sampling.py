"""The graph's sampler (vllm_neuron/sampling.py) against vLLM's host sampler: greedy token for token, sampled
distributions within a fixed tolerance, logprobs and ranks, and the rows it hands to the host."""

import pytest
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p, random_sample
from vllm.v1.sample.sampler import Sampler

from vllm_neuron import sampling
from vllm_neuron.compiler.stablehlo import StableHLOBackend
from worker.step import sampling_rows

VOCAB = 300  # above TOP_K_CAP, so the candidates are a part of the vocabulary
DRAWS = 100_000  # samples per distribution
# Total variation distance allowed between the sampled frequencies and vLLM's probabilities: vLLM's own
# sampler lands at 0.003-0.010 with these draws; a temperature 5% off is 0.013-0.036 away.
TOLERANCE = 0.015


def make_rows(count: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed: int = 0) -> torch.Tensor:
    """`count` sampling rows with these parameters and seeded uniform draws."""
    rows = torch.zeros(count, sampling.PARAMS)
    rows[:, sampling.TEMPERATURE] = temperature
    rows[:, sampling.TOP_K] = top_k
    rows[:, sampling.TOP_P] = top_p
    rows[:, sampling.MIN_P] = min_p
    rows[:, sampling.UNIFORM] = torch.rand(count, generator=torch.Generator().manual_seed(seed))
    return rows


def peaked_logits(seed: int) -> torch.Tensor:
    """One row of logits with a spread of probabilities: a few likely tokens and a long tail."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=generator) * 2.5


def host_probabilities(
    logits: torch.Tensor, temperature, top_k, top_p, min_p, draws: int = 1
) -> torch.Tensor:
    """vLLM's sampler steps, in its order: temperature, min-p, top-k and top-p; [draws, vocab]."""
    rows = logits.expand(draws, -1).clone() / temperature
    if min_p:
        probs = rows.softmax(-1)
        rows = rows.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, float("-inf"))
    k = torch.full((draws,), top_k, dtype=torch.long) if top_k else None
    p = torch.full((draws,), top_p) if top_p < 1 else None
    return apply_top_k_top_p(rows, k, p).softmax(-1)


def host_samples(logits: torch.Tensor, temperature, top_k, top_p, min_p, draws: int) -> torch.Tensor:
    """vLLM's random sample from those probabilities."""
    torch.manual_seed(11)
    return random_sample(host_probabilities(logits, temperature, top_k, top_p, min_p, draws), {})


def frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens.long(), minlength=VOCAB).float() / len(tokens)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),  # the whole vocabulary
        (0.7, 0, 1.0, 0.0),
        (1.0, 20, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.05),
        (0.9, 40, 0.9, 0.02),
    ],
)
def test_sampled_distribution_matches_the_host_sampler(temperature, top_k, top_p, min_p):
    logits = peaked_logits(seed=3)
    rows = make_rows(DRAWS, temperature, top_k, top_p, min_p, seed=5)
    device = sampling.sample(logits.expand(DRAWS, -1), rows).token_ids
    assert (device != sampling.NO_TOKEN).all()
    exact = host_probabilities(logits, temperature, top_k, top_p, min_p)[0]
    for name, tokens in (
        ("graph", device),
        ("host", host_samples(logits, temperature, top_k, top_p, min_p, DRAWS)),
    ):
        distance = 0.5 * (frequencies(tokens) - exact).abs().sum().item()
        assert distance < TOLERANCE, f"{name}: total variation {distance:.4f} from vLLM's probabilities"
    # Nothing the host sampler masks.
    assert (exact[device.long()] > 0).all()


def test_greedy_is_the_host_samplers_argmax_token_for_token():
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(1))
    logits[3, 17] = logits[3, 18] = logits[3].max() + 1  # a tie: the first index, as torch.argmax
    device = sampling.sample(logits, make_rows(64, temperature=0.0)).token_ids
    assert device.tolist() == Sampler.greedy_sample(logits).tolist()


def test_a_uniform_draw_picks_the_token_whose_cumulative_probability_it_reaches():
    logits = torch.log(torch.tensor([[0.1, 0.0, 0.2, 0.7] + [0.0] * 400]).clamp_min(1e-45))
    for uniform, token in ((0.05, 0), (0.15, 2), (0.29, 2), (0.31, 3), (0.999, 3)):
        rows = make_rows(1)
        rows[:, sampling.UNIFORM] = uniform
        assert sampling.sample(logits, rows).token_ids.item() == token, uniform


def test_logprobs_and_ranks_are_vllms_raw_ones():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    out = sampling.sample(logits, make_rows(6, temperature=0.8, top_k=50, seed=3))
    raw = Sampler.compute_logprobs(logits)
    expected = Sampler.gather_logprobs(raw, sampling.LOGPROBS_CAP, out.token_ids.long())
    assert out.logprob_token_ids.tolist() == expected.logprob_token_ids.tolist()
    torch.testing.assert_close(out.logprobs, expected.logprobs)
    assert out.ranks.tolist() == expected.selected_token_ranks.tolist()


def test_a_top_p_cut_beyond_the_candidates_is_left_to_the_host():
    flat = torch.zeros(2, 4 * sampling.TOP_K_CAP)
    flat[1, :10] = 20.0  # the second row's nucleus is its first ten tokens
    out = sampling.sample(flat, make_rows(2, top_p=0.9))
    assert out.token_ids[0].item() == sampling.NO_TOKEN
    assert 0 <= out.token_ids[1].item() < 10
    # Greedy rows never overflow, nor does a top-k within the cap (without ties at its cut).
    assert (sampling.sample(flat, make_rows(2, temperature=0.0, top_p=0.9)).token_ids >= 0).all()
    spread = torch.randn(2, 4 * sampling.TOP_K_CAP, generator=torch.Generator().manual_seed(6)) * 0.01
    assert (sampling.sample(spread, make_rows(2, top_k=100, top_p=0.9)).token_ids >= 0).all()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 0.9), (1.0, 0, 1.0), (0.0, 0, 0.9), (1.0, 100, 0.9), (1.0, sampling.TOP_K_CAP, 0.99999)],
)
def test_the_host_knows_which_rows_the_graph_may_leave_to_it(temperature, top_k, top_p):
    """sampling.may_overflow, which decides whether the next step takes a row's token on the device
    (worker/step/step_state.py): a row it clears never comes back NO_TOKEN, whatever the logits, ties
    included."""
    rows = make_rows(3, temperature=temperature, top_k=top_k, top_p=top_p)
    flat = torch.zeros(3, 4 * sampling.TOP_K_CAP)  # every token tied
    flat[1] = torch.randn(4 * sampling.TOP_K_CAP, generator=torch.Generator().manual_seed(3)) * 0.01
    flat[2, : 2 * sampling.TOP_K_CAP] = 1.0  # ties across the top-k cap
    overflowed = (sampling.sample(flat, rows).token_ids == sampling.NO_TOKEN).any().item()
    may = sampling.may_overflow(rows[0].numpy())
    assert may or not overflowed
    assert may == (temperature > 0 and top_p < 1 and not 0 < top_k <= sampling.TOP_K_CAP)


def test_the_host_completes_an_overflowed_row_with_the_whole_vocabulary_as_candidates():
    """A NO_TOKEN row, sampled again over every token with the same uniform draw: vLLM's distribution."""
    logits = torch.linspace(0.5, 0.0, VOCAB)  # a slow decline: the 0.95 nucleus is over 256 tokens
    exact = host_probabilities(logits, 1.0, 0, 0.95, 0.0)[0]
    assert (exact > 0).sum() > sampling.TOP_K_CAP
    tokens = []
    for seed in (8, 9):
        rows = make_rows(DRAWS, top_p=0.95, seed=seed)
        assert (sampling.sample(logits.expand(DRAWS, -1), rows).token_ids == sampling.NO_TOKEN).all()
        tokens.append(sampling.sample(logits.expand(DRAWS, -1), rows, candidates=VOCAB).token_ids)
    # Nearly flat over ~290 tokens, sampling noise alone is ~0.015 at these draws; the 256 candidates
    # renormalised (what the host must not do) would be 0.115 away.
    distance = 0.5 * (frequencies(torch.cat(tokens)) - exact).abs().sum().item()
    assert distance < 0.03, f"total variation {distance:.4f} from vLLM's probabilities"
    completed = tokens[0][:4].long()
    raw = Sampler.compute_logprobs(logits.expand(4, -1))
    out = sampling.sample(logits.expand(4, -1), make_rows(4, top_p=0.95, seed=8), candidates=VOCAB)
    assert out.token_ids.tolist() == completed.tolist()
    expected = Sampler.gather_logprobs(raw, sampling.LOGPROBS_CAP, completed)
    assert out.ranks.tolist() == expected.selected_token_ranks.tolist()


def test_the_sampler_lowers_to_stablehlo():
    backend = StableHLOBackend()
    compiled = torch.compile(
        lambda logits, rows: tuple(vars(sampling.sample(logits, rows)).values()),
        backend=backend,
        fullgraph=True,
        dynamic=False,
    )
    logits = torch.randn(8, 1000)
    rows = make_rows(8, temperature=0.9, top_k=30, top_p=0.9, min_p=0.01, seed=4)
    assert compiled(logits, rows)[0].tolist() == sampling.sample(logits, rows).token_ids.tolist()
    (graph,) = backend.graphs
    assert graph.broken_rules == []  # neuronx-cc's rules hold: no wide sort, no argmax's variadic reduce
    assert "rng" not in graph.stablehlo  # no random-number op in the graph


def test_requests_the_graph_cannot_sample_take_the_host():
    from vllm import SamplingParams

    def reason(**kwargs) -> str | None:
        return sampling_rows.describe(SamplingParams(**kwargs), 1000, "raw_logprobs").host_reason

    assert reason(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=3, logprobs=5) is None
    assert reason(top_k=1000) is None  # a top-k of the whole vocabulary is no top-k
    assert reason(top_k=300) == "top_k above 256"
    assert reason(repetition_penalty=1.1) == "penalties"
    assert reason(logit_bias={3: 1.0}) == "logit_bias"
    assert reason(min_tokens=2) == "min_tokens"
    assert reason(logprobs=21) == "logprobs above 20"
    assert reason(logprobs=-1) == "logprobs above 20"
    assert sampling_rows.describe(SamplingParams(logprobs=2), 1000, "processed_logprobs").host_reason
