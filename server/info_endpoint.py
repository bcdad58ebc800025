"""GET /v1/neuron/info: device mode, buckets, graphs, KV cache and versions, as JSON.

A vLLM endpoint plugin (entry point group `vllm.endpoint_plugins`, name `neuron-info`); vLLM loads
endpoint plugins only when VLLM_PLUGINS names them, which `vllm-neuron serve` arranges. Under /v1, so
--api-key protects it like the OpenAI routes.
"""

from argparse import Namespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from server import admission
from vllm_neuron import device
from vllm_neuron.config import NeuronConfig
from worker import sampling_rows

ENDPOINT_PLUGIN_NAME = "neuron-info"


class NeuronInfoEndpoint:
    name = ENDPOINT_PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        @app.get("/v1/neuron/info")
        async def neuron_info(request: Request) -> JSONResponse:
            state = request.app.state
            # The driver rank's graphs, as the stablehlo backend lowered them (none for other backends).
            lowered = await state.engine_client.collective_rpc("lowered_graphs")
            # Graphs ready and pending (staged readiness compiles the rest in the background).
            progress = await state.engine_client.collective_rpc("compile_progress")
            return JSONResponse(
                {
                    **state.neuron_info,
                    "admission": admission.in_flight(state.engine_client),
                    "compile": progress[0] if progress else {},
                    "lowered_graphs": lowered[0] if lowered else [],
                }
            )

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        state.neuron_info = describe(engine_client.vllm_config)


def describe(vllm_config) -> dict[str, Any]:
    """What this server runs, from the engine's resolved configuration."""
    neuron_config = NeuronConfig.from_vllm_config(vllm_config)
    buckets = neuron_config.buckets
    cache = vllm_config.cache_config
    scheduler = vllm_config.scheduler_config
    return {
        "device_mode": device.mode(),
        "compile_backend": device.compile_backend(),
        "model": vllm_config.model_config.served_model_name,
        "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."),
        "max_model_len": vllm_config.model_config.max_model_len,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "async_scheduling": bool(scheduler.async_scheduling),
        # With async scheduling: whether a step's calls run on a thread of their own (on Trainium).
        "device_thread": bool(scheduler.async_scheduling) and device.calls_on_a_thread(),
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "buckets": {
            "prefill_tokens": list(buckets.prefill_tokens),
            "decode_batch": list(buckets.decode_batch),
            "context_tokens": list(buckets.context_tokens),
            "decode_context_tokens": buckets.decode_contexts(),
        },
        "graphs": buckets.num_graphs,
        "prefill_tokens_while_decoding": neuron_config.prefill_tokens_while_decoding,
        "sampling": sampling_rows.summary(sampling_rows.host_only(vllm_config.model_config)),
        "kv_cache": {"block_size": cache.block_size, "num_blocks": cache.num_gpu_blocks},
        "versions": device.versions(),
    }
