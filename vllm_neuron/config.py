"""NeuronConfig: the plugin's settings from --additional-config and VLLM_NEURON_* variables, checked once."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_neuron import envs
from vllm_neuron.buckets import BucketConfig, BucketError, default_buckets, validate_buckets

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# --additional-config keys -> the environment variable that overrides each
BUCKET_SETTINGS = {
    "prefill_buckets": "VLLM_NEURON_PREFILL_BUCKETS",
    "decode_batch_buckets": "VLLM_NEURON_DECODE_BATCH_BUCKETS",
    "context_buckets": "VLLM_NEURON_CONTEXT_BUCKETS",
}
DEFAULT_BLOCK_SIZE = 32


class NeuronConfigError(ValueError):
    """A configuration the plugin cannot serve; the message says what to change."""


@dataclass(frozen=True)
class NeuronConfig:
    buckets: BucketConfig
    block_size: int

    @classmethod
    def from_vllm_config(cls, vllm_config: "VllmConfig") -> "NeuronConfig":
        additional: dict[str, Any] = dict(vllm_config.additional_config or {})
        unknown = sorted(set(additional) - set(BUCKET_SETTINGS))
        if unknown:
            raise NeuronConfigError(
                f"unknown --additional-config keys {unknown}; "
                f"the Neuron plugin accepts {sorted(BUCKET_SETTINGS)}"
            )
        limits = {
            "max_model_len": vllm_config.model_config.max_model_len,
            "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
            "block_size": vllm_config.cache_config.block_size,
        }
        defaults = default_buckets(**limits)
        chosen = {
            "prefill_buckets": defaults.prefill_tokens,
            "decode_batch_buckets": defaults.decode_batch,
            "context_buckets": defaults.context_tokens,
        }
        for key, env_name in BUCKET_SETTINGS.items():
            from_env = getattr(envs, env_name)
            value = from_env if from_env is not None else additional.get(key)
            if value is not None:
                if not isinstance(value, list | tuple):
                    raise NeuronConfigError(f"{key} must be a list of integers, got {value!r}")
                chosen[key] = tuple(value)
        buckets = BucketConfig(
            prefill_tokens=chosen["prefill_buckets"],
            decode_batch=chosen["decode_batch_buckets"],
            context_tokens=chosen["context_buckets"],
        )
        try:
            validate_buckets(buckets, **limits)
        except BucketError as err:
            raise NeuronConfigError(f"invalid Neuron bucket configuration: {err}") from None
        return cls(buckets=buckets, block_size=limits["block_size"])

    def as_additional_config(self) -> dict[str, list[int]]:
        """The resolved buckets, written back so every process and the logs see the same set."""
        return {
            "prefill_buckets": list(self.buckets.prefill_tokens),
            "decode_batch_buckets": list(self.buckets.decode_batch),
            "context_buckets": list(self.buckets.context_tokens),
        }
