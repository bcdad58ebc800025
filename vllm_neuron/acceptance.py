"""Speculative decoding's figures, from vLLM's own counters (vllm:spec_decode_*): /v1/neuron/info and the
load generator's report compute them the one way. Pure Python, no vLLM import."""

DRAFTS = "vllm:spec_decode_num_drafts_total"  # verified rows that had drafts
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED)


def figures(drafts: float, draft_tokens: float, accepted: float) -> dict[str, float | None]:
    """Counts and rates (None before any draft): the share of draft tokens accepted, and the tokens a
    request gains from one verify step (its accepted drafts and the target's own token: vLLM's mean
    acceptance length)."""
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "tokens_per_verify_step": 1 + accepted / drafts if drafts else None,
    }
