"""The VLLM_NEURON_* environment variables, read lazily (``envs.VLLM_NEURON_DEVICE``) so that a test or the
CLI can set one after import. Their types, defaults and meanings are vllm_neuron/settings.py's table."""

from typing import Any

from vllm_neuron import settings


def __getattr__(name: str) -> Any:
    if name in settings.BY_ENV:
        return settings.from_env(settings.BY_ENV[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def names() -> list[str]:
    return list(settings.BY_ENV)
