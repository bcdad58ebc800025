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
# --additional-config keys of the automatic bucket policy (docs/buckets.md)
POLICY_SETTINGS = ("bucket_policy", "graph_budget", "traffic")
DEFAULT_GRAPH_BUDGET = 24
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
        unknown = sorted(set(additional) - set(BUCKET_SETTINGS) - set(POLICY_SETTINGS))
        if unknown:
            raise NeuronConfigError(
                f"unknown --additional-config keys {unknown}; "
                f"the Neuron plugin accepts {sorted([*BUCKET_SETTINGS, *POLICY_SETTINGS])}"
            )
        limits = {
            "max_model_len": vllm_config.model_config.max_model_len,
            "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
            "block_size": vllm_config.cache_config.block_size,
        }
        defaults = _policy_buckets(additional, limits)
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


def _policy_buckets(additional: dict[str, Any], limits: dict[str, int]) -> BucketConfig:
    """The bucket sets before explicit lists override them: powers of two, or the automatic policy."""
    policy = additional.get("bucket_policy", "default")
    if policy == "default":
        stray = [key for key in ("graph_budget", "traffic") if key in additional]
        if stray:
            raise NeuronConfigError(f'{stray} only apply with "bucket_policy": "auto"')
        return default_buckets(**limits)
    if policy != "auto":
        raise NeuronConfigError(f'bucket_policy must be "default" or "auto", got {policy!r}')
    from vllm_neuron.bucket_policy import TrafficShape, auto_buckets

    budget = additional.get("graph_budget", DEFAULT_GRAPH_BUDGET)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise NeuronConfigError(f"graph_budget must be a positive integer, got {budget!r}")
    declared = additional.get(
        "traffic",
        {
            "prompt_len": [8, limits["max_model_len"]],
            "output_len": [8, 256],
            "concurrency": limits["max_num_seqs"],
        },
    )
    try:
        traffic = TrafficShape.from_dict(declared)
        return auto_buckets(traffic, **limits, graph_budget=budget)
    except ValueError as err:
        raise NeuronConfigError(f"automatic bucket policy: {err}") from None
