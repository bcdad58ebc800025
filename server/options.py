"""`vllm-neuron serve` options of our own, beside vLLM's: each sets one VLLM_NEURON_* variable, so the
engine-core and worker processes see the same setting, and each is checked before anything heavy starts."""

import argparse
import os

from vllm_neuron import envs

# flag -> (variable, argparse keywords). Help texts come from vllm_neuron.envs, the one place they live.
NEURON_OPTIONS: dict[str, tuple[str, dict]] = {
    "--device": ("VLLM_NEURON_DEVICE", {"choices": ["auto", "neuron", "cpu"]}),
    "--compile-backend": ("VLLM_NEURON_COMPILE_BACKEND", {"metavar": "NAME"}),
    "--dump-graphs": ("VLLM_NEURON_DUMP_GRAPHS", {"metavar": "DIR"}),
    "--strict-shapes": ("VLLM_NEURON_STRICT_SHAPES", {"action": "store_true"}),
    "--readiness": ("VLLM_NEURON_READINESS", {"choices": ["staged", "full"]}),
    "--sampler": ("VLLM_NEURON_SAMPLER", {"choices": ["device", "host"]}),
    "--compile-workers": ("VLLM_NEURON_COMPILE_WORKERS", {"metavar": "N", "type": int}),
    "--compile-cache-root": ("VLLM_NEURON_CACHE_ROOT", {"metavar": "PATH"}),
    "--prefill-buckets": ("VLLM_NEURON_PREFILL_BUCKETS", {"metavar": "N,N,..."}),
    "--decode-batch-buckets": ("VLLM_NEURON_DECODE_BATCH_BUCKETS", {"metavar": "N,N,..."}),
    "--context-buckets": ("VLLM_NEURON_CONTEXT_BUCKETS", {"metavar": "N,N,..."}),
    "--decode-context-buckets": ("VLLM_NEURON_DECODE_CONTEXT_BUCKETS", {"metavar": "N,N,..."}),
    "--kv-cache-fraction": ("VLLM_NEURON_KV_CACHE_FRACTION", {"metavar": "FRACTION", "type": float}),
    "--max-request-bytes": ("VLLM_NEURON_MAX_REQUEST_BYTES", {"metavar": "BYTES", "type": int}),
}


def add_neuron_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Neuron",
        "Options of the Neuron plugin (each sets the VLLM_NEURON_* variable named in its help). Bucket "
        'lists can also be given in --additional-config, with "bucket_policy": "auto" for automatic '
        "buckets; see docs/buckets.md.",
    )
    help_texts = envs.describe()
    for flag, (variable, keywords) in NEURON_OPTIONS.items():
        group.add_argument(
            flag,
            dest=_dest(flag),
            default=argparse.SUPPRESS,  # unset: the variable (or its default) applies
            help=f"{help_texts[variable]} [{variable}]",
            **keywords,
        )


def apply_neuron_options(parsed: argparse.Namespace) -> None:
    """Move our options from the parsed arguments into the environment, then read every VLLM_NEURON_*
    variable once so a malformed value fails now, with its name, rather than in the engine process."""
    for flag, (variable, _) in NEURON_OPTIONS.items():
        if not hasattr(parsed, _dest(flag)):
            continue
        value = getattr(parsed, _dest(flag))
        delattr(parsed, _dest(flag))
        os.environ[variable] = "1" if value is True else str(value)
    for name in envs.names():
        getattr(envs, name)


def _dest(flag: str) -> str:
    return "neuron_" + flag.lstrip("-").replace("-", "_")
