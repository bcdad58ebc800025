"""NeuronWorker: the worker vLLM's engine talks to: device set-up, KV sizing, warm-up, steps."""

from typing import TYPE_CHECKING

import torch
from vllm.config import set_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_neuron import device as neuron_device
from vllm_neuron import envs, trn2
from vllm_neuron.compiler import compile_cache, graph_memory
from vllm_neuron.config import NeuronConfig
from vllm_neuron.quantization import fp8
from vllm_neuron.upstream import vllm_engine
from worker.kv import kv_transfer
from worker.step.model_runner import NeuronModelRunner

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.lora.request import LoRARequest
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput

    from worker.lora.slots import LoRASlots

logger = init_logger("vllm.vllm_neuron.worker")


class NeuronWorker(WorkerBase):
    model_runner: NeuronModelRunner

    def init_device(self) -> None:
        # Order matters on Trainium: pin this rank to its core and point the compilers at the compile cache
        # (the runtime reads both once, when it starts), then create the process groups (TorchNeuron's
        # `neuron` group starts the runtime and refuses a runtime started before it), then bind the device.
        parallel = self.parallel_config
        assigned = (
            parallel.assigned_physical_gpu_ids
        )  # set per engine when data-parallel engines share a host
        neuron_device.pin_rank(
            self.local_rank,
            parallel.local_world_size,
            assigned[self.local_rank] if assigned else None,
            NeuronConfig.of(self.vllm_config).host_workers,
        )
        # vLLM numbers ranks with tensor parallelism innermost.
        tp_rank = self.rank % self.parallel_config.tensor_parallel_size
        neuron_device.set_compiler_defaults()  # before the cache key, which holds them
        neuron_config = NeuronConfig.of(self.vllm_config)
        compile_cache.prepare(self.vllm_config, neuron_config, tp_rank)
        self.cache_fields = compile_cache.key_fields(self.vllm_config, neuron_config, tp_rank)
        self.graph_reserve: graph_memory.Reserve | None = None  # set where the KV cache is sized beside it
        neuron_device.disable_fallback_execution()
        self.device = neuron_device.torch_device(self.local_rank)
        vllm_engine.init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            neuron_device.dist_backend(),
        )
        neuron_device.set_device(self.device)
        # Same seed on every rank: each samples from the same all-gathered logits with the same random
        # stream, so every rank's persistent batch holds the tokens the driver rank returns.
        vllm_engine.set_random_seed(self.model_config.seed)
        self.model_runner = NeuronModelRunner(self.vllm_config, self.device)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            self.load_config.load_format = "dummy"
        if self.model_config.quantization is not None:
            fp8.install()  # before the model is built: its linear methods choose their kernel then
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.load_model()

    def get_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def get_kv_cache_spec(self) -> dict[str, "KVCacheSpec"]:
        return self.model_runner.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache.

        Neuron: a fixed share of the core's memory (VLLM_NEURON_KV_CACHE_FRACTION), checked against what the
        weights and compiled graphs need. A compiled graph's KV tensors have the size it was compiled for, so
        the size must not follow momentary free memory: pods sharing a compile cache then compile identical
        graphs. CPU: a fixed budget, never "all host memory".
        """
        requested = self.cache_config.kv_cache_memory_bytes
        if requested:
            return int(requested)
        if neuron_device.mode() == "cpu":
            return envs.VLLM_NEURON_CPU_KV_CACHE_BYTES
        self.graph_reserve = graph_memory.planned(self.cache_fields)
        logger.info("Graph reserve %s", self.graph_reserve.describe())
        lora = self.model_runner.lora
        return neuron_kv_cache_bytes(
            neuron_device.total_memory(),
            weight_bytes(self.model_runner.model) + (lora.slot_bytes() if lora is not None else 0),
            self.cache_config.gpu_memory_utilization,
            self.graph_reserve.bytes,
        )

    def initialize_from_config(self, kv_cache_config: "KVCacheConfig") -> None:
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        kv_transfer.start(self.vllm_config, kv_cache_config)  # --kv-transfer-config's connector, if any
        self.model_runner.initialize_kv_cache(kv_cache_config)
        self.model_runner.kv_transfer.register(self.model_runner.recorder)

    def get_kv_connector_handshake_metadata(self) -> dict[tuple[int, int], object] | None:
        """The KV connector's handshake metadata, for the scheduler's connector (None: it needs none)."""
        return self.model_runner.kv_transfer.handshake_metadata(
            self.rank % self.parallel_config.tensor_parallel_size
        )

    def compile_or_warm_up_model(self) -> CompilationTimes:
        with set_current_vllm_config(self.vllm_config):
            seconds = self.model_runner.warm_up()
        # Warm-up consumed random numbers; serving starts from the configured seed.
        vllm_engine.set_random_seed(self.model_config.seed)
        self._derive_graph_reserve()
        return CompilationTimes(language_model=seconds, encoder=0.0)

    def _derive_graph_reserve(self) -> None:
        """Once warm-up compiled every graph: the reserve they need, recorded for the next start, and a
        warning where less was kept. Derived from the graphs where warm-up lowered them (the lowering
        backends), else (the `neuron` backend hands TorchNeuron the graphs unseen) the recorded derivation;
        with the graphs' size as the compiler wrote them in place of the estimate, where it wrote any. A
        warning, not a failure: the graphs are loaded by now, so a reserve too small for them would already
        have failed their load; the figure is an estimate, and the next start uses it."""
        runner = self.model_runner
        if runner.compile_progress()["graphs_pending"]:
            return
        lowered, compiled = runner.lowered_graphs(), self._compiled_bytes()
        if lowered:
            derived = graph_memory.derive_for(self.vllm_config, lowered, runner.readiness.compile_workers)
        else:
            derived = graph_memory.recorded(self.cache_fields) if compiled else None
        if derived is None:
            return
        if compiled:
            derived = derived.with_compiled(*compiled)
        derived = graph_memory.record(self.cache_fields, derived)
        logger.info("Graph reserve on a NeuronCore, recorded for the next start: %s", derived.describe())
        short = self.graph_reserve and graph_memory.shortfall(self.graph_reserve, derived)
        if short:
            logger.warning("Graph reserve: %s", short)

    def _compiled_bytes(self) -> tuple[int, str] | None:
        """Bytes the compiler wrote for the graphs, and what they are: the NEFFs of this configuration's cache
        folder (the `neuron` backend), XLA's executables (`xla`); None where nothing is written."""
        backend = NeuronConfig.of(self.vllm_config).compile_backend
        if backend == "neuron":
            size = compile_cache.neff_bytes()
            return (size, graph_memory.NEFF) if size else None
        if backend == "xla":
            graphs = self.model_runner.recorder.lowering.graphs
            return sum(graph.program.serialized_bytes for graph in graphs), graph_memory.XLA_EXECUTABLE
        return None

    def graph_reserve_info(self) -> dict[str, object] | None:
        """The graph reserve the KV cache was sized beside (collective_rpc("graph_reserve_info")); None in CPU
        mode, where the KV cache has a budget of its own."""
        return self.graph_reserve.as_dict() if self.graph_reserve is not None else None

    def compile_stats(self) -> dict[str, object]:
        """This rank's compiled graphs and recompiles after warm-up (collective_rpc("compile_stats"))."""
        recorder, caches = self.model_runner.recorder, self.model_runner.kv_cache.tensors
        return {
            "rank": self.rank,
            "graphs": recorder.num_graphs,
            "unexpected_recompiles": len(recorder.unexpected),
            "kv_cache_shape": list(caches[0].shape) if caches else [],
            "kv_cache_dtype": str(caches[0].dtype).removeprefix("torch.") if caches else None,
            "lowered_graphs": len(self.model_runner.lowered_graphs()),
            "collectives_per_graph": [graph["collectives"] for graph in self.model_runner.lowered_graphs()],
        }

    def sampled_on_host(self) -> bool:
        """Whether every step takes vLLM's host sampler (collective_rpc("sampled_on_host"))."""
        return self.model_runner.host_sampler_only

    def device_thread(self) -> bool:
        """Whether a step's calls run on a thread of their own (collective_rpc("device_thread"))."""
        runner = self.model_runner
        return runner.device_thread is not None and runner.device_thread.threaded

    def compile_progress(self) -> dict[str, object]:
        """Graphs ready and pending under staged readiness (collective_rpc("compile_progress"))."""
        return self.model_runner.compile_progress()

    def lowered_graphs(self) -> list[dict[str, object]]:
        """This rank's graphs as the stablehlo backend lowered them (collective_rpc("lowered_graphs"))."""
        return self.model_runner.lowered_graphs()

    def get_supported_tasks(self) -> tuple["SupportedTask", ...]:
        return ("generate",)

    def update_max_model_len(self, max_model_len: int) -> None:
        raise RuntimeError(
            "The Neuron plugin needs a fixed --max-model-len: its context buckets are validated at start-up"
        )

    def execute_model(self, scheduler_output: "SchedulerOutput") -> "ModelRunnerOutput | None":
        sleeping = self.model_runner.sleep_mode.sleeping
        if sleeping and scheduler_output.total_num_scheduled_tokens:
            raise RuntimeError(
                f"a step was scheduled while sleep mode holds {sorted(sleeping)}: "
                "wake_up() first (vLLM pauses its scheduler while the engine sleeps)"
            )
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(
        self, grammar_output: "GrammarOutput | None"
    ) -> "ModelRunnerOutput | AsyncModelRunnerOutput":
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> "DraftTokenIds | None":
        return self.model_runner.take_draft_token_ids()

    def check_health(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def profile(self, is_start: bool = True, profile_prefix: str | None = None, **kwargs: object) -> None:
        raise RuntimeError("profiling is not supported by the Neuron plugin yet")

    def synchronize_device(self) -> None:
        # vLLM waits on this before it sleeps; WorkerBase's wait knows only torch.accelerator devices.
        neuron_device.synchronize()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode. Level 1: the KV cache is freed and the weights move to host memory (in CPU mode
        they are there already). Level 2: the weights are discarded too; after wake_up, load them again
        (collective_rpc("reload_weights"), or an RL weight update) before serving."""
        before = neuron_device.memory_in_use()
        self.model_runner.sleep(level)
        neuron_device.synchronize()  # the frees settled, for the log
        weights = "in host memory" if level == 1 else "discarded"
        logger.info(
            "Sleep level %d: KV cache freed, weights %s; memory in use %.2f GiB -> %.2f GiB",
            level,
            weights,
            before / 2**30,
            neuron_device.memory_in_use() / 2**30,
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.model_runner.wake_up(tags)

    def reload_weights(
        self,
        weights_iterator: "Iterable[tuple[str, torch.Tensor]] | None" = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
    ) -> None:
        """vLLM's reload_weights (after sleep level 2, or to change the weights): loads them in place, from
        the iterator, the path, or the model's own checkpoint; the compiled graphs run on them as they are."""
        with set_current_vllm_config(self.vllm_config):
            model = self.model_runner.model
            vllm_engine.reload_weights(
                self.vllm_config, model, weights_iterator, weights_path, is_checkpoint_format
            )

    def discard(self, tags: tuple[str, ...]) -> None:
        """LLM.release_kv_cache_memory() after sleep(level=0): free the KV cache; wake_up(["kv_cache"]) brings
        it back."""
        if set(tags) != {"kv_cache"}:
            raise ValueError(f"the Neuron plugin can discard only the KV cache, not {sorted(set(tags))}")
        self.model_runner.release_kv_cache()

    def add_lora(self, lora_request: "LoRARequest") -> bool:
        return self._lora().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora().pin(lora_id)

    def list_loras(self) -> set[int]:
        lora = self.model_runner.lora
        return lora.list() if lora is not None else set()

    def lora_info(self) -> dict[str, object] | None:
        """The LoRA slots: configuration, adapter per slot, bytes (collective_rpc("lora_info")); None
        without --enable-lora."""
        lora = self.model_runner.lora
        return lora.info() if lora is not None else None

    def _lora(self) -> "LoRASlots":
        if self.model_runner.lora is None:
            raise RuntimeError("LoRA is not enabled: start the engine with --enable-lora")
        return self.model_runner.lora

    def shutdown(self) -> None:
        runner = getattr(self, "model_runner", None)  # absent if init_device failed
        if runner is not None:
            runner.shutdown()
        kv_transfer.shutdown()


def weight_bytes(model: torch.nn.Module) -> int:
    """Device bytes of the model's weights and buffers (this rank's shard)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def neuron_kv_cache_bytes(total: int, weights: int, utilization: float, reserve: int) -> int:
    """The KV cache of one NeuronCore: VLLM_NEURON_KV_CACHE_FRACTION of its memory, if the weights, that and
    the graph reserve fit in --gpu-memory-utilization of it (trn2.core_budget, the rule `vllm-neuron check`
    applies too)."""
    if total <= 0:
        raise RuntimeError(
            f"TorchNeuron reports {total} bytes of device memory for this NeuronCore, so the KV cache cannot "
            "be sized: check the Neuron driver and runtime (neuron-ls), or give --kv-cache-memory-bytes."
        )
    fraction = envs.VLLM_NEURON_KV_CACHE_FRACTION
    core = trn2.core_budget(total, weights, trn2.KVSettings(fraction, utilization, reserve))
    if not core.fits:
        gib = 1024**3
        raise RuntimeError(
            f"The NeuronCore's memory does not fit: weights {weights / gib:.1f} GiB + KV cache "
            f"{core.kv_bytes / gib:.1f} GiB (VLLM_NEURON_KV_CACHE_FRACTION={fraction} of "
            f"{total / gib:.1f} GiB) + "
            f"{reserve / gib:.1f} GiB for compiled graphs (the graph reserve) exceed "
            f"{core.budget / gib:.1f} GiB (--gpu-memory-utilization {utilization}). Use a larger "
            "--tensor-parallel-size, a smaller model, or a lower VLLM_NEURON_KV_CACHE_FRACTION."
        )
    return core.kv_bytes
