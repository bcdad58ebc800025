"""vLLM's KV connector (--kv-transfer-config: prefill/decode disaggregation) around the plugin's steps.

Attention runs inside a compiled graph of static shapes, where a connector's per-layer hooks (vLLM calls them
from its attention op) cannot run. So a step's connector work runs around its compiled calls, on the thread
that runs them: before them the scheduler's metadata is bound and every layer's load started and waited for;
after them each layer's cache goes to save_kv_layer and the saves are waited for; vLLM's own lifecycle
(KVConnectorModelRunnerMixin) collects the finished transfers into the step's output. The connector sees the
caches through block-major views of the same storage (kv_cache.layout.block_major); a NIXL connector copies
blocks through them with compiled graphs of its own (worker/kv/nixl_blocks.py), compiled at start-up. No graph
is traced while serving (with a connector, staged readiness is off: worker/compiles/readiness.py), as a trace
would see a step's connector metadata. Which connectors work this way, and what is refused at start-up, is the
platform's rule (vllm_neuron/platform.py: _kv_transfer_refusals)."""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from vllm.logger import init_logger
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kv_cache import layout
from vllm_neuron.buckets import ceil_div
from vllm_neuron.compiler.compile import CompileRecorder
from vllm_neuron.config import NeuronConfig
from vllm_neuron.refusals import NIXL_CONNECTORS
from vllm_neuron.upstream.vllm_runner import (
    KVConnectorModelRunnerMixin,
    create_forward_context,
    override_forward_context,
)
from worker.kv.kv_caches import KVCaches
from worker.kv.nixl_blocks import BlockCopier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger("vllm.vllm_neuron.kv_transfer")


def start(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> None:
    """Create this worker's connector (none without --kv-transfer-config), before the caches it registers."""
    ensure_kv_transfer_initialized(vllm_config, kv_cache_config)


def shutdown() -> None:
    ensure_kv_transfer_shutdown()


class KVTransfer:
    """The connector's part of each step, over the runner's KV caches."""

    def __init__(self, vllm_config: "VllmConfig", caches: KVCaches) -> None:
        self.vllm_config = vllm_config
        self.caches = caches
        transfer = vllm_config.kv_transfer_config
        # A decode server (kv_consumer) only loads. vLLM's GPU runner saves on every role, which with
        # ExampleConnector would store a prompt this server prefilled over several steps before its later
        # chunks exist, for the next request with that prompt to load.
        self.saves = transfer is not None and transfer.is_kv_producer
        self.copier: BlockCopier | None = None

    def register(self, recorder: CompileRecorder) -> None:
        """Hand the connector the caches; a NIXL connector, which stages KV through host buffers
        (worker/kv/nixl.py), also the block copies, compiled through `recorder`."""
        if not has_kv_transfer_group():
            return
        connector = get_kv_transfer_group()
        connector.register_kv_caches(self._views())
        if self.vllm_config.kv_transfer_config.kv_connector in NIXL_CONNECTORS:
            config = self.vllm_config
            self.copier = BlockCopier(
                self.caches,
                recorder,
                NeuronConfig.of(config).compile_backend,
                ceil_div(config.model_config.max_model_len, config.cache_config.block_size),
            )
            connector.set_host_xfer_buffer_ops(self.copier)

    @property
    def copy_buckets(self) -> tuple[int, ...]:
        """The block copies' buckets (NIXL), each a gather and a scatter graph; () without."""
        return tuple(self.copier.buckets) if self.copier is not None else ()

    def warm_up(self) -> float:
        """Compile the block copies' graphs, before the step graphs (whose warm-up arms the recompile
        guard); returns the seconds it took."""
        if self.copier is None:
            return 0.0
        start = time.perf_counter()
        graphs = self.copier.warm_up()
        seconds = time.perf_counter() - start
        logger.info(
            "NIXL block copies: %d graphs (buckets of %s blocks) in %.1f s",
            graphs,
            self.copier.buckets,
            seconds,
        )
        return seconds

    def handshake_metadata(self, tp_rank: int) -> dict[tuple[int, int], object] | None:
        """What vLLM's engine collects for the scheduler's connector, keyed (pipeline rank, TP rank)."""
        metadata = get_kv_transfer_group().get_handshake_metadata() if has_kv_transfer_group() else None
        return None if metadata is None else {(0, tp_rank): metadata}

    @contextmanager
    def around(self, scheduler_output: "SchedulerOutput") -> Iterator[KVConnectorOutput | None]:
        """Run the body (the step's compiled calls) between the step's loads and saves; yields the step's
        KVConnectorOutput, filled in once the body ends (None: no connector, or a warm-up step)."""
        if not has_kv_transfer_group() or scheduler_output.kv_connector_metadata is None:
            yield None
            return
        connector = get_kv_transfer_group()
        views = self._views()
        with (
            override_forward_context(self._forward_context(views)),
            KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(scheduler_output) as output,
        ):
            for name in views:  # the calls read every layer: all loads done before the first
                connector.wait_for_layer_load(name)
            # vLLM's attention op calls the per-layer hooks itself while the connector holds metadata. Inside
            # a compiled graph they cannot run, and warm-up traced the op without metadata and without a
            # forward context outside the step's own (dynamo guards on both): so the calls run as then.
            connector.clear_connector_metadata()
            try:
                with override_forward_context(None):
                    yield output
            finally:
                connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            if self.saves:
                for name, view in views.items():
                    # No attention metadata: each compiled call has its own, inside its inputs.
                    connector.save_kv_layer(name, view, None)

    def without_forward(self, scheduler_output: "SchedulerOutput") -> ModelRunnerOutput:
        """A step with no tokens: the connector's transfers still progress and report (vLLM's
        kv_connector_no_forward)."""
        with self.around(scheduler_output) as output:
            pass
        return ModelRunnerOutput.with_kv_conn_output_only(output)

    def _views(self) -> dict[str, torch.Tensor]:
        return {name: layout.block_major(cache) for name, cache in self.caches.by_layer().items()}

    def _forward_context(self, views: dict[str, torch.Tensor]) -> "ForwardContext":
        """The forward context a connector reads in start_load_kv: each attention layer as an object whose
        kv_cache is its block-major view, and a metadata entry per layer (none, as for save_kv_layer)."""
        context = create_forward_context(dict.fromkeys(views), self.vllm_config)
        layers = {name: SimpleNamespace(kv_cache=view) for name, view in views.items()}
        return replace(context, no_compile_layers=layers)
