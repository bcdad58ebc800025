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
from vllm_neuron import settings
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

# The bucket lists' --additional-config keys, each also a BucketConfig field (vllm_neuron/settings.py has
# their variables, which win)
BUCKET_LISTS = ("prefill_buckets", "decode_batch_buckets", "context_buckets", "decode_context_buckets")
# --additional-config keys that only the automatic bucket policy reads (docs/buckets.md)
AUTO_POLICY_KEYS = ("graph_budget", "traffic", "call_costs")
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

    buckets: BucketConfig  # with the prefill share (`buckets.prefill_tokens_while_decoding`)
    block_size: int
    max_num_seqs: int  # --max-num-seqs: the most requests a step runs (decode rows, the host batch)
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
        unknown = sorted(set(additional) - set(settings.BY_KEY))
        if unknown:
            accepted = sorted(settings.BY_KEY)
            raise NeuronConfigError(
                f"unknown --additional-config keys {unknown}; the Neuron plugin accepts {accepted}"
            )
        try:
            given = {key: settings.additional(additional, key) for key in settings.BY_KEY}
        except ValueError as err:
            raise NeuronConfigError(str(err)) from None
        if given["bucket_policy"] == "default":
            stray = [key for key in AUTO_POLICY_KEYS if key in additional]
            if stray:
                raise NeuronConfigError(f'{stray} only apply with "bucket_policy": "auto"')
        defaults = _policy_buckets(given, limits)
        chosen = {key: getattr(defaults, key) if given[key] is None else given[key] for key in BUCKET_LISTS}
        buckets = BucketConfig(
            **chosen,
            page_tokens=decode_page_tokens(limits["block_size"]),
            verify_tokens=verify_tokens,
            fresh_buckets=_fresh_buckets(given, chosen["prefill_buckets"]),
        )
        try:
            validate_buckets(buckets, **limits)
            share = _prefill_share(given, buckets)
            buckets = _with_prefill_share(buckets, given, share, limits["max_num_seqs"])
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
            max_num_seqs=limits["max_num_seqs"],
            compile_backend=compile_backend,
        )

    def as_additional_config(self) -> dict[str, Any]:
        """The resolved settings as --additional-config keys: what every process and the logs see."""
        return {
            **{key: list(getattr(self.buckets, key)) for key in BUCKET_LISTS},
            "prefill_tokens_while_decoding": self.buckets.prefill_tokens_while_decoding,
            "mixed_batch_buckets": list(self.buckets.mixed_batch_buckets),
            "fresh_prefill_buckets": list(self.buckets.fresh_buckets),
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


def _mixed_calls_off(given: dict[str, Any]) -> bool:
    return given["mixed_batch_buckets"] == ()


def _with_prefill_share(
    buckets: BucketConfig, given: dict[str, Any], share: int, max_num_seqs: int
) -> BucketConfig:
    """The buckets with the prefill share, and the mixed calls: they exist where the share applies, while at
    most half of max_num_seqs requests decode, so by default the decode batch buckets up to that one get
    them. Their chunk is the share."""
    buckets = replace(buckets, prefill_tokens_while_decoding=share)
    value = given["mixed_batch_buckets"]
    if value is None:
        if not share:
            return buckets
        value = light_load_batches(buckets.decode_batch_buckets, max_num_seqs)
    if value and not share:
        raise NeuronConfigError(
            "mixed_batch_buckets needs prefill_tokens_while_decoding > 0: mixed calls carry the prefill "
            "share's chunk"
        )
    if not value:
        return buckets
    return replace(buckets, mixed_batch_buckets=tuple(sorted(set(value))))


def _fresh_buckets(given: dict[str, Any], prefill_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The fresh prefill graphs' token buckets: those given, else the prefill buckets TorchNeuron's flash
    kernel can take (none under the automatic policy, whose graph budget does not count them)."""
    value = given["fresh_prefill_buckets"]
    if value is None:
        return () if given["bucket_policy"] == "auto" else flash_buckets(prefill_buckets)
    return tuple(sorted(set(value)))


def _prefill_share(given: dict[str, Any], buckets: BucketConfig) -> int:
    """The prefill share (prefill_tokens_while_decoding); 0 lets prefill take the whole step budget.

    By default its chunk rides in the decode call (mixed calls), and the share is what the device takes along
    at little cost (`device.mixed_call_prefill_share`). With mixed calls off it is the smallest prefill bucket
    of at least SEPARATE_CALL_MIN_SHARE, so the chunk's own call fills a compiled shape."""
    value = given["prefill_tokens_while_decoding"]
    if value is not None:
        return value
    if not _mixed_calls_off(given):
        return min(neuron_device.mixed_call_prefill_share(), buckets.prefill_buckets[-1])
    fitting = [size for size in buckets.prefill_buckets if size >= SEPARATE_CALL_MIN_SHARE]
    return fitting[0] if fitting else buckets.prefill_buckets[-1]


def _policy_buckets(given: dict[str, Any], limits: dict[str, int]) -> BucketConfig:
    """The bucket sets before explicit lists override them: powers of two, or the automatic policy."""
    if given["bucket_policy"] == "default":
        return default_buckets(**limits)
    from vllm_neuron.call_costs import PROFILES, profile_for
    from vllm_neuron.planning.bucket_policy import auto_buckets
    from vllm_neuron.planning.traffic import TrafficShape

    declared = given["traffic"]
    if declared is None:
        declared = {
            "prompt_len": [8, limits["max_model_len"]],
            "output_len": [8, 256],
            "concurrency": limits["max_num_seqs"],
        }
    # The policy plans with the costs of the device it serves on (VLLM_NEURON_TARGET), unless told otherwise.
    costs = given["call_costs"] or profile_for(neuron_device.target())
    try:
        traffic = TrafficShape.from_dict(declared)
        # The budget covers the mixed calls the bucket set will get (none if the prefill share is off).
        mixed = given["prefill_tokens_while_decoding"] != 0 and not _mixed_calls_off(given)
        return auto_buckets(
            traffic,
            **limits,
            graph_budget=given["graph_budget"],
            mixed_calls=mixed,
            prefill_tokens_while_decoding=_planned_prefill_share(given, limits, mixed),
            costs=PROFILES[costs],
        )
    except ValueError as err:
        raise NeuronConfigError(f"automatic bucket policy: {err}") from None


def _planned_prefill_share(given: dict[str, Any], limits: dict[str, int], mixed: bool) -> int:
    """The prefill share the policy simulates the scheduler with: the one `_prefill_share` gives the chosen
    buckets. Without mixed calls the default share is the smallest prefill bucket of at least
    SEPARATE_CALL_MIN_SHARE, a bucket the policy is about to choose: it plans with that size."""
    value = given["prefill_tokens_while_decoding"]
    if value is not None:
        return value
    max_chunk = min(limits["max_num_batched_tokens"], limits["max_model_len"])
    if mixed:
        return min(neuron_device.mixed_call_prefill_share(), max_chunk)
    return min(SEPARATE_CALL_MIN_SHARE, max_chunk)
