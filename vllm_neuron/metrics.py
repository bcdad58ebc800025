"""The plugin's Prometheus series, defined once.

They are recorded in the engine-core process. `vllm-neuron serve` sets PROMETHEUS_MULTIPROC_DIR before
anything imports prometheus_client, so vLLM's /metrics (a MultiProcessCollector then) shows them beside
vLLM's own series. Padding efficiency of a phase is
rate(vllm_neuron:padding_real_tokens_total[5m]) / rate(vllm_neuron:padding_slots_total[5m]).
"""

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

COMPILED_GRAPHS = Gauge(
    "vllm_neuron:compiled_graphs",
    "Graphs compiled for the model step (one per bucket shape after warm-up).",
    multiprocess_mode="livemax",
)
GRAPHS_READY = Gauge(
    "vllm_neuron:graphs_ready",
    "Graphs compiled and usable by steps (staged readiness: the minimal set at first, then each background "
    "compile as it finishes).",
    multiprocess_mode="livemax",
)
GRAPHS_PENDING = Gauge(
    "vllm_neuron:graphs_pending",
    "Graphs of the bucket set still compiling in the background (0 once every graph is ready).",
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
    "Real tokens computed by compiled calls (decode: one per request), by phase (prefill or decode; a mixed "
    "call counts under both).",
    ["phase"],
)
PADDING_SLOTS = Counter(
    "vllm_neuron:padding_slots",
    "Token slots computed by compiled calls, padding included, by phase.",
    ["phase"],
)
BUCKET_CALLS = Counter(
    "vllm_neuron:bucket_calls",
    "Compiled calls by phase and bucket shape (prefill: tokens x context, decode: batch x context, "
    "mixed: decode rows and a prefill chunk in one call, batch x context + chunk tokens; propose: an EAGLE3 "
    "head's drafts, batch x context).",
    ["phase", "bucket"],
)


COMPILE_SECONDS = Counter(
    "vllm_neuron:compile_seconds",
    "Seconds spent in calls that compiled a new graph (tracing, backend compile, first run), by phase.",
    ["phase"],
)
STEP_SECONDS = Histogram(
    "vllm_neuron:step_seconds",
    "Seconds of each scheduler step by part: schedule (the engine between two steps of running requests: "
    "output processing and scheduling), prepare (host: batch update, padding, inputs to device), forward "
    "(compiled calls: the model and its sampler), sample (outputs to host, and vLLM's sampler on a step that "
    "needs it), and host: the device's idle time since the previous step's calls ended while requests kept "
    "running, the host's share of the step (without async scheduling about schedule + prepare + sample).",
    ["part"],
    buckets=(0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
DEVICE_TO_HOST_BYTES = Histogram(
    "vllm_neuron:step_device_to_host_bytes",
    "Bytes each scheduler step copies from the device to the host: token ids, the logprobs asked for, and "
    "the logits of a step that takes vLLM's host sampler.",
    buckets=(256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864),
)
SAMPLED_STEPS = Counter(
    "vllm_neuron:sampled_steps",
    "Scheduler steps by where their tokens were sampled: device (the compiled graph only) or host (some row "
    "needed vLLM's host sampler; see /v1/neuron/info's sampling for which features take it).",
    ["sampler"],
)
KV_BLOCKS_TOTAL = Gauge(
    "vllm_neuron:kv_blocks_total",
    "KV cache blocks in device memory (block 0, vLLM's null block, excluded).",
    multiprocess_mode="livemax",
)
KV_BLOCKS_USED = Gauge(
    "vllm_neuron:kv_blocks_used",
    "KV cache blocks held by the requests of the latest step.",
    multiprocess_mode="livemax",
)
LORA_ADAPTERS_LOADED = Gauge(
    "vllm_neuron:lora_adapters_loaded",
    "LoRA adapters in device slots (at most --max-loras; vllm:lora_requests_info names those running).",
    multiprocess_mode="livemax",
)
DEVICE_MEMORY_USED = Gauge(
    "vllm_neuron:device_memory_used_bytes",
    "Device memory held by the worker's allocator (Neuron mode); in CPU mode, the worker's resident memory.",
    multiprocess_mode="livemax",
)

# A soak's signals, per process ("api": the HTTP server; "engine": the engine core, where the worker runs
# with one rank): sampled at most once a second while serving, and by the API server at each scrape.
PROCESS_RESIDENT_MEMORY = Gauge(
    "vllm_neuron:process_resident_memory_bytes",
    "Resident memory of a server process.",
    ["process"],
    multiprocess_mode="livemax",
)
PROCESS_OPEN_FDS = Gauge(
    "vllm_neuron:process_open_fds",
    "Open file descriptors of a server process.",
    ["process"],
    multiprocess_mode="livemax",
)
PROCESS_THREADS = Gauge(
    "vllm_neuron:process_threads", "Threads of a server process.", ["process"], multiprocess_mode="livemax"
)


def sample_process(process: str) -> None:
    """This process's resident memory, open file descriptors and threads, under `process`."""
    import psutil

    me = psutil.Process()
    PROCESS_RESIDENT_MEMORY.labels(process=process).set(me.memory_info().rss)
    PROCESS_OPEN_FDS.labels(process=process).set(me.num_fds())
    PROCESS_THREADS.labels(process=process).set(me.num_threads())


def graph_progress() -> dict[str, int]:
    """graphs_ready and graphs_pending as the engine-core process last set them, read from the Prometheus
    multiprocess folder (another process's gauges: the API server's start-up /health); {} without one, or
    before warm-up has counted its graphs (every process that imports this module shows them as 0)."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not folder or not os.path.isdir(folder):
        return {}
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    wanted = {_family_name(GRAPHS_READY): "graphs_ready", _family_name(GRAPHS_PENDING): "graphs_pending"}
    values = {
        wanted[sample.name]: int(sample.value)
        for family in registry.collect()
        for sample in family.samples
        if sample.name in wanted
    }
    return values if sum(values.values()) else {}


def _family_name(metric) -> str:
    """A metric's name as its samples carry it (prometheus_client's public `describe()`)."""
    return metric.describe()[0].name
