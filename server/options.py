"""`vllm-neuron serve` options of our own, beside vLLM's: each sets one VLLM_NEURON_* variable, so the
engine-core and worker processes see the same setting, and each is checked before anything heavy starts.
The flags, their variables and help texts are vllm_neuron/settings.py's table."""

import argparse
import os

from vllm_neuron import envs, settings


def add_neuron_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Neuron",
        "Options of the Neuron plugin (each sets the VLLM_NEURON_* variable named in its help). Bucket "
        'lists can also be given in --additional-config, with "bucket_policy": "auto" for automatic '
        "buckets; see docs/buckets.md.",
    )
    for flag, setting in settings.BY_FLAG.items():
        extra = {"metavar": setting.metavar} if setting.metavar else {}
        group.add_argument(
            flag,
            dest=_dest(flag),
            default=argparse.SUPPRESS,  # unset: the variable (or its default) applies
            help=f"{setting.meaning.replace('%', '%%')} [{setting.env}]",  # argparse formats % in help
            **setting.kind.flag_keywords(),
            **extra,
        )


def apply_neuron_options(parsed: argparse.Namespace) -> None:
    """Move our options from the parsed arguments into the environment, then read every VLLM_NEURON_*
    variable once so a malformed value fails now, with its name, rather than in the engine process."""
    for flag, setting in settings.BY_FLAG.items():
        if not hasattr(parsed, _dest(flag)):
            continue
        value = getattr(parsed, _dest(flag))
        delattr(parsed, _dest(flag))
        os.environ[str(setting.env)] = "1" if value is True else str(value)
    for name in envs.names():
        getattr(envs, name)


def _dest(flag: str) -> str:
    return "neuron_" + flag.lstrip("-").replace("-", "_")
