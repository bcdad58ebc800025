"""Every setting of the plugin, in one table: its environment variable, its `vllm-neuron serve` flag, its
--additional-config key, its type and default, what it means and which module reads it.

vllm_neuron/envs.py reads the variables from it, server/options.py makes the flags from it, config.py takes
the --additional-config keys from it, and docs/configuration.md's table is written from it
(`make settings-doc`, vllm_neuron/settings_doc.py). A meaning is markdown that reads as plain text too (it
is also the flag's --help); `docs/NAME.md` in it becomes a link in the doc.
"""

import os
from dataclasses import dataclass
from typing import Any

from vllm_neuron.call_costs import PROFILES
from vllm_neuron.setting_types import (
    Choice,
    Fraction,
    Integer,
    IntList,
    JsonObject,
    Kind,
    Switch,
    Text,
)


@dataclass(frozen=True)
class Setting:
    meaning: str
    kind: Kind
    read_in: str  # the module that reads it (where its effect is decided)
    env: str | None = None  # VLLM_NEURON_* variable
    key: str | None = None  # --additional-config key; a variable set beside it wins
    flag: str | None = None  # `vllm-neuron serve` flag: sets the variable
    metavar: str | None = None  # the flag's argument in --help
    default: Any = None  # unset or absent; None where the reader derives it (shown_default says how)
    shown_default: str | None = None  # the doc's default, where `default` alone does not say it


_BUCKET_LIST = "Comma-separated in the variable, a JSON list in --additional-config"

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "`auto` activates the plugin only where TorchNeuron sees a Neuron device; `cpu` runs the same plugin "
        "on the host CPU (development and CI); docs/configuration.md#cpu-mode-and-neuron-mode.",
        Choice(("auto", "neuron", "cpu")),
        "vllm_neuron/device.py",
        env="VLLM_NEURON_DEVICE",
        flag="--device",
        default="auto",
    ),
    Setting(
        "The device whose defaults the configuration is resolved for (the prefill share of a step, the "
        "automatic bucket policy's call costs, vLLM's batch defaults); unset: the device mode. "
        "`vllm-neuron check` sets `neuron`, so a CPU resolves the plan a Trainium server would.",
        Choice(("neuron", "cpu")),
        "vllm_neuron/device.py",
        env="VLLM_NEURON_TARGET",
        default="",
        shown_default="the device mode",
    ),
    Setting(
        "CPU mode: whether the host's bfloat16 counts as native (`auto`: AVX-512 BF16 or AMX present). Where "
        "it is emulated, `--dtype auto` serves a bfloat16 checkpoint in float32; an explicit `--dtype` is "
        "served as asked.",
        Choice(("auto", "native", "emulated")),
        "vllm_neuron/host_cpu.py",
        env="VLLM_NEURON_CPU_BF16",
        default="auto",
    ),
    Setting(
        "torch.compile backend of the compiled model and sampler: `neuron` (Trainium), `eager` (CPU), "
        "`stablehlo` (TorchNeuron's lowering to StableHLO on a CPU: every graph must lower; "
        "docs/lowering.md), `xla` (the same lowering, then XLA's CPU compiler compiles and runs that "
        "StableHLO, the KV caches updated in place), `lower-only` (the same lowering without running the "
        "graphs: outputs are zeros; what `vllm-neuron check` uses), `inductor`, any other registered "
        "torch.compile backend, or `none` (no torch.compile, for debugging).",
        Text(),
        "vllm_neuron/device.py",
        env="VLLM_NEURON_COMPILE_BACKEND",
        flag="--compile-backend",
        metavar="NAME",
        default="",
        shown_default="`neuron` on Trainium, `eager` on CPU",
    ),
    Setting(
        "What implements the KV write and attention ops (`kv_cache/kernels.py`): `torch` (the plain torch of "
        "`kv_cache/ops.py`, on every device) or `nki` (AWS's NKI kernels: refused at start-up while none is "
        "bound to the ops; docs/lowering.md#the-kernel-seam-the-kv-write-and-attention-as-custom-ops).",
        Choice(("torch", "nki")),
        "vllm_neuron/attention_backend.py",
        env="VLLM_NEURON_ATTENTION_KERNELS",
        default="torch",
    ),
    Setting(
        "Folder where the `stablehlo` and `xla` backends write each graph's FX graph and StableHLO (and, "
        "under `xla`, XLA's optimised HLO), named by call (phase and bucket).",
        Text(lower=False),
        "worker/step/forward.py",
        env="VLLM_NEURON_DUMP_GRAPHS",
        flag="--dump-graphs",
        metavar="DIR",
        default="",
        shown_default="unset: none written",
    ),
    Setting(
        "`1`: a compile after warm-up (a shape outside the buckets) is refused with an error instead of "
        "being counted and logged. For CI and canaries.",
        Switch(),
        "worker/step/forward.py",
        env="VLLM_NEURON_STRICT_SHAPES",
        flag="--strict-shapes",
        default=False,
    ),
    Setting(
        "`staged`: /health answers 200 once two graphs that serve any request are compiled (one prefill, one "
        "decode); the others compile in the background, each used once ready, so no request waits for a "
        "compile. `full`: every graph compiles before /health answers 200. docs/compile-cache.md.",
        Choice(("staged", "full")),
        "worker/compiles/readiness.py",
        env="VLLM_NEURON_READINESS",
        flag="--readiness",
        default="staged",
    ),
    Setting(
        "Compiles at once, each in its own process (neuronx-cc; inductor in CPU mode): staged readiness's "
        "background compiles, and full readiness's after the first two graphs. `0`: one per 16 host CPUs, "
        "1 to 8, on Trainium; 1 in CPU mode.",
        Integer(minimum=0, hint=" (0: automatic)"),
        "worker/step/model_runner.py",
        env="VLLM_NEURON_COMPILE_WORKERS",
        flag="--compile-workers",
        metavar="N",
        default=0,
    ),
    Setting(
        "`device`: the compiled graph samples every request it can (greedy, temperature, top-k up to 256, "
        "top-p, min-p, seeds, logprobs up to 20) and only token ids leave the device; the others take vLLM's "
        "host sampler on the steps they are in (docs/configuration.md#where-sampling-runs). `host`: every "
        "step copies its logits to the host for vLLM's sampler.",
        Choice(("device", "host")),
        "worker/step/sampling_rows.py",
        env="VLLM_NEURON_SAMPLER",
        flag="--sampler",
        default="device",
    ),
    Setting(
        "With async scheduling, run each step's compiled calls on a thread of their own, so that the engine "
        "schedules and prepares the next step meanwhile. `auto`: on with Trainium, off in CPU mode (there "
        "the calls and the host share the same cores); `on` in CPU mode runs Trainium's arrangement, to test "
        "it or to measure the host time it leaves between calls.",
        Choice(("auto", "on", "off")),
        "vllm_neuron/device.py",
        env="VLLM_NEURON_DEVICE_THREAD",
        default="auto",
    ),
    Setting(
        "Path of a JSON-lines file that gets one line per served step: wall time, compiled calls, decode "
        "rows, prefill tokens, milliseconds of prepare / forward / sample, since the previous step ended and "
        "the host's share, bytes copied from the device and where the step sampled. For finding what makes "
        "a slow token (docs/batching.md).",
        Text(lower=False),
        "worker/metrics/step_metrics.py",
        env="VLLM_NEURON_STEP_TRACE",
        default="",
        shown_default="unset: no trace",
    ),
    Setting(
        "Root of the persistent compile cache: NEFFs on Trainium, inductor artefacts and the `xla` backend's "
        "executables in CPU mode, one folder per configuration; share it across pods on a ReadWriteMany "
        "volume (docs/compile-cache.md).",
        Text(lower=False),
        "vllm_neuron/compiler/compile_cache.py",
        env="VLLM_NEURON_CACHE_ROOT",
        flag="--compile-cache-root",
        metavar="PATH",
        default="",
        shown_default="`$XDG_CACHE_HOME/vllm-neuron/compile`",
    ),
    Setting(
        "Where the `xla` backend keeps the executables XLA compiled, by StableHLO module and host.",
        Text(lower=False),
        "vllm_neuron/compiler/xla.py",
        env="VLLM_NEURON_XLA_CACHE_DIR",
        default="",
        shown_default="the configuration's folder of the compile cache, `<root>/<key>/xla`",
    ),
    Setting(
        "Folder for the converted default model.",
        Text(lower=False),
        "server/default_model.py",
        env="VLLM_NEURON_MODEL_CACHE",
        default="",
        shown_default="`$XDG_CACHE_HOME/vllm-neuron/models`",
    ),
    Setting(
        "CPU mode: bytes of host memory for the KV cache when `--kv-cache-memory-bytes` is not given.",
        Integer(minimum=1),
        "worker/neuron_worker.py",
        env="VLLM_NEURON_CPU_KV_CACHE_BYTES",
        default=512 * 1024**2,
        shown_default="512 MiB",
    ),
    Setting(
        "Neuron mode: share of each NeuronCore's memory for the KV cache when `--kv-cache-memory-bytes` is "
        "not given (the cap of AWS's vLLM Neuron plugin). A fixed share, not what is free at start-up: "
        "compiled graphs are built for the KV cache's size, so pods sharing a compile cache compile the same "
        "graphs and stay warm.",
        Fraction(),
        "worker/neuron_worker.py",
        env="VLLM_NEURON_KV_CACHE_FRACTION",
        flag="--kv-cache-fraction",
        metavar="FRACTION",
        default=0.3,
    ),
    Setting(
        "Neuron mode: device memory kept free for compiled graphs, checked at start-up with the weights and "
        "the KV cache. Unset: derived from this configuration's lowered graphs where `vllm-neuron check` "
        "(same options, same `VLLM_NEURON_CACHE_ROOT`) or an earlier start with a lowering backend recorded "
        "them, else 4 GiB cold (docs/check.md#graph-reserve). The start-up log and `/v1/neuron/info` "
        "(`graph_reserve`) say which figure was used and why.",
        Integer(minimum=0),
        "vllm_neuron/compiler/graph_memory.py",
        env="VLLM_NEURON_GRAPH_RESERVE_BYTES",
        shown_default="derived, else 4 GiB",
    ),
    Setting(
        "Largest HTTP request body `vllm-neuron serve` accepts, in bytes (larger: 413); `0`: no limit.",
        Integer(minimum=0),
        "server/middleware.py",
        env="VLLM_NEURON_MAX_REQUEST_BYTES",
        flag="--max-request-bytes",
        metavar="BYTES",
        default=4 * 1024**2,
        shown_default="4 MiB",
    ),
    Setting(
        f"Prefill token buckets, ascending (docs/buckets.md). {_BUCKET_LIST}.",
        IntList(),
        "vllm_neuron/config.py",
        env="VLLM_NEURON_PREFILL_BUCKETS",
        key="prefill_buckets",
        flag="--prefill-buckets",
        metavar="N,N,...",
        shown_default="powers of two from 128 to the step's token budget (at most `max_model_len`), or the "
        "automatic policy's",
    ),
    Setting(
        f"Decode batch-size buckets, ascending, up to `--max-num-seqs`. {_BUCKET_LIST}.",
        IntList(),
        "vllm_neuron/config.py",
        env="VLLM_NEURON_DECODE_BATCH_BUCKETS",
        key="decode_batch_buckets",
        flag="--decode-batch-buckets",
        metavar="N,N,...",
        shown_default="powers of two up to `--max-num-seqs`, or the automatic policy's",
    ),
    Setting(
        f"Context-length buckets in tokens, multiples of the KV block size, up to `max_model_len`. "
        f"{_BUCKET_LIST}.",
        IntList(),
        "vllm_neuron/config.py",
        env="VLLM_NEURON_CONTEXT_BUCKETS",
        key="context_buckets",
        flag="--context-buckets",
        metavar="N,N,...",
        shown_default="powers of two from 512 to `max_model_len`, or the automatic policy's",
    ),
    Setting(
        f"Context-length buckets of decode calls in tokens, if not the context buckets (`[]`: the context "
        f"buckets). {_BUCKET_LIST}.",
        IntList(),
        "vllm_neuron/config.py",
        env="VLLM_NEURON_DECODE_CONTEXT_BUCKETS",
        key="decode_context_buckets",
        flag="--decode-context-buckets",
        metavar="N,N,...",
        shown_default="the context buckets, or the automatic policy's",
    ),
    Setting(
        "The prefill share: the most prefill tokens a step carries beside its decode rows under light load; "
        "`0` lets prefill take the whole step budget (docs/batching.md).",
        Integer(minimum=0, hint=" (0 disables the cap)"),
        "vllm_neuron/config.py",
        key="prefill_tokens_while_decoding",
        shown_default="what a decode call takes along cheaply on the target device (mixed calls), else the "
        "smallest prefill bucket of at least 48",
    ),
    Setting(
        "Decode batch buckets whose calls take the prefill share's chunk along (mixed calls); `[]` turns "
        "them off (docs/batching.md).",
        IntList(hint=" ([] turns mixed calls off)"),
        "vllm_neuron/config.py",
        key="mixed_batch_buckets",
        shown_default="the decode batch buckets up to half of `--max-num-seqs` (none with the share off)",
    ),
    Setting(
        "Prefill token buckets with a fresh prefill graph: a request's first chunk over its own keys, on "
        "TorchNeuron's flash attention kernel; `[]` turns them off (docs/buckets.md).",
        IntList(hint=" ([] turns fresh prefill graphs off)"),
        "vllm_neuron/config.py",
        key="fresh_prefill_buckets",
        shown_default="the prefill buckets that are multiples of 512 (none under the automatic policy)",
    ),
    Setting(
        "`default`: the bucket lists given, else powers of two; `auto`: the automatic policy chooses them "
        "for `traffic` within `graph_budget` (docs/buckets.md).",
        Choice(("default", "auto")),
        "vllm_neuron/config.py",
        key="bucket_policy",
        default="default",
    ),
    Setting(
        "The automatic policy's most compiled graphs.",
        Integer(minimum=1),
        "vllm_neuron/config.py",
        key="graph_budget",
        default=24,
    ),
    Setting(
        'The traffic the automatic policy plans for: `{"prompt_len": [min, max], "output_len": [min, max], '
        '"concurrency": N}`.',
        JsonObject(),
        "vllm_neuron/config.py",
        key="traffic",
        shown_default="prompts of 8 to `max_model_len`, outputs of 8 to 256, `--max-num-seqs` at once",
    ),
    Setting(
        "The call costs the automatic policy plans with: a CPU's measured ones or a trn2's estimate "
        "(vllm_neuron/call_costs.py).",
        Choice(tuple(PROFILES)),
        "vllm_neuron/config.py",
        key="call_costs",
        shown_default="the target device's",
    ),
)

BY_ENV: dict[str, Setting] = {setting.env: setting for setting in SETTINGS if setting.env}
BY_KEY: dict[str, Setting] = {setting.key: setting for setting in SETTINGS if setting.key}
BY_FLAG: dict[str, Setting] = {setting.flag: setting for setting in SETTINGS if setting.flag}


def from_env(setting: Setting) -> Any:
    """The setting's variable, parsed; its default where unset or blank."""
    raw = os.environ.get(setting.env or "", "")
    return setting.kind.parse(setting.env or "", raw) if raw.strip() else setting.default


def additional(config: dict[str, Any], key: str) -> Any:
    """The --additional-config key's value: its variable's where that is set, else the key's, checked, else
    its default (None where the reader derives it)."""
    setting = BY_KEY[key]
    if setting.env is not None and (value := from_env(setting)) is not None:
        return value
    if config.get(key) is None:
        return setting.default
    return setting.kind.check(key, config[key])
