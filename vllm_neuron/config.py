"""NeuronConfig: the plugin's settings from --additional-config and VLLM_NEURON_* variables, resolved once.

The platform's check of each VllmConfig (`NeuronPlatform.check_and_update_config`) resolves them: the bucket
policy, the environment's overrides, the defaults of the device, the checks. It writes the result back as the
config's `additional_config`, a `ResolvedSettings`: the resolved keys, what vLLM's config hash, the logs and a
fresh engine given them again see, and the `NeuronConfig` itself, which travels with the VllmConfig to the
engine core and worker processes (pickled with it). Everything else reads it back with `NeuronConfig.of`,
which re-derives nothing.
"""

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from vllm_neuron import device as neuron_device
from vllm_neuron import envs
from vllm_neuron.buckets import (
    BucketConfig,
    BucketError,
    decode_page_tokens,
    default_buckets,
    flash_buckets,
    light_load_batches,
    validate_buckets,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# --additional-config keys -> the environment variable that overrides each
BUCKET_SETTINGS = {
    "prefill_buckets": "VLLM_NEURON_PREFILL_BUCKETS",
    "decode_batch_buckets": "VLLM_NEURON_DECODE_BATCH_BUCKETS",
    "context_buckets": "VLLM_NEURON_CONTEXT_BUCKETS",
    "decode_context_buckets": "VLLM_NEURON_DECODE_CONTEXT_BUCKETS",  # []: the context buckets
}
# --additional-config keys of the automatic bucket policy (docs/buckets.md)
POLICY_SETTINGS = ("bucket_policy", "graph_budget", "traffic", "call_costs")
# --additional-config key: the prefill share, the most prefill tokens a step carries beside its decode rows
# under light load (vllm_neuron/prefill_share.py)
PREFILL_SHARE_SETTING = "prefill_tokens_while_decoding"
# --additional-config key: decode batch buckets whose calls take the prefill share's chunk along (buckets.py)
MIXED_BATCH_SETTING = "mixed_batch_buckets"
# --additional-config key: prefill token buckets with a fresh prefill graph (buckets.py); [] turns them off
FRESH_SETTING = "fresh_prefill_buckets"
DEFAULT_GRAPH_BUDGET = 24
DEFAULT_BLOCK_SIZE = 32
# Without mixed calls the prefill share's chunk is a call of its own: by default the share is at least this
# many tokens (a chunk of this size costs about one decode step of a small model on CPU), so the fixed cost of
# the call is not paid for a handful of tokens.
SEPARATE_CALL_MIN_SHARE = 48
# Admission control (server/admission.py): by default at most this many requests wait per request the
# engine runs at once (--max-num-seqs); past running + waiting, the API server answers 429.
WAITING_PER_RUNNING = 2


def default_max_requests_in_flight(max_num_seqs: int) -> int:
    """vLLM's --max-num-queued-reqs when not given: requests running or waiting, then 429."""
    return max_num_seqs * (1 + WAITING_PER_RUNNING)


class NeuronConfigError(ValueError):
    """A configuration the plugin cannot serve; the message says what to change."""


@dataclass(frozen=True)
class NeuronConfig:
    """The resolved settings (see the module docstring): resolved once per VllmConfig by `resolve_for`, read
    back with `of`."""

    buckets: BucketConfig
    block_size: int
    prefill_tokens_while_decoding: int  # the prefill share (vllm_neuron/prefill_share.py); 0: off
    compile_backend: str  # the torch.compile backend of the model step (device.compile_backend)
    # The workers this host runs: its data-parallel engines times their local ranks, taken before vLLM makes
    # each (non-MoE) DP engine an independent DP=1 engine; each worker pins to its share (device.pin_rank).
    host_workers: int = 1

    @classmethod
    def of(cls, vllm_config: "VllmConfig") -> "NeuronConfig":
        """The settings the platform resolved for this VllmConfig, in any of the engine's processes."""
        settings = vllm_config.additional_config
        if not isinstance(settings, ResolvedSettings):
            raise NeuronConfigError(
                "the Neuron plugin's settings were not resolved for this engine configuration: "
                "NeuronPlatform.check_and_update_config resolves them when vLLM builds a VllmConfig"
            )
        return settings.neuron_config

    @classmethod
    def resolve_for(cls, vllm_config: "VllmConfig") -> "NeuronConfig":
        """Resolve the settings of a VllmConfig from its --additional-config: the platform's check only;
        everything else reads the result back with `of`."""
        speculative = vllm_config.speculative_config
        verify_tokens = 1 + speculative.num_speculative_tokens if speculative is not None else 0
        resolved = cls.resolve(
            dict(vllm_config.additional_config or {}), engine_limits(vllm_config), verify_tokens
        )
        parallel = vllm_config.parallel_config
        return replace(resolved, host_workers=parallel.data_parallel_size_local * parallel.local_world_size)

    @classmethod
    def resolve(
        cls, additional: dict[str, Any], limits: dict[str, int], verify_tokens: int = 0
    ) -> "NeuronConfig":
        """The settings from --additional-config's keys, the engine's limits (engine_limits) and the
        environment (bucket overrides, the compile backend); `verify_tokens`: with speculative decoding,
        1 + its draft tokens (verify calls' queries a row)."""
        accepted = {
            *BUCKET_SETTINGS,
            *POLICY_SETTINGS,
            PREFILL_SHARE_SETTING,
            MIXED_BATCH_SETTING,
            FRESH_SETTING,
        }
        unknown = sorted(set(additional) - accepted)
        if unknown:
            raise NeuronConfigError(
                f"unknown --additional-config keys {unknown}; the Neuron plugin accepts {sorted(accepted)}"
            )
        defaults = _policy_buckets(additional, limits)
        chosen = {
            "prefill_buckets": defaults.prefill_buckets,
            "decode_batch_buckets": defaults.decode_batch_buckets,
            "context_buckets": defaults.context_buckets,
            "decode_context_buckets": defaults.decode_context_buckets,
        }
        for key, env_name in BUCKET_SETTINGS.items():
            from_env = getattr(envs, env_name)
            value = from_env if from_env is not None else additional.get(key)
            if value is not None:
                if not isinstance(value, list | tuple):
                    raise NeuronConfigError(f"{key} must be a list of integers, got {value!r}")
                chosen[key] = tuple(value)
        buckets = BucketConfig(
            prefill_buckets=chosen["prefill_buckets"],
            decode_batch_buckets=chosen["decode_batch_buckets"],
            context_buckets=chosen["context_buckets"],
            decode_context_buckets=chosen["decode_context_buckets"],
            page_tokens=decode_page_tokens(limits["block_size"]),
            verify_tokens=verify_tokens,
            fresh_buckets=_fresh_buckets(additional, chosen["prefill_buckets"]),
        )
        try:
            validate_buckets(buckets, **limits)
            share = _prefill_share(additional, buckets)
            buckets = _with_mixed_calls(buckets, additional, share, limits["max_num_seqs"])
            validate_buckets(buckets, **limits)
        except BucketError as err:
            raise NeuronConfigError(f"invalid Neuron bucket configuration: {err}") from None
        try:
            compile_backend = neuron_device.compile_backend()
        except ValueError as err:
            raise NeuronConfigError(str(err)) from None
        return cls(
            buckets=buckets,
            block_size=limits["block_size"],
            prefill_tokens_while_decoding=share,
            compile_backend=compile_backend,
        )

    def as_additional_config(self) -> dict[str, Any]:
        """The resolved settings as --additional-config keys: what every process and the logs see."""
        return {
            "prefill_buckets": list(self.buckets.prefill_buckets),
            "decode_batch_buckets": list(self.buckets.decode_batch_buckets),
            "context_buckets": list(self.buckets.context_buckets),
            "decode_context_buckets": list(self.buckets.decode_context_buckets),
            PREFILL_SHARE_SETTING: self.prefill_tokens_while_decoding,
            MIXED_BATCH_SETTING: list(self.buckets.mixed_batch_buckets),
            FRESH_SETTING: list(self.buckets.fresh_buckets),
        }


def on_torchneuron_route(vllm_config: "VllmConfig | None") -> bool:
    """Whether the engine of `vllm_config` compiles along TorchNeuron's route (device.TORCHNEURON_ROUTE);
    False without one, or for one the platform did not resolve (a layer built alone)."""
    settings = vllm_config.additional_config if vllm_config is not None else None
    if not isinstance(settings, ResolvedSettings):
        return False
    return settings.neuron_config.compile_backend in neuron_device.TORCHNEURON_ROUTE


class ResolvedSettings(dict):
    """A VllmConfig's `additional_config` once the platform resolved it: the resolved settings as keys
    (`NeuronConfig.as_additional_config`), and `neuron_config`, the resolved NeuronConfig itself. A plain
    dict to vLLM (its config hash, its logs); pickled with the VllmConfig into the engine core and worker
    processes, attribute included. A copy made with dict() is user input again: resolved afresh."""

    def __init__(self, neuron_config: NeuronConfig) -> None:
        super().__init__(neuron_config.as_additional_config())
        self.neuron_config = neuron_config


def engine_limits(vllm_config: "VllmConfig") -> dict[str, int]:
    """What the buckets must fit: max_model_len, max_num_seqs, max_num_batched_tokens and the block size."""
    return {
        "max_model_len": vllm_config.model_config.max_model_len,
        "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
        "block_size": vllm_config.cache_config.block_size,
    }


def _with_mixed_calls(
    buckets: BucketConfig, additional: dict[str, Any], share: int, max_num_seqs: int
) -> BucketConfig:
    """Mixed calls exist where the prefill share applies: while at most half of max_num_seqs requests
    decode, so by default the decode batch buckets up to that one get them. Their chunk is the share."""
    value = additional.get(MIXED_BATCH_SETTING)
    if value is None:
        if not share:
            return buckets
        value = light_load_batches(buckets.decode_batch_buckets, max_num_seqs)
    if not isinstance(value, list | tuple) or any(
        not isinstance(v, int) or isinstance(v, bool) for v in value
    ):
        raise NeuronConfigError(
            f"{MIXED_BATCH_SETTING} must be a list of integers ([] turns mixed calls off), got {value!r}"
        )
    if value and not share:
        raise NeuronConfigError(
            f"{MIXED_BATCH_SETTING} needs {PREFILL_SHARE_SETTING} > 0: "
            "mixed calls carry the prefill share's chunk"
        )
    if not value:
        return buckets
    return replace(buckets, mixed_chunk_bucket=share, mixed_batch_buckets=tuple(sorted(set(value))))


def _fresh_buckets(additional: dict[str, Any], prefill_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The fresh prefill graphs' token buckets: those given, else the prefill buckets TorchNeuron's flash
    kernel can take (none under the automatic policy, whose graph budget does not count them)."""
    value = additional.get(FRESH_SETTING)
    if value is None:
        automatic = additional.get("bucket_policy", "default") == "auto"
        return () if automatic else flash_buckets(prefill_buckets)
    if not isinstance(value, list | tuple) or any(
        not isinstance(v, int) or isinstance(v, bool) for v in value
    ):
        raise NeuronConfigError(
            f"{FRESH_SETTING} must be a list of integers ([] turns fresh prefill graphs off), got {value!r}"
        )
    return tuple(sorted(set(value)))


def _prefill_share(additional: dict[str, Any], buckets: BucketConfig) -> int:
    """The prefill share (prefill_tokens_while_decoding); 0 lets prefill take the whole step budget.

    By default its chunk rides in the decode call (mixed calls), and the share is what the device takes along
    at little cost (`device.mixed_call_prefill_share`). With mixed calls off it is the smallest prefill bucket
    of at least SEPARATE_CALL_MIN_SHARE, so the chunk's own call fills a compiled shape."""
    value = additional.get(PREFILL_SHARE_SETTING)
    if value is None:
        if additional.get(MIXED_BATCH_SETTING) != []:
            return min(neuron_device.mixed_call_prefill_share(), buckets.prefill_buckets[-1])
        fitting = [size for size in buckets.prefill_buckets if size >= SEPARATE_CALL_MIN_SHARE]
        return fitting[0] if fitting else buckets.prefill_buckets[-1]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise NeuronConfigError(
            f"{PREFILL_SHARE_SETTING} must be a non-negative integer (0 disables the cap), got {value!r}"
        )
    return value


def _policy_buckets(additional: dict[str, Any], limits: dict[str, int]) -> BucketConfig:
    """The bucket sets before explicit lists override them: powers of two, or the automatic policy."""
    policy = additional.get("bucket_policy", "default")
    if policy == "default":
        stray = [key for key in POLICY_SETTINGS[1:] if key in additional]
        if stray:
            raise NeuronConfigError(f'{stray} only apply with "bucket_policy": "auto"')
        return default_buckets(**limits)
    if policy != "auto":
        raise NeuronConfigError(f'bucket_policy must be "default" or "auto", got {policy!r}')
    from vllm_neuron.call_costs import PROFILES, profile_for
    from vllm_neuron.planning.bucket_policy import auto_buckets
    from vllm_neuron.planning.traffic import TrafficShape

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
    # The policy plans with the costs of the device it serves on (VLLM_NEURON_TARGET), unless told otherwise.
    costs = additional.get("call_costs", profile_for(neuron_device.target()))
    if costs not in PROFILES:
        raise NeuronConfigError(f"call_costs must be one of {sorted(PROFILES)}, got {costs!r}")
    try:
        traffic = TrafficShape.from_dict(declared)
        # The budget covers the mixed calls the bucket set will get (none if the prefill share is off).
        mixed = additional.get(PREFILL_SHARE_SETTING) != 0 and additional.get(MIXED_BATCH_SETTING) != []
        return auto_buckets(
            traffic,
            **limits,
            graph_budget=budget,
            mixed_calls=mixed,
            prefill_tokens_while_decoding=_planned_prefill_share(additional, limits, mixed),
            costs=PROFILES[costs],
        )
    except ValueError as err:
        raise NeuronConfigError(f"automatic bucket policy: {err}") from None


def _planned_prefill_share(additional: dict[str, Any], limits: dict[str, int], mixed: bool) -> int:
    """The prefill share the policy simulates the scheduler with: the one `_prefill_share` gives the chosen
    buckets. Without mixed calls the default share is the smallest prefill bucket of at least
    SEPARATE_CALL_MIN_SHARE, a bucket the policy is about to choose: it plans with that size."""
    value = additional.get(PREFILL_SHARE_SETTING)
    if value is not None:
        return value
    max_chunk = min(limits["max_num_batched_tokens"], limits["max_model_len"])
    if mixed:
        return min(neuron_device.mixed_call_prefill_share(), max_chunk)
    return min(SEPARATE_CALL_MIN_SHARE, max_chunk)
