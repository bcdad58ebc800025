"""What a compiled call costs, by what its bucket shape makes it compute: the automatic bucket policy's
objective. Two named profiles, a CPU measurement and a Trainium estimate; the policy is told which one
(`vllm_neuron/config.py`: the `call_costs` key, by default the profile of the device mode). Only the
ratios between the terms change the choice of buckets."""

from dataclasses import dataclass

from vllm_neuron.buckets import ceil_div
from vllm_neuron.calls import Call


@dataclass(frozen=True)
class CallCosts:
    """Milliseconds per unit of what a call computes; a call costs the sum of its terms."""

    call: float  # a pass over the weights, whatever the shape
    token: float  # each prefill token slot of the token bucket
    row: float  # each decode row slot of the batch bucket (its logits and sampling too)
    kv_position: float  # each KV position a decode call reads: batch bucket x pages of its context bucket
    attention: float  # each (query, key) pair of a prefill chunk (Call.chunk_pairs)

    def of(self, call: Call, page_tokens: int) -> float:
        """The estimated time of one call. A mixed call pays one pass over the weights for its decode rows
        and its chunk together: that is what it saves over two calls."""
        ms = self.call
        if call.phase != "prefill":
            read = call.batch * ceil_div(call.decode_context, page_tokens) * page_tokens
            # A verify row's queries each cost a row; they share its pages.
            ms += self.row * call.batch * call.queries + self.kv_position * read
        if call.phase in ("prefill", "mixed"):
            ms += self.token * call.token_bucket + self.attention * call.chunk_pairs
        return ms


# SmolLM2-135M in CPU mode on 2 cores, measured (docs/batching.md): a 1-row decode call 79 ms, a 32-row one
# over 128 pages 295 ms (half of it reading the pages), a 484-token prefill chunk 580 ms, a 48-token one
# 120 ms.
CPU_SMOLLM2 = CallCosts(call=70.0, token=1.1, row=2.3, kv_position=0.0092, attention=0.00025)


def roofline(
    *,
    weight_bytes: float,
    kv_bytes_per_token: float,
    flops_per_token: float,
    flops_per_pair: float,
    bandwidth: float,
    flops: float,
) -> CallCosts:
    """Costs of one tensor-parallel rank from its share of the model and its core's HBM bandwidth (bytes/s)
    and matmul throughput (FLOP/s): a call reads the weights once, a decode call reads every KV position of
    its pages, and token slots, row slots and attention pairs cost their matmul FLOPs. Adding the terms
    overstates a small call (its matmuls overlap the weight reads), which the buckets' choice tolerates:
    only the ratios matter."""
    ms_per_byte, ms_per_flop = 1e3 / bandwidth, 1e3 / flops
    per_token = flops_per_token * ms_per_flop
    return CallCosts(
        call=weight_bytes * ms_per_byte,
        token=per_token,
        row=per_token,
        kv_position=kv_bytes_per_token * ms_per_byte,
        attention=flops_per_pair * ms_per_flop,
    )


# Llama-3.1-8B at TP=4 (one trn2 chip), per logical core (LNC=2), from docs/performance.md: 0.725 TB/s and
# 158 dense BF16 TFLOPS; a quarter of the 16.06 GB of bf16 weights and 32 KiB of KV per token. A token
# costs 2 FLOPs per parameter of the rank (8.03 B / 4); an attention pair 2 x 2 x 128 (QK and PV over a head
# of 128) for each of the rank's 8 query heads in 32 layers. A call is then 5.5 ms (the roofline's batch-32
# step over 512 positions: 5.5 + 32 x 512 x 4.5e-5 = 6.3 ms), a token 0.025 ms: about 220 token slots cost
# a pass over the weights, where the CPU profile's 64 do. Not measured: to be replaced by a trn2 run's.
TRN2_ESTIMATE = roofline(
    weight_bytes=16.06e9 / 4,
    kv_bytes_per_token=32 * 1024,
    flops_per_token=2 * 8.03e9 / 4,
    flops_per_pair=2 * 2 * 128 * 8 * 32,
    bandwidth=0.725e12,
    flops=158e12,
)

PROFILES = {"cpu": CPU_SMOLLM2, "trn2": TRN2_ESTIMATE}


def profile_for(device_mode: str) -> str:
    """The profile a device mode plans with by default: its own."""
    return "trn2" if device_mode == "neuron" else "cpu"
