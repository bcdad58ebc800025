"""Speculative decoding's two host-side rules: which requests get draft tokens, and how many of a verified
row's drafts are accepted. vLLM's n-gram proposer (prompt lookup) proposes; its scheduler schedules each
decode row's last token and drafts, and rolls the positions of rejected drafts back.

Drafts go to requests the graph samples that ask no logprobs; the others (vLLM's host sampler, logprobs)
decode one token a step. At each query of a verify row the graph samples the target model's token:
- greedy: its argmax, so accepting the drafts that equal it, then taking the target's token after them,
  gives exactly the tokens decoding one by one would: the output never depends on the drafts;
- random: speculative sampling with the n-gram drafts as point masses. The graph returns each draft's
  probability p(d) under the row's distribution (temperature, top-k, top-p, min-p applied) and a token drawn
  from that distribution with d left out (vllm_neuron/sampling.py); the host accepts d with probability
  p(d), and at the first rejection takes the other token. Each token is then drawn from exactly the
  distribution plain decoding draws it from. A seeded request draws its uniforms from its own generator.
vLLM's rejection sampler does the same in Triton kernels, which neither the CPU nor Trainium runs.
"""

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import DraftTokenIds

from vllm_neuron import sampling
from vllm_neuron.upstream import vllm_runner
from worker.step.sampling_rows import RowSampling
from worker.step.step_state import RunningStep, ToHost, uniforms

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import InputBatch


def speculates(params: "SamplingParams | None", row: RowSampling, host_sampler_only: bool) -> bool:
    """Whether a request gets draft tokens: sampled in the graph, no logprobs asked."""
    return (
        params is not None and params.logprobs is None and row.host_reason is None and not host_sampler_only
    )


def is_greedy(row: RowSampling) -> bool:
    return row.values[sampling.TEMPERATURE] < sampling.GREEDY_BELOW


def set_drafts(rows: np.ndarray, drafts: list[int], source: torch.Generator | bool) -> None:
    """A random verify row's sampling rows (one per query, each the row's own): query j < len(drafts)
    leaves draft j out of its sample and reports its probability; queries after the first get uniform
    draws of their own (the first has the row's, drawn as for any row)."""
    rows[: len(drafts), sampling.DRAFT] = np.asarray(drafts) + 1
    rows[1 : len(drafts) + 1, sampling.UNIFORM] = uniforms(source, len(drafts))


def accepted_tokens(drafts: list[int], targets: np.ndarray) -> list[int]:
    """A verify row's new tokens: the drafts equal to the target's token at their query, then the target's
    token at the first query that differs (or after the last draft). targets[j] is the target's token after
    the row's last token and drafts[:j]."""
    count = 0
    while count < len(drafts) and drafts[count] == targets[count]:
        count += 1
    return [int(token) for token in targets[: count + 1]]


def accepted_sampled(
    drafts: list[int], targets: np.ndarray, draft_probs: np.ndarray, source: torch.Generator | bool
) -> list[int]:
    """A random verify row's new tokens: draft j is accepted with its probability draft_probs[j] under the
    target's distribution at its query (one uniform draw each, from `source`); at the first rejection the
    row takes targets[j] (drawn without draft j), after all of them targets[len(drafts)]."""
    draws = uniforms(source, len(drafts))
    count = 0
    while count < len(drafts) and draws[count] < draft_probs[count]:
        count += 1
    return [*map(int, drafts[:count]), int(targets[count])]


class Drafter:
    """Proposes each step's draft tokens from the persistent batch once the step's tokens are in it; the
    engine takes them (take_draft_token_ids) before it schedules the next step."""

    def __init__(self, vllm_config: "VllmConfig") -> None:
        self.proposer = vllm_runner.ngram_proposer(vllm_config)
        self._drafts: DraftTokenIds | None = None

    @classmethod
    def for_config(cls, vllm_config: "VllmConfig") -> "Drafter | None":
        """The n-gram drafter of the engine's speculative config (None: speculative decoding is off, or a
        draft model proposes: worker/spec_decode/draft_model.py)."""
        speculative = vllm_config.speculative_config
        if speculative is None or speculative.method != "ngram":
            return None
        return cls(vllm_config)

    def propose(
        self,
        batch: "InputBatch",
        req_ids: list[str],
        sampled: list[list[int]],
        eligible: list[bool],
        num_tokens: int,
    ) -> None:
        """Up to `num_tokens` drafts (the scheduler's number for the next step) for the step's rows
        (`req_ids`, the batch's rows in order) that sampled a token and may speculate; the proposer reads
        each row's tokens from the batch, the step's included."""
        assert batch.req_ids == req_ids, "the batch changed between a step and its drafts"
        asked = [tokens if ok else [] for tokens, ok in zip(sampled, eligible, strict=True)]
        threads = torch.get_num_threads()
        drafts = vllm_runner.propose_ngram_drafts(
            self.proposer, num_tokens, asked, batch.num_tokens_no_spec, batch.token_ids_cpu
        )
        # The proposer sets numba's thread count and restores numba's default, which under its OpenMP layer
        # is this thread's torch thread count too: dynamo guards on that, and a changed count recompiles
        # every graph (a tensor-parallel rank runs fewer threads than the host's cores).
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self._drafts = DraftTokenIds(list(req_ids), drafts)

    def take(self) -> DraftTokenIds | None:
        drafts, self._drafts = self._drafts, None
        return drafts


def accept_drafts(
    step: RunningStep,
    sampled_ids: list[list[int]],
    to_host: ToHost,
    speculating: list[bool],
    greedy: list[bool],
    generators: dict[int, torch.Generator],
) -> None:
    """Verify rows' tokens in place of their one token: a greedy row's drafts equal to the target's token,
    then the target's token (accepted_tokens); a random row's drafts accepted by their probability, then the
    target's token drawn without the first rejected one (accepted_sampled). `speculating`, `greedy`: per
    batch row; a request that may not speculate got no drafts, and its one token stands."""
    for call_index, out in enumerate(step.outputs):
        if out.queries == 1:
            continue
        targets = out.all_queries("token_ids", to_host).numpy()
        draft_probs = None
        for index, row in enumerate(out.batch_rows):
            row_drafts = step.drafts.get(row)
            if not row_drafts or not speculating[row]:
                continue
            if greedy[row]:
                sampled_ids[row] = accepted_tokens(row_drafts, targets[index])
                continue
            if draft_probs is None:
                draft_probs = out.all_queries("draft_probs", to_host).numpy()
            row_targets, row_probs = targets[index], draft_probs[index]
            if (row_targets[: len(row_drafts) + 1] == sampling.NO_TOKEN).any():
                # A top-p cut beyond the graph's candidates: the row's queries again over the whole
                # vocabulary, with their own parameters and draws.
                queries = slice(index * out.queries, (index + 1) * out.queries)
                logits = out.part("logits", queries, to_host).float()
                rows = torch.from_numpy(step.planned[call_index].sampling_rows[queries])
                done = sampling.sample(logits, rows, candidates=logits.shape[-1])
                row_targets, row_probs = done.token_ids.numpy(), done.draft_probs.numpy()
            sampled_ids[row] = accepted_sampled(row_drafts, row_targets, row_probs, generators.get(row, True))
