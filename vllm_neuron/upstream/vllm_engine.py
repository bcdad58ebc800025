"""vLLM 0.32's internals as the engine side of the plugin reaches them, outside the model runner: the platform
class, the scheduler's per-step limits, the MoE runner's entry point and the worker's helpers from vLLM's GPU
worker. vllm_neuron.platform imports this module in every process: each vLLM import happens when its function
is called. tests/unit/test_upstream.py pins each one; docs/maintaining.md says what to do when one moves.
"""

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler

PlatformClass = TypeVar("PlatformClass", bound=type)


# ---- platform ---------------------------------------------------------------------------------------------


def out_of_tree_platform(platform: PlatformClass) -> PlatformClass:
    """Class decorator: `platform` is an out-of-tree platform (Platform.is_out_of_tree() is True). vLLM 0.32:
    the class attribute `Platform._enum = PlatformEnum.OOT`, the way vLLM's plugin guide has every out-of-tree
    platform set it (no public setter)."""
    from vllm.platforms.interface import PlatformEnum

    platform._enum = PlatformEnum.OOT
    return platform


@contextlib.contextmanager
def hidden_from_environ_check(prefix: str) -> Iterator[None]:
    """Environment variables starting with `prefix` are out of os.environ meanwhile. vLLM 0.32's
    Platform.validate_environ (a public platform hook, which the plugin overrides) reads os.environ when
    called, and reports each VLLM_* name its envs module does not know."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(prefix)}
    try:
        yield
    finally:
        os.environ.update(saved)


# ---- scheduler --------------------------------------------------------------------------------------------


def own_step_limits(scheduler: "Scheduler") -> tuple[int, int]:
    """Give `scheduler` a private copy of its SchedulerConfig (the limits `set_step_limits` changes are its
    own), and return its configured (token budget, per-request prefill cap). vLLM 0.32: the Scheduler's
    `max_num_scheduled_tokens` attribute and `scheduler_config.long_prefill_token_threshold`, both read
    afresh by every `schedule()` call."""
    import copy

    scheduler.scheduler_config = copy.copy(scheduler.scheduler_config)
    return scheduler.max_num_scheduled_tokens, scheduler.scheduler_config.long_prefill_token_threshold


def set_step_limits(scheduler: "Scheduler", token_budget: int, long_prefill_cap: int) -> None:
    """The next `schedule()` call's token budget and per-request prefill cap (0: none); see
    `own_step_limits`."""
    scheduler.max_num_scheduled_tokens = token_budget
    scheduler.scheduler_config.long_prefill_token_threshold = long_prefill_cap


# ---- KV events --------------------------------------------------------------------------------------------


def publish_kv_events(scheduler: "Scheduler") -> None:
    """Publish the KV events `scheduler`'s cache has queued, now, as one batch. vLLM 0.32: the block pool
    queues its events and `Scheduler.update_from_output` publishes `kv_cache_manager.take_events()` as a
    `KVEventBatch` through `kv_event_publisher`, only when a step's output comes back."""
    import time

    from vllm.distributed.kv_events import KVEventBatch

    events = scheduler.kv_cache_manager.take_events()
    if events:
        scheduler.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))


def block_hash_seed(hash_algo: str) -> str | None:
    """The seed a router hashes a prompt's first block from, for `--prefix-caching-hash-algo hash_algo`; None
    when it is random bytes drawn by each engine process, which no router can know. vLLM 0.32
    (`v1/core/kv_cache_utils.py`, `resolve_none_hash_seed`): PYTHONHASHSEED when set, otherwise the fixed
    `DEFAULT_NONE_HASH_SEED` for the cryptographic algorithms and random bytes for those in
    `_NON_CRYPTO_HASH_FUNCTIONS` (xxhash, xxhash_cbor)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    if (seed := os.environ.get("PYTHONHASHSEED")) is not None:
        return seed
    if get_hash_fn_by_name(hash_algo) in kv_cache_utils._NON_CRYPTO_HASH_FUNCTIONS:
        return None
    return kv_cache_utils.DEFAULT_NONE_HASH_SEED


# ---- MoE layer --------------------------------------------------------------------------------------------


class MoERunnerForwardInGraph:
    """Mixin before vLLM's MoERunner: the runner calls its expert computation directly, in the traced graph,
    instead of through vLLM's custom op `vllm::moe_forward` (opaque to the compiler; torch-mlir cannot lower
    its layer-name argument). vLLM 0.32 (model_executor/layers/fused_moe/runner/moe_runner.py): overrides
    `MoERunner._select_forward`, which __init__ calls to choose `forward`'s entry point, and calls
    `MoERunner._forward_impl`, what the custom op calls; vLLM does the same on CPU and TPU."""

    def _select_forward(self) -> Callable:
        return self._forward_in_graph

    def _forward_in_graph(
        self,
        hidden_states: "torch.Tensor",
        router_logits: "torch.Tensor",
        shared_experts_input: "torch.Tensor | None",
        input_ids: "torch.Tensor | None",
        layer_name: object,
        hidden_dim_unpadded: int,
    ) -> Any:
        # The custom op's signature; the layer is this runner, so its name is not needed.
        return self._forward_impl(hidden_states, router_logits, shared_experts_input, input_ids)


# ---- worker -----------------------------------------------------------------------------------------------


def init_worker_distributed_environment(
    vllm_config: "VllmConfig", rank: int, distributed_init_method: str | None, local_rank: int, backend: str
) -> None:
    """vLLM's process groups for this worker (world, tensor and pipeline parallel). vLLM 0.32:
    `vllm.v1.worker.gpu_worker.init_worker_distributed_environment`, the GPU worker's own."""
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment as init

    init(vllm_config, rank, distributed_init_method, local_rank, backend)


def set_random_seed(seed: int | None) -> None:
    """Seed Python's, numpy's and torch's generators. vLLM 0.32: `vllm.utils.torch_utils.set_random_seed`."""
    from vllm.utils.torch_utils import set_random_seed as seed_all

    seed_all(seed)


def reload_weights(
    vllm_config: "VllmConfig",
    model: "torch.nn.Module",
    weights: "Iterable[tuple[str, torch.Tensor]] | None",
    weights_path: str | None,
    is_checkpoint_format: bool,
) -> None:
    """Load weights into `model` in place (the worker's reload_weights). vLLM 0.32:
    `vllm.model_executor.model_loader.reload.inplace.reload_weights`."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights as reload

    reload(vllm_config, model, weights, weights_path, is_checkpoint_format)
