"""The prefill share: how many prefill tokens a step may carry beside its decode rows (at most the setting
`prefill_tokens_while_decoding` under light load, else vLLM's whole budget). One rule, applied by the
scheduler (vllm_neuron/scheduler.py) and modelled by the bucket policy's simulation
(vllm_neuron/planning/step_simulation.py)."""

# Prompts waiting beyond one per this many decoding streams are a queue, not an arrival beside running
# streams: a capped share would hold all of them to one share-sized piece of one prompt per step (at the
# ramp of a busy server, half the batch decoding while the other half waits for its prompts).
STREAMS_PER_WAITING_PROMPT = 4


def prefill_share(
    decoding: int, prefilling: int, max_num_seqs: int, prefill_tokens_while_decoding: int, full_budget: int
) -> int:
    """Prefill tokens a step may carry beside `decoding` decode rows while `prefilling` requests wait for
    (more of) their prompt: the setting `prefill_tokens_while_decoding` under light load; 0 means vLLM's
    whole budget."""
    few_waiting = prefilling <= max(1, decoding // STREAMS_PER_WAITING_PROMPT)
    light_load = decoding <= max_num_seqs // 2 and few_waiting
    if not decoding or not light_load or not prefill_tokens_while_decoding:
        return 0
    return min(prefill_tokens_while_decoding, full_budget)
