"""The graphs a rank compiles at start-up, by kind, and whether the model's compile while serving: the one
rule that `vllm-neuron check`'s plan, readiness's graphs_total and the graph reserve count by. Pure Python,
no torch.

- the model's: one graph per bucket shape of each phase (vllm_neuron/buckets.py);
- a draft model's (speculative decoding's draft_model method): one beside each of the model's, traced in the
  same warm-up step (worker/spec_decode/draft_model.py);
- an EAGLE3 head's propose calls (speculative decoding's eagle3 method): one beside each decode graph, traced
  after the same warm-up step (worker/spec_decode/eagle3.py; the head's first pass is inside the model's);
- NIXL's block copies (prefill/decode disaggregation): a gather and a scatter per bucket of blocks
  (worker/kv/nixl_blocks.py), compiled before the model's.
"""

from dataclasses import dataclass

from vllm_neuron.buckets import BucketConfig, powers_of_two

# The most bytes one NIXL block copy moves (every layer's pages): its graph's output or input lives in device
# memory beside the caches. Copies of more run as several.
COPY_BYTES = 256 << 20


def copy_buckets(largest: int) -> list[int]:
    """Block counts a NIXL copy is padded to: 1, 2, 4, ... below `largest`, then `largest`."""
    return powers_of_two(1, largest)


def max_copy_blocks(blocks_per_request: int, block_bytes: int) -> int:
    """The largest copy bucket: a request's blocks (vLLM copies a request's blocks at once) within COPY_BYTES;
    block_bytes: a block's pages of every layer on one rank."""
    return max(1, min(blocks_per_request, COPY_BYTES // block_bytes))


@dataclass(frozen=True)
class GraphPlan:
    buckets: BucketConfig
    draft_model: bool = False
    copy_buckets: tuple[int, ...] = ()  # NIXL's block-copy buckets; (): no NIXL connector
    propose: bool = False  # an EAGLE3 head's propose graphs

    def graphs_of(self, graph: tuple) -> int:
        """Graphs one bucket shape's warm-up step compiles: the model's, the draft model's, and with an
        EAGLE3 head a decode shape's propose graph."""
        return 1 + self.draft_model + (self.propose and graph[0] == "decode")

    @property
    def block_copies(self) -> int:
        return 2 * len(self.copy_buckets)

    def by_kind(self) -> dict[str, int]:
        buckets = self.buckets
        graphs = {
            "prefill": len(buckets.prefill_shapes()) + len(buckets.fresh_shapes()),
            "decode": len(buckets.decode_shapes()),
            "mixed": len(buckets.mixed_shapes()),
            "verify": len(buckets.verify_shapes()),
        }
        draft = {"draft": buckets.num_graphs} if self.draft_model else {}
        propose = {"propose": len(buckets.decode_shapes())} if self.propose else {}
        return graphs | draft | propose | ({"nixl": self.block_copies} if self.copy_buckets else {})

    @property
    def total(self) -> int:
        return sum(self.by_kind().values())


def staging_refused(one_rank: bool, kv_connector: bool) -> str | None:
    """Why the model's graphs beyond the minimal set cannot compile while serving (staged readiness,
    worker/compiles/readiness.py), or None where they can."""
    if not one_rank:
        return "tensor parallelism: every rank must plan the same calls, so agree on the ready graphs"
    if kv_connector:
        # A background trace of vLLM's attention op would see a serving step's KV connector metadata, and
        # trace the connector's per-layer hooks (worker/kv/kv_transfer.py).
        return "a KV connector"
    return None
