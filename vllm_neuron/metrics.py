"""The plugin's Prometheus series, defined once.

They are recorded in the engine-core process. `vllm-neuron serve` sets PROMETHEUS_MULTIPROC_DIR before
anything imports prometheus_client, so vLLM's /metrics (a MultiProcessCollector then) shows them beside
vLLM's own series. Padding efficiency of a phase is
rate(vllm_neuron:padding_real_tokens_total[5m]) / rate(vllm_neuron:padding_slots_total[5m]).
"""

from prometheus_client import Counter, Gauge

COMPILED_GRAPHS = Gauge(
    "vllm_neuron:compiled_graphs",
    "Graphs compiled for the model step (one per bucket shape after warm-up).",
    multiprocess_mode="livemax",
)
UNEXPECTED_RECOMPILES = Counter(
    "vllm_neuron:unexpected_recompiles",
    "Graphs compiled after warm-up: a call whose shape is outside the configured buckets.",
)
WARMUP_SECONDS = Gauge(
    "vllm_neuron:warmup_seconds",
    "Seconds warm-up spent compiling and running each phase's bucket shapes.",
    ["phase"],
    multiprocess_mode="livemax",
)
PADDING_REAL_TOKENS = Counter(
    "vllm_neuron:padding_real_tokens",
    "Real tokens computed by compiled calls (decode: one per request), by phase.",
    ["phase"],
)
PADDING_SLOTS = Counter(
    "vllm_neuron:padding_slots",
    "Token slots computed by compiled calls, padding included, by phase.",
    ["phase"],
)
BUCKET_CALLS = Counter(
    "vllm_neuron:bucket_calls",
    "Compiled calls by phase and bucket shape (prefill: tokens x context, decode: batch x context).",
    ["phase", "bucket"],
)


class CallStats:
    """Per-process tallies of compiled calls while serving, mirrored into the Prometheus series above."""

    def __init__(self) -> None:
        self.real_tokens = {"prefill": 0, "decode": 0}
        self.slots = {"prefill": 0, "decode": 0}
        self.bucket_calls: dict[tuple[str, str], int] = {}

    def record(self, phase: str, bucket: str, real: int, slots: int) -> None:
        self.real_tokens[phase] += real
        self.slots[phase] += slots
        key = (phase, bucket)
        self.bucket_calls[key] = self.bucket_calls.get(key, 0) + 1
        PADDING_REAL_TOKENS.labels(phase=phase).inc(real)
        PADDING_SLOTS.labels(phase=phase).inc(slots)
        BUCKET_CALLS.labels(phase=phase, bucket=bucket).inc()

    def efficiency(self, phase: str) -> float | None:
        """Real tokens / computed token slots of a phase, None before its first call."""
        return self.real_tokens[phase] / self.slots[phase] if self.slots[phase] else None
