"""vLLM's scheduler, with prefill held to a small share of each step while requests are decoding.

A step's duration, and with it the inter-token latency of every running stream, grows with the prefill
tokens it carries. Under light load (the decode batch at most half full, and only a few prompts waiting: at
most one per `STREAMS_PER_WAITING_PROMPT` streams decoding, and always one) a step carries at most
`prefill_tokens_while_decoding` prefill tokens beside the decode rows: the running streams' pace is what
users feel then, and a long prompt is prefilled a little per step. Otherwise (a full decode batch, or a
queue of arrivals) throughput and everyone's time to first token win, and prefill gets vLLM's whole
`--max-num-batched-tokens` budget, as it does with nothing decoding. Everything else (admission, chunking,
prefix caching, preemption) is vLLM's own scheduler, unchanged, but for one thing: with --kv-events-config, a
reset of the prefix cache (sleep, /reset_prefix_cache) is published at once (`ResetPublishedAtOnce`).
"""

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_neuron.config import NeuronConfig
from vllm_neuron.prefill_share import prefill_share
from vllm_neuron.upstream import vllm_engine


class PrefillShare:
    """The prefill share, over vLLM's Scheduler or its AsyncScheduler (which schedules a step while the
    previous one runs); mixed in before either."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        neuron_config = NeuronConfig.of(vllm_config)
        self.prefill_tokens_while_decoding = neuron_config.buckets.prefill_tokens_while_decoding
        self.max_num_seqs = neuron_config.max_num_seqs
        # With speculative decoding a decoding request is scheduled its last token and its draft tokens.
        speculative = vllm_config.speculative_config
        self.tokens_per_decode_row = 1 + (speculative.num_speculative_tokens if speculative else 0)
        # vLLM's token budget and per-request prefill cap, which schedule() changes from step to step.
        self.full_token_budget, self.configured_prefill_cap = vllm_engine.own_step_limits(self)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        decoding = sum(1 for request in self.running if not request.is_prefill_chunk)
        prefilling = len(self.running) - decoding + len(self.waiting)
        share = prefill_share(
            decoding,
            prefilling,
            self.max_num_seqs,
            self.prefill_tokens_while_decoding,
            self.full_token_budget,
        )
        if share:
            # Every prefill chunk is capped at the share too: a chunk ahead of the decoding requests in the
            # running queue must not take their tokens.
            vllm_engine.set_step_limits(
                self,
                min(self.full_token_budget, decoding * self.tokens_per_decode_row + share),
                min(share, self.configured_prefill_cap or share),
            )
        else:
            vllm_engine.set_step_limits(self, self.full_token_budget, self.configured_prefill_cap)
        return super().schedule(throttle_prefills)


class ResetPublishedAtOnce:
    """vLLM publishes KV events with a step's output, so the AllBlocksCleared of a reset made while nothing
    runs (sleep discards the KV cache this way) would reach a router only with the first step after wake-up,
    and the router would score blocks this server no longer holds until then. Mixed in before the scheduler
    class."""

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        reset = super().reset_prefix_cache(reset_running_requests, reset_connector)
        vllm_engine.publish_kv_events(self)
        return reset


class NeuronScheduler(ResetPublishedAtOnce, PrefillShare, Scheduler):
    """vLLM's scheduler with the prefill share (async scheduling off)."""


class NeuronAsyncScheduler(ResetPublishedAtOnce, PrefillShare, AsyncScheduler):
    """vLLM's async scheduler with the prefill share: the engine schedules a step while the previous one runs
    on the device, and the runner feeds the previous step's tokens to the next itself."""
