"""NeuronPlatform: vLLM's questions about the device, answered from NeuronConfig and the device module."""

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform

from kv_cache import kernels
from kv_cache.fp8 import FP8_KV_CACHE_DTYPES
from vllm_neuron import device as neuron_device
from vllm_neuron import envs, host_cpu, parallel, process_exit, refusals
from vllm_neuron.config import (
    DEFAULT_BLOCK_SIZE,
    NeuronConfig,
    ResolvedSettings,
    default_max_requests_in_flight,
)
from vllm_neuron.refusals import UnsupportedConfigError, speculative_method
from vllm_neuron.upstream import vllm_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger("vllm.vllm_neuron.platform")

process_exit.skip_final_collections_in_child()  # an engine process exits within vLLM's 5 s after SIGTERM

WORKER_CLS = "worker.neuron_worker.NeuronWorker"
SCHEDULER_CLS = "vllm_neuron.scheduler.NeuronScheduler"
ASYNC_SCHEDULER_CLS = "vllm_neuron.scheduler.NeuronAsyncScheduler"
ATTENTION_BACKEND_CLS = "vllm_neuron.attention_backend.NeuronAttentionBackend"


class _ByDeviceMode:
    """A class attribute vLLM reads (device_type and the like) that depends on the device mode: resolved when
    vLLM first reads it, not when this module is imported, and fixed from then on."""

    def __init__(self, answer: Callable[[], str]) -> None:
        self.answer = answer
        self.value: str | None = None

    def __get__(self, instance: object, owner: type) -> str:
        if self.value is None:
            self.value = self.answer()
        return self.value


@vllm_engine.out_of_tree_platform
class NeuronPlatform(Platform):
    device_name = _ByDeviceMode(neuron_device.device_type)
    device_type = _ByDeviceMode(neuron_device.device_type)
    dispatch_key = _ByDeviceMode(neuron_device.dispatch_key)
    dist_backend = _ByDeviceMode(neuron_device.dist_backend)
    # vLLM's mark of a platform without Ray (Ray's own name for NeuronCores is "neuron_cores"): parallel.check
    # refuses Ray at start-up with the reason, before vLLM would start a Ray cluster.
    ray_device_key: str = ""
    # The variable that limits a process's NeuronCores (the runtime's, set by the Kubernetes device plugin);
    # vLLM's data-parallel launcher reads it to give each engine its own cores.
    device_control_env_var: str = "NEURON_RT_VISIBLE_CORES"
    # vLLM compiles small helpers with dynamic=True; the static-only neuron backend must never see them.
    simple_compile_backend: str = "eager"
    # FP8 weights (vllm_neuron/quantization/fp8.py): vLLM refuses any other --quantization by name.
    supported_quantization: list[str] = [
        "fp8",
        "fp8_per_tensor",
        "fp8_per_channel",
        "compressed-tensors",
        "modelopt",
    ]

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return _auto_dtypes()

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return neuron_device.device_name(device_id)

    @classmethod
    def device_id_to_physical_device_id(cls, device_id: int) -> int:
        # vLLM gives each data-parallel engine on a host its devices through this. NEURON_RT_VISIBLE_CORES
        # takes ranges ("8-11", as the Kubernetes device plugin writes it), which vLLM's parser does not.
        visible = os.environ.get(cls.device_control_env_var) if neuron_device.mode() == "neuron" else None
        return parallel.rank_core(visible, device_id, device_id + 1)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        # vLLM asks this while building the engine config, to choose batch defaults, in a process that is
        # not (yet) a worker. On Neuron the answer would start the runtime there: before the worker's process
        # group (TorchNeuron refuses that) and holding the cores the workers need. vLLM falls back to its
        # general defaults when the platform cannot answer; the worker sizes memory itself. A CPU resolving
        # a Neuron server's configuration (VLLM_NEURON_TARGET, `vllm-neuron check`) answers the same.
        if neuron_device.mode() == "neuron" or neuron_device.target() == "neuron":
            raise NotImplementedError("the Neuron worker reads device memory, after its process group")
        return neuron_device.total_memory()

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        neuron_device.synchronize()  # vLLM's memory profiling wants a settled figure
        return float(neuron_device.memory_in_use())

    @classmethod
    def set_device(cls, torch_device: torch.device) -> None:
        neuron_device.set_device(torch_device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        neuron_device.manual_seed_all(seed)

    def is_sleep_mode_available(self) -> bool:
        # worker/neuron_worker.py: level 1 frees the KV cache and moves the weights to host memory, level 2
        # discards both (reload_weights loads them again).
        return True

    @classmethod
    def inference_mode(cls):
        # no_grad rather than inference_mode: inference tensors cannot be mutated by compiled graphs later.
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def import_kernels(cls) -> None:
        # vllm._C does not exist in a VLLM_TARGET_DEVICE=empty build; our ops are plain torch.
        return None

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # The attention layer calls our backend directly, so dynamo traces attention into the same graph.
        return False

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return neuron_device.communicator_cls()

    @classmethod
    def get_punica_wrapper(cls) -> str:
        # Dense over fixed slots, the slot per token a call input: no data-dependent shape.
        return "vllm_neuron.lora.punica.NeuronPunicaWrapper"

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype == torch.float64:
            raise UnsupportedConfigError(
                "dtype float64 is not supported: TorchNeuron computes float64 as float32. "
                "Use --dtype float32, float16 or bfloat16."
            )

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: "AttentionBackendEnum",
        attn_selector_config: "AttentionSelectorConfig",
        num_heads: int | None = None,
    ) -> str:
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise UnsupportedConfigError(
                "MLA and sparse attention models are not supported by the Neuron plugin"
            )
        if attn_selector_config.has_sink:
            raise UnsupportedConfigError("attention sinks are not supported by the Neuron plugin")
        return ATTENTION_BACKEND_CLS

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: "VllmConfig") -> None:
        # check_and_update_config fixed the block size, and the buckets were validated against it.
        return None

    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        # vLLM builds throwaway configs without a model; there is nothing to check in those.
        model_config = vllm_config.model_config
        if model_config is None:
            return
        if (message := kernels.refusal(envs.VLLM_NEURON_ATTENTION_KERNELS)) is not None:
            raise UnsupportedConfigError(f"Neuron plugin: {message}")
        cls.check_if_supports_dtype(model_config.dtype)
        refusals.check(vllm_config)
        _say_why_float32(model_config)
        parallel.check(
            vllm_config, neuron_device.visible_core_count() if neuron_device.mode() == "neuron" else None
        )

        cache_config = vllm_config.cache_config
        if not cache_config.user_specified_block_size:
            cache_config.block_size = DEFAULT_BLOCK_SIZE
        # Every quantization the platform serves is FP8 (supported_quantization).
        if model_config.quantization is not None or cache_config.cache_dtype in FP8_KV_CACHE_DTYPES:
            try:
                neuron_device.pass_fp8_compiler_option()
            except ValueError as err:
                raise UnsupportedConfigError(f"Neuron plugin: {err}") from None

        from vllm.config import CompilationMode, CUDAGraphMode

        # The model runner compiles the whole step itself, per bucket; vLLM's own compilation would mark
        # dynamic dimensions, which the static-shape neuron backend refuses.
        compilation_config = vllm_config.compilation_config
        compilation_config.mode = CompilationMode.NONE
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        compilation_config.cudagraph_capture_sizes = []
        # Async scheduling (vLLM's default; --no-async-scheduling turns it off): the engine schedules a step
        # while the previous one runs, with the prefill share either way.
        scheduler_config = vllm_config.scheduler_config
        if speculative_method(vllm_config) in ("draft_model", "eagle3") and scheduler_config.async_scheduling:
            # With async scheduling vLLM's scheduler sends placeholders for drafts the runner would keep on
            # the device; the plugin's draft model and EAGLE3 head propose after each step's tokens are
            # accepted on the host, as n-gram does.
            logger.info("Speculative decoding with a draft model or head: async scheduling is turned off")
            scheduler_config.async_scheduling = False
        if scheduler_config.scheduler_cls is None:
            scheduler_config.scheduler_cls = (
                ASYNC_SCHEDULER_CLS if scheduler_config.async_scheduling else SCHEDULER_CLS
            )

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER_CLS
        # TorchNeuron cannot re-initialise its runtime in a forked child.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

        # Resolved once, here; the engine's processes read it back (NeuronConfig.of).
        neuron_config = NeuronConfig.resolve_for(vllm_config)
        # A finite queue by default: past it the API server answers 429 (server/admission.py).
        if scheduler_config.max_num_queued_reqs is None:
            scheduler_config.max_num_queued_reqs = default_max_requests_in_flight(neuron_config.max_num_seqs)
        refusals.check_kv_transfer(vllm_config, neuron_config)
        _stage_nixl_through_host(vllm_config)
        vllm_config.additional_config = ResolvedSettings(neuron_config)
        logger.info(
            "Neuron plugin (%s mode, compile backend %s): block size %d, %s; "
            "at most %s prefill tokens per step while requests decode",
            neuron_device.mode(),
            neuron_config.compile_backend,
            cache_config.block_size,
            neuron_config.buckets.describe(),
            neuron_config.buckets.prefill_tokens_while_decoding or "unlimited",
        )

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        # A draft model's layers share layer indices with the target's. The runner's list of caches is only
        # counted and sized (every layer's cache has the same number of blocks), never indexed by layer.
        pass

    @classmethod
    def validate_request(cls, processed_inputs: object, params: "SamplingParams | PoolingParams") -> None:
        from vllm.exceptions import VLLMValidationError

        prompt_logprobs = getattr(params, "prompt_logprobs", None)
        if prompt_logprobs is not None:
            raise VLLMValidationError(
                "prompt_logprobs is not supported by the Neuron plugin yet; remove it from the request",
                parameter="prompt_logprobs",
                value=prompt_logprobs,
            )

    @classmethod
    def get_nixl_supported_devices(cls) -> dict[str, tuple[str, ...]]:
        # NIXL cannot register Neuron device memory: it stages KV through host buffers (worker/kv/nixl.py).
        return {cls.device_type: ("cpu",)}

    @classmethod
    def discover_numa_topology(cls) -> list[list[int]]:
        # vLLM's NIXL worker on a 'cpu' device type pins itself to the cores this names; the plugin's workers
        # are pinned by device.pin_rank, which NIXL must not undo.
        return []

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        # Our own VLLM_NEURON_* variables are not vLLM's; hide them from vLLM's unknown-variable check.
        with vllm_engine.hidden_from_environ_check("VLLM_NEURON_"):
            super().validate_environ(hard_fail)


def _stage_nixl_through_host(vllm_config: "VllmConfig") -> None:
    """vLLM's NixlConnector becomes the plugin's (worker/kv/nixl.py, the same connector staged through host
    buffers), and its buffer device the host's, which vLLM would otherwise take from the device type."""
    transfer = vllm_config.kv_transfer_config
    if transfer is not None and transfer.kv_connector in refusals.NIXL_CONNECTORS:
        transfer.kv_connector_module_path = refusals.NIXL_MODULE
        transfer.kv_buffer_device = "cpu"


def _auto_dtypes() -> list[torch.dtype]:
    """What `--dtype auto` may resolve to, the first preferred (an explicit --dtype is served as asked): in
    CPU mode the dtypes this host computes natively (without native bfloat16: float32); Trainium's
    otherwise, bfloat16 first."""
    if neuron_device.mode() == "cpu" and neuron_device.target() != "neuron":
        return host_cpu.fast_dtypes()
    return [torch.bfloat16, torch.float16, torch.float32]


def _say_why_float32(model_config) -> None:
    """One line where CPU mode serves a bfloat16 checkpoint in float32."""
    checkpoint = str(getattr(model_config.hf_text_config, "dtype", "")).removeprefix("torch.")
    if (
        model_config.dtype == torch.float32
        and checkpoint == "bfloat16"
        and torch.bfloat16 not in _auto_dtypes()
    ):
        logger.info(
            "CPU mode: this host computes bfloat16 by emulation (ISA: %s), so this bfloat16 checkpoint is "
            "served in float32 (--dtype auto's choice here); --dtype bfloat16 keeps bfloat16, "
            "VLLM_NEURON_CPU_BF16=native treats the host's bfloat16 as native",
            ", ".join(host_cpu.isa()) or "none of " + ", ".join(host_cpu.FEATURES.values()),
        )
