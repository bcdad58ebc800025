"""Sampling inside the compiled graph: greedy, temperature, top-k, top-p and min-p, with each row's
parameters as values of one [rows, PARAMS] tensor (no graph per parameter mix), so that only token ids (and
the logprobs a request asked for) leave the device.

vLLM's host sampler applies, in order: temperature, min-p, top-k, then top-p on what is left, and samples
from the renormalised rest. Each of those keeps the tokens whose scaled logit reaches a threshold, so here
each gives a threshold and the largest one masks the vocabulary once:
- top-k: the k-th of the TOP_K_CAP largest logits (a top-k above the cap takes the host sampler);
- min-p: the largest logit + log(min_p);
- top-p: the smallest of the sorted candidates whose exclusive cumulative probability (over what min-p and
  top-k keep) is below p. If the candidates hold less than p of that mass, the cut lies beyond them and the
  row's token is NO_TOKEN: the host samples that row for this step (`overflow`).

Speculative decoding's rejection sampling (a random request's draft token d at a verify row's query): the
row's DRAFT column names d, and the graph returns d's probability p(d) under the row's distribution, and a
token sampled from that distribution with d left out. The host accepts d with probability p(d) (the draft
is a point mass, as an n-gram proposer's is); otherwise the other token is the row's. Together that draws
exactly from the distribution (worker/spec_decode/speculation.py).

The random draw is one uniform number per row, made on the host (from a seeded request's own generator),
used by an inverse CDF over the whole vocabulary: chunk sums, a cumulative sum over chunks, then one within
the chosen chunk. Every op is static-shaped and elementwise, a reduction, a top-k or a small cumulative sum:
no per-vocabulary random numbers, and no top-k (a sort and a slice, as torch-mlir lowers it) wider than
neuronx-cc sorts (`staged_top_k`).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_neuron import trn2

TOP_K_CAP = 256  # candidates the graph sorts (AWS's Neuron sampler caps top-k at 256 too)
LOGPROBS_CAP = 20  # logprobs per token the graph returns (vLLM's default --max-logprobs)
NO_TOKEN = -1  # the row's top-p cut lies beyond the candidates: sample it on the host
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
_CHUNK = 256  # vocabulary chunk of the two-level inverse CDF

# Columns of a sampling row. top_k 0 and top_p 1 and min_p 0 are "off"; uniform is in [0, 1); draft is
# a draft token's id + 1 (0: none), so that a zeroed row (greedy padding) has none.
TEMPERATURE, TOP_K, TOP_P, MIN_P, UNIFORM, DRAFT = range(6)
PARAMS = 6


@dataclass
class SampledRows:
    """What the graph returns for its logits rows."""

    token_ids: torch.Tensor  # [rows] int32, NO_TOKEN where the host must sample
    logprob_token_ids: torch.Tensor  # [rows, LOGPROBS_CAP + 1] int32: the sampled token, then the top ones
    logprobs: torch.Tensor  # [rows, LOGPROBS_CAP + 1] float32, raw (before temperature), as vLLM's default
    ranks: torch.Tensor  # [rows] int32: the sampled token's rank by raw logprob (1 = the largest)
    draft_probs: torch.Tensor  # [rows] float32: the DRAFT token's probability (0 where none; random rows)


def may_overflow(row: Sequence[float]) -> bool:
    """Whether the graph may leave a row with this sampling row (its first columns at least) to the host
    (NO_TOKEN): a random row with top-p on and no top-k within the candidates (`sample`'s overflow)."""
    temperature, top_k, top_p = row[TEMPERATURE], row[TOP_K], row[TOP_P]
    return bool(top_p < 1 and temperature >= GREEDY_BELOW and not 0 < top_k <= TOP_K_CAP)


def sample(logits: torch.Tensor, rows: torch.Tensor, candidates: int = TOP_K_CAP) -> SampledRows:
    """Sample one token per row of `logits` [rows, vocab] with its sampling row (`rows` [rows, PARAMS],
    float32), over the `candidates` largest logits. The graph's are TOP_K_CAP; the host completes a NO_TOKEN
    row with the whole vocabulary as candidates and the same uniform draw, which is what an uncapped graph
    would give."""
    logits = logits.float()
    vocab = logits.shape[-1]
    candidates = min(candidates, vocab)
    temperature, top_k, top_p = rows[:, TEMPERATURE], rows[:, TOP_K], rows[:, TOP_P]
    min_p, uniform = rows[:, MIN_P], rows[:, UNIFORM]
    draft = (rows[:, DRAFT] - 1).long()  # -1: none
    greedy = temperature < GREEDY_BELOW

    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    top_values, top_ids = staged_top_k(scaled, candidates)  # sorted, largest first
    largest = top_values[:, :1]
    no_limit = torch.full_like(temperature, float("-inf"))

    # min-p: probability at least min_p times the largest one.
    min_p_cut = torch.where(min_p > 0, largest.squeeze(1) + torch.log(min_p.clamp(1e-30, 1.0)), no_limit)
    # top-k: the k-th largest (ties with it kept, as vLLM does).
    k_index = (top_k.long() - 1).clamp(0, candidates - 1).unsqueeze(1)
    top_k_cut = torch.where(top_k > 0, top_values.gather(1, k_index).squeeze(1), no_limit)
    cut = torch.maximum(min_p_cut, top_k_cut)

    # top-p over what min-p and top-k keep: their mass over the whole vocabulary, then the candidates'.
    weights = torch.where(scaled >= cut.unsqueeze(1), torch.exp(scaled - largest), 0.0)
    kept_mass = weights.sum(-1, keepdim=True)
    candidate_probs = torch.where(top_values >= cut.unsqueeze(1), torch.exp(top_values - largest), 0.0)
    candidate_probs = candidate_probs / kept_mass
    above = torch.cumsum(candidate_probs, dim=-1) - candidate_probs  # mass of the larger candidates
    in_nucleus = (above < top_p.unsqueeze(1)) & (candidate_probs > 0)
    smallest_kept = torch.where(in_nucleus, top_values, float("inf")).amin(-1)
    top_p_active = top_p < 1
    top_p_cut = torch.where(top_p_active, smallest_kept, no_limit)
    # A top-k within the candidates keeps only candidates: its cut is among them (float sums aside).
    top_k_within = (top_k > 0) & (top_k <= candidates)
    overflow = top_p_active & ~greedy & ~top_k_within & (candidate_probs.sum(-1) < top_p)
    if candidates == vocab:  # the whole vocabulary: the cut always lies within the candidates
        overflow = torch.zeros_like(overflow)

    final_cut = torch.maximum(cut, top_p_cut).unsqueeze(1)
    kept = torch.where(scaled >= final_cut, weights, 0.0)
    is_draft = torch.arange(vocab, device=logits.device).unsqueeze(0) == draft.unsqueeze(1)
    draft_probs = torch.where(is_draft, kept, 0.0).sum(-1) / kept.sum(-1)
    sampled = _inverse_cdf(torch.where(is_draft, 0.0, kept), uniform)
    token_ids = torch.where(greedy, greedy_tokens(logits), sampled)
    token_ids = torch.where(overflow, NO_TOKEN, token_ids)

    # Raw logprobs (vLLM's default logprobs mode): of the sampled token, then of the largest ones.
    raw = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = raw.gather(1, token_ids.clamp(0, vocab - 1).unsqueeze(1))
    top = top_ids[:, : min(LOGPROBS_CAP, candidates)]
    return SampledRows(
        token_ids=token_ids.to(torch.int32),
        logprob_token_ids=torch.cat([token_ids.unsqueeze(1), top], dim=1).to(torch.int32),
        logprobs=torch.cat([chosen, raw.gather(1, top)], dim=1),
        ranks=(raw >= chosen).sum(-1).to(torch.int32),
        draft_probs=draft_probs,
    )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension (the first index of the largest) as a max, a compare and a min: no
    reduce of a value and its index together, which neuronx-cc compiles for minutes over a vocabulary
    (aws-neuron-sdk#1210; docs/research/issue-52-neuronx-cc-rules.md). A row of NaN gives the last index."""
    width = logits.shape[-1]
    index = torch.arange(width, device=logits.device)
    first = torch.where(logits == logits.amax(-1, keepdim=True), index, width).amin(-1)
    return torch.where(first < width, first, width - 1)


def staged_top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk of each row of x [rows, width], its largest first, in stages no wider than neuronx-cc
    sorts (trn2.SORT_LIMIT): the row in chunks of at most that width, the top k of each, then the top k of
    the chunks' winners. The winners keep the chunks' order, so where every top-k puts the lower index first
    on equal values (XLA's and a one-stage top-k alike), so does this. Chunks are as even as the width allows,
    the last one shorter: no padding, whose indices could otherwise be picked in a row of -inf."""
    rows, width = x.shape
    if width <= trn2.SORT_LIMIT:
        return torch.topk(x, k, dim=-1)
    size = -(-width // -(-width // trn2.SORT_LIMIT))
    whole = width // size
    parts = [(x[:, : whole * size].reshape(rows, whole, size), 0)]
    if whole * size < width:
        parts.append((x[:, whole * size :].unsqueeze(1), whole * size))
    values, ids = [], []
    for chunks, start in parts:
        chunk_values, chunk_ids = torch.topk(chunks, min(k, chunks.shape[-1]), dim=-1)
        offsets = torch.arange(chunks.shape[1], device=x.device).view(1, -1, 1) * size + start
        values.append(chunk_values.reshape(rows, -1))
        ids.append((chunk_ids + offsets).reshape(rows, -1))
    best, picked = staged_top_k(torch.cat(values, dim=1), k)
    return best, torch.cat(ids, dim=1).gather(1, picked)


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative weight first passes uniform x total, per row: [rows] int64. Two levels
    (chunks, then a position in the chosen chunk) keep each cumulative sum short."""
    rows, vocab = weights.shape
    chunks = -(-vocab // _CHUNK)
    padded = torch.nn.functional.pad(weights, (0, chunks * _CHUNK - vocab)).reshape(rows, chunks, _CHUNK)
    chunk_mass = padded.sum(-1)
    chunk_ends = torch.cumsum(chunk_mass, dim=-1)
    target = uniform.unsqueeze(1) * chunk_ends[:, -1:]
    chunk = _first_passing(chunk_ends, target, chunk_mass)
    rest = target - (chunk_ends.gather(1, chunk) - chunk_mass.gather(1, chunk))
    within = padded.gather(1, chunk.unsqueeze(2).expand(rows, 1, _CHUNK)).squeeze(1)
    position = _first_passing(torch.cumsum(within, dim=-1), rest, within)
    return (chunk * _CHUNK + position).squeeze(1)


def _first_passing(ends: torch.Tensor, target: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: how many cumulative `ends` are at most `target`, kept at or before the last entry with
    mass (rounding can carry a target past the last nonzero weight)."""
    count = (ends <= target).sum(-1, keepdim=True)
    index = torch.arange(ends.shape[-1], device=ends.device)
    last = torch.where(mass > 0, index, 0).amax(-1, keepdim=True)
    return torch.minimum(count, last)
