"""Every VLLM_NEURON_* environment variable: its type, its default and one line of help.

Read lazily (``envs.VLLM_NEURON_DEVICE``) so a test or the CLI can set a variable after import.
"""

import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _str(name: str, default: str) -> Callable[[], str]:
    return lambda: os.environ.get(name, default).strip().lower() or default


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        value = _str(name, default)()
        if value not in choices:
            raise ValueError(f"{name}={value!r}: use one of {', '.join(choices)}")
        return value

    return read


def _parsed(name: str, default: T, parse: Callable[[str], T], what: str) -> T:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}") from None


def _int(name: str, default: int) -> Callable[[], int]:
    return lambda: _parsed(name, default, int, "an integer")


def _optional_int(name: str) -> Callable[[], int | None]:
    return lambda: _parsed(name, None, int, "an integer")


def _non_negative_int(name: str) -> Callable[[], int]:
    def read() -> int:
        value = _parsed(name, 0, int, "an integer")
        if value < 0:
            raise ValueError(f"{name}={value}: use 0 (automatic) or a positive number")
        return value

    return read


def _fraction(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        value = _parsed(name, default, float, "a number")
        if not 0 < value < 1:
            raise ValueError(f"{name}={value!r} must be above 0 and below 1")
        return value

    return read


def _bool(name: str) -> Callable[[], bool]:
    def read() -> bool:
        raw = os.environ.get(name, "").strip().lower()
        if raw in ("", "0", "false", "no", "off"):
            return False
        if raw in ("1", "true", "yes", "on"):
            return True
        raise ValueError(f"{name}={raw!r}: use 1 or 0")

    return read


def _int_list(name: str) -> Callable[[], list[int] | None]:
    def read() -> list[int] | None:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return None
        try:
            return [int(part) for part in raw.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"{name}={raw!r} must be a comma-separated list of integers") from None

    return read


# name -> (reader, help)
_VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "VLLM_NEURON_DEVICE": (
        _str("VLLM_NEURON_DEVICE", "auto"),
        "auto | neuron | cpu. auto activates the plugin only where TorchNeuron sees a Neuron device; "
        "cpu runs the same plugin on the host CPU (development and CI).",
    ),
    "VLLM_NEURON_TARGET": (
        _str("VLLM_NEURON_TARGET", ""),
        "neuron | cpu: the device whose defaults the configuration is resolved for (the prefill share of a "
        "step, the automatic bucket policy's call costs, vLLM's batch defaults); default: the device mode. "
        "`vllm-neuron check` sets neuron, so a CPU resolves the plan a Trainium server would.",
    ),
    "VLLM_NEURON_CPU_BF16": (
        _choice("VLLM_NEURON_CPU_BF16", "auto", ("auto", "native", "emulated")),
        "auto (default) | native | emulated: whether CPU mode treats the host's bfloat16 as native (auto: "
        "AVX-512 BF16 or AMX present). Where it is emulated, --dtype auto serves float32 instead of a "
        "bfloat16 checkpoint's bfloat16 (docs/configuration.md); an explicit --dtype is served as asked.",
    ),
    "VLLM_NEURON_COMPILE_BACKEND": (
        _str("VLLM_NEURON_COMPILE_BACKEND", ""),
        "torch.compile backend of the model step: neuron (default on Trainium), eager (default on CPU), "
        "stablehlo (TorchNeuron's lowering to StableHLO on a CPU: every graph must lower; docs/lowering.md), "
        "xla (the same lowering, then XLA's CPU compiler compiles and runs that StableHLO, the KV caches in "
        "place), "
        "lower-only (the same lowering without running the graphs: outputs are zeros; `vllm-neuron check`), "
        "inductor, any other registered torch.compile backend, or none (no torch.compile, for debugging).",
    ),
    "VLLM_NEURON_ATTENTION_KERNELS": (
        _choice("VLLM_NEURON_ATTENTION_KERNELS", "torch", ("torch", "nki")),
        "torch (default) | nki: what implements the KV write and attention ops (kv_cache/kernels.py). torch: "
        "the plain torch of kv_cache/ops.py, on every device; nki: AWS's NKI kernels, refused at start-up "
        'while none is bound to the ops (docs/lowering.md, "The kernel seam").',
    ),
    "VLLM_NEURON_DUMP_GRAPHS": (
        lambda: os.environ.get("VLLM_NEURON_DUMP_GRAPHS", ""),
        "Folder where the stablehlo and xla backends write each graph's FX graph and StableHLO (xla: and "
        "XLA's optimised HLO), named by call (phase and bucket).",
    ),
    "VLLM_NEURON_STRICT_SHAPES": (
        _bool("VLLM_NEURON_STRICT_SHAPES"),
        "1: a compile after warm-up (a shape outside the buckets) is refused with an error instead of being "
        "counted and logged.",
    ),
    "VLLM_NEURON_READINESS": (
        _choice("VLLM_NEURON_READINESS", "staged", ("staged", "full")),
        "staged (default): /health answers 200 once a minimal graph set is compiled (one prefill and one "
        "decode graph that can serve any request), and the other graphs compile in the background, each "
        "used once ready; full: every graph compiles before /health answers 200.",
    ),
    "VLLM_NEURON_COMPILE_WORKERS": (
        _non_negative_int("VLLM_NEURON_COMPILE_WORKERS"),
        "Compiles run at once: staged readiness's background compiles, and with full readiness those after "
        "the first two graphs (inductor: in that many compile processes); 0: one per 16 host CPUs, at least "
        "1 and at most 8 on Trainium, 1 in CPU mode.",
    ),
    "VLLM_NEURON_SAMPLER": (
        _choice("VLLM_NEURON_SAMPLER", "device", ("device", "host")),
        "device (default): the compiled graph samples every request it can (greedy, temperature, top-k up to "
        "256, top-p, min-p, seeds, logprobs up to 20) and only token ids leave the device; other requests "
        "take vLLM's host sampler on the steps they are in. host: every step copies its logits to the host "
        "for vLLM's sampler (to compare, or to rule the device sampler out).",
    ),
    "VLLM_NEURON_DEVICE_THREAD": (
        _choice("VLLM_NEURON_DEVICE_THREAD", "auto", ("auto", "on", "off")),
        "With async scheduling, run each step's compiled calls on a thread of their own, so that the engine "
        "schedules and prepares the next step while they run. auto (default): on with Trainium, off in CPU "
        "mode (there the calls and the host share two cores: a second OpenMP team slows both). on in CPU "
        "mode runs Trainium's arrangement: to test it, and to measure the host time it leaves between calls.",
    ),
    "VLLM_NEURON_STEP_TRACE": (
        lambda: os.environ.get("VLLM_NEURON_STEP_TRACE", ""),
        "Path of a JSON-lines file that gets one line per served step (wall time, compiled calls, decode "
        "rows, prefill tokens, milliseconds of each part and since the previous step): latency diagnosis.",
    ),
    "VLLM_NEURON_CACHE_ROOT": (
        lambda: os.environ.get("VLLM_NEURON_CACHE_ROOT", ""),
        "Root folder of the persistent compile cache (default: $XDG_CACHE_HOME/vllm-neuron/compile); "
        "share it across pods on a ReadWriteMany volume.",
    ),
    "VLLM_NEURON_XLA_CACHE_DIR": (
        lambda: os.environ.get("VLLM_NEURON_XLA_CACHE_DIR", ""),
        "Folder where the xla backend keeps the executables XLA compiled, by StableHLO module and host "
        "(default: the configuration's folder of the compile cache, <root>/<key>/xla).",
    ),
    "VLLM_NEURON_MODEL_CACHE": (
        lambda: os.environ.get("VLLM_NEURON_MODEL_CACHE", ""),
        "Folder for the converted default model (default: $XDG_CACHE_HOME/vllm-neuron/models).",
    ),
    "VLLM_NEURON_CPU_KV_CACHE_BYTES": (
        _int("VLLM_NEURON_CPU_KV_CACHE_BYTES", 512 * 1024**2),
        "CPU mode: bytes of host memory for the KV cache when --kv-cache-memory-bytes is not given.",
    ),
    "VLLM_NEURON_KV_CACHE_FRACTION": (
        _fraction("VLLM_NEURON_KV_CACHE_FRACTION", 0.3),
        "Neuron mode: share of each NeuronCore's device memory for the KV cache when --kv-cache-memory-bytes "
        "is not given (default 0.3, the cap of AWS's vLLM Neuron plugin). A fixed share, not the memory free "
        "at start-up: compiled graphs are built for the KV cache's size, so every pod then compiles the same "
        "graphs and a shared compile cache stays warm.",
    ),
    "VLLM_NEURON_GRAPH_RESERVE_BYTES": (
        _optional_int("VLLM_NEURON_GRAPH_RESERVE_BYTES"),
        "Neuron mode: device memory kept free for compiled graphs, checked at start-up with the weights and "
        "the KV cache. Unset: derived from this configuration's lowered graphs where `vllm-neuron check` or "
        "an earlier start lowered them (docs/check.md#graph-reserve), else 4 GiB.",
    ),
    "VLLM_NEURON_MAX_REQUEST_BYTES": (
        _int("VLLM_NEURON_MAX_REQUEST_BYTES", 4 * 1024**2),
        "Largest HTTP request body `vllm-neuron serve` accepts, in bytes (larger: 413); 0 for no limit.",
    ),
    "VLLM_NEURON_PREFILL_BUCKETS": (
        _int_list("VLLM_NEURON_PREFILL_BUCKETS"),
        "Comma-separated prefill token buckets (overrides additional_config prefill_buckets).",
    ),
    "VLLM_NEURON_DECODE_BATCH_BUCKETS": (
        _int_list("VLLM_NEURON_DECODE_BATCH_BUCKETS"),
        "Comma-separated decode batch-size buckets (overrides additional_config decode_batch_buckets).",
    ),
    "VLLM_NEURON_CONTEXT_BUCKETS": (
        _int_list("VLLM_NEURON_CONTEXT_BUCKETS"),
        "Comma-separated context-length buckets in tokens (overrides additional_config context_buckets).",
    ),
    "VLLM_NEURON_DECODE_CONTEXT_BUCKETS": (
        _int_list("VLLM_NEURON_DECODE_CONTEXT_BUCKETS"),
        "Comma-separated context-length buckets of decode calls in tokens, if not the context buckets "
        "(overrides additional_config decode_context_buckets).",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def names() -> list[str]:
    return list(_VARIABLES)


def describe() -> dict[str, str]:
    """Name -> help text, for the README and `vllm-neuron info`."""
    return {name: help_text for name, (_, help_text) in _VARIABLES.items()}
