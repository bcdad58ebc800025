"""CPU mode's host: the instruction sets that decide which dtypes it computes fast.

A host with AVX-512 BF16 or AMX computes bfloat16 natively; one with only AVX2 (or AVX-512 without BF16)
emulates it, about 10x slower than float32 there. CPU mode serves `--dtype auto` in a dtype the host
computes natively (NeuronPlatform.supported_dtypes); Neuron mode always keeps bfloat16, Trainium's type.
"""

import os
from functools import cache
from pathlib import Path

import torch

from vllm_neuron import envs

# /proc/cpuinfo flag -> the name figures are reported with, narrowest first
FEATURES = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX-512 BF16",
    "amx_bf16": "AMX",
    "avx512_fp16": "AVX-512 FP16",
}
_BFLOAT16 = {"avx512_bf16", "amx_bf16"}
_FLOAT16 = {"avx512_fp16", "amx_fp16"}


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    path = Path("/proc/cpuinfo")
    for line in (path.read_text() if path.exists() else "").splitlines():
        if not line.strip():
            break
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


def flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def isa() -> list[str]:
    """The host's features among FEATURES, by their reported names."""
    present = flags()
    return [name for flag, name in FEATURES.items() if flag in present]


def native_bfloat16() -> bool:
    """Whether the host computes bfloat16 natively: detected (AVX-512 BF16 or AMX), unless
    VLLM_NEURON_CPU_BF16 says native or emulated."""
    setting = envs.VLLM_NEURON_CPU_BF16
    if setting != "auto":
        return setting == "native"
    return bool(_BFLOAT16 & flags())


def native_float16() -> bool:
    return bool(_FLOAT16 & flags())


def fast_dtypes() -> list[torch.dtype]:
    """The dtypes `--dtype auto` may serve on this host, the first preferred (vLLM takes it for a float32
    checkpoint, and for a checkpoint dtype not listed): bfloat16 and float16 where native, float32 always."""
    if native_bfloat16():
        return [torch.bfloat16, torch.float16, torch.float32]
    return [torch.float32, *([torch.float16] if native_float16() else [])]


def describe() -> dict[str, object]:
    """What results files and /v1/neuron/info name the host by."""
    return {
        "cpu": _cpuinfo().get("model name", "unknown"),
        "isa": isa(),
        "native_bfloat16": native_bfloat16(),
    }


def summary() -> str:
    """One line for a benchmark's output and its results file: figures from hosts with different ISAs are
    not alike (bfloat16 emulated on AVX2 runs about 10x slower)."""
    described = describe()
    bfloat16 = "native" if described["native_bfloat16"] else "emulated"
    isa = ", ".join(described["isa"]) or "none of " + ", ".join(FEATURES.values())
    return f"host: {described['cpu']}, {len(os.sched_getaffinity(0))} CPUs; ISA: {isa}; bfloat16 {bfloat16}"
