"""Which requests the compiled graph samples, and the sampling rows it samples them with.

A request the graph cannot sample exactly (what vLLM's sampler does beyond temperature, top-k, top-p and
min-p) takes vLLM's host sampler; a step with any such row copies its logits to the host. The graph's own
rows keep its tokens on such a step too, so a seeded request's output never depends on its batch.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_neuron import envs, sampling

if TYPE_CHECKING:  # not at run time: the API server imports this before vLLM has resolved its platform
    from vllm.config import ModelConfig
    from vllm.sampling_params import SamplingParams

# What the graph samples, and what takes the host sampler (the start-up log and /v1/neuron/info).
ON_DEVICE = (
    "greedy",
    "temperature",
    f"top_k up to {sampling.TOP_K_CAP}",
    "top_p",
    "min_p",
    "seed",
    f"logprobs up to {sampling.LOGPROBS_CAP}",
)
ON_HOST = (
    "presence, frequency and repetition penalties",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "structured outputs",
    f"top_k above {sampling.TOP_K_CAP}",
    f"logprobs above {sampling.LOGPROBS_CAP}, or -1 (the whole vocabulary)",
    "logprob_token_ids",
    "thinking_token_budget",
    "logits processors given to the engine",
    "a logprobs mode other than raw_logprobs",
    f"a row whose top_p cut lies beyond its {sampling.TOP_K_CAP} largest logits: the graph's sampler again, "
    "over the whole vocabulary, with the same draw (that row, that step)",
)


def host_only(model_config: "ModelConfig") -> bool:
    """Every step takes vLLM's host sampler: VLLM_NEURON_SAMPLER=host, or logits processors the graph cannot
    apply."""
    return envs.VLLM_NEURON_SAMPLER == "host" or bool(model_config.logits_processors)


def summary(host_only: bool) -> dict[str, object]:
    """Where each sampling feature runs (/v1/neuron/info, the start-up log)."""
    return {
        "sampler": "host" if host_only else "device",
        "on_device": [] if host_only else list(ON_DEVICE),
        "on_host": ["everything"] if host_only else list(ON_HOST),
        "top_k_cap": sampling.TOP_K_CAP,
        "logprobs_cap": sampling.LOGPROBS_CAP,
    }


def start_up_line(host_only: bool) -> str:
    """Where sampling runs, for the start-up log."""
    if host_only:
        return (
            "Sampling: every step on the host, with vLLM's sampler (VLLM_NEURON_SAMPLER=host or logits "
            "processors)"
        )
    return (
        f"Sampling in the compiled graph: {', '.join(ON_DEVICE)}; with vLLM's host sampler, on the steps "
        f"they are in: {'; '.join(ON_HOST)}"
    )


@dataclass(frozen=True)
class RowSampling:
    """One request's sampling row before its draw (temperature, top_k, top_p, min_p), why it takes the
    host sampler (None: the graph samples it), and whether the graph may leave its token to the host
    (sampling.may_overflow)."""

    values: tuple[float, float, float, float]
    host_reason: str | None
    may_overflow: bool = False


def describe(params: "SamplingParams | None", vocab_size: int, logprobs_mode: str) -> RowSampling:
    if params is None:  # a pooling request: no token to sample
        return RowSampling((0.0, 0.0, 1.0, 0.0), "no sampling parameters")
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    row = (
        params.temperature if params.temperature >= sampling.GREEDY_BELOW else 0.0,
        float(top_k),
        params.top_p,
        params.min_p,
    )
    return RowSampling(row, host_reason(params, top_k, logprobs_mode), sampling.may_overflow(row))


def host_reason(params: "SamplingParams", top_k: int, logprobs_mode: str) -> str | None:
    """Why the graph cannot sample this request (None: it can)."""
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        return "penalties"
    if params.logit_bias:
        return "logit_bias"
    if params.allowed_token_ids is not None:
        return "allowed_token_ids"
    if params.bad_words or params.bad_words_token_ids:
        return "bad_words"
    if params.min_tokens:
        return "min_tokens"
    if params.structured_outputs is not None:
        return "structured outputs"
    if top_k > sampling.TOP_K_CAP:
        return f"top_k above {sampling.TOP_K_CAP}"
    if params.logprobs is not None and not 0 <= params.logprobs <= sampling.LOGPROBS_CAP:
        return f"logprobs above {sampling.LOGPROBS_CAP}"
    if params.logprobs is not None and logprobs_mode != "raw_logprobs":
        return f"logprobs mode {logprobs_mode}"
    if params.logprob_token_ids:
        return "logprob_token_ids"
    if params.thinking_token_budget is not None:
        return "thinking_token_budget"
    return None


def build(
    requests: list[RowSampling],
    draw_from: list[torch.Generator | None | bool],
) -> np.ndarray:
    """[len(requests), PARAMS] float32: each request's sampling row with its uniform draw. `draw_from` per
    row: the request's own generator (a seeded request), True (the global generator), or False (no draw: the
    row's sample is discarded or the host samples it, and a seeded request's generator must not advance)."""
    rows = np.zeros((len(requests), sampling.PARAMS), dtype=np.float32)
    if not requests:
        return rows
    rows[:, : sampling.UNIFORM] = [request.values for request in requests]
    rows[:, sampling.UNIFORM] = 0.5
    unseeded = [index for index, source in enumerate(draw_from) if source is True]
    if unseeded:
        rows[unseeded, sampling.UNIFORM] = uniforms(True, len(unseeded))
    for index, source in enumerate(draw_from):
        if isinstance(source, torch.Generator):
            rows[index, sampling.UNIFORM] = uniforms(source, 1)[0]
    return rows


def uniforms(source: torch.Generator | bool, count: int) -> np.ndarray:
    """`count` uniform draws in [0, 1) from a seeded request's generator, or (True) the global one."""
    generator = source if isinstance(source, torch.Generator) else None
    return torch.rand(count, generator=generator).numpy()
