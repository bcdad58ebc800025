"""GET /v1/neuron/info: device mode, buckets, graphs, KV cache and versions, as JSON.

A vLLM endpoint plugin (entry point group `vllm.endpoint_plugins`, name `neuron-info`); vLLM loads
endpoint plugins only when VLLM_PLUGINS names them, which `vllm-neuron serve` arranges. Under /v1, so
--api-key protects it like the OpenAI routes.
"""

import os
from argparse import Namespace
from typing import Any

import vllm.envs as vllm_envs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from server import admission
from vllm_neuron import acceptance, device, host_cpu
from vllm_neuron.config import NeuronConfig
from vllm_neuron.upstream import vllm_engine, vllm_server
from worker.step import sampling_rows

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
            # The driver rank's graph reserve, and how it was chosen (None in CPU mode).
            reserve = await state.engine_client.collective_rpc("graph_reserve_info")
            info = dict(state.neuron_info)
            if info["lora"] is not None:
                [slots] = (await state.engine_client.collective_rpc("lora_info"))[:1]
                info["lora"] = {**info["lora"], **_lora_slots(slots, state.openai_serving_models)}
            if info["speculative"] is not None:
                totals = _registry_totals(acceptance.COUNTERS)
                info["speculative"] = {**info["speculative"], **acceptance.figures(*totals)}
                info["speculative"] |= _calls_per_step()
            return JSONResponse(
                {
                    **info,
                    "admission": admission.in_flight(state.engine_client),
                    "compile": progress[0] if progress else {},
                    "graph_reserve": reserve[0] if reserve else None,
                    "lowered_graphs": lowered[0] if lowered else [],
                }
            )

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        state.neuron_info = describe(engine_client.vllm_config)
        if state.neuron_info["kv_events"] is not None:
            # Each engine's endpoint as it reported it: a tcp port of 0 resolves to the one bound, and with
            # --data-parallel-size each engine publishes on its own (vLLM offsets the port by the DP rank).
            sources = engine_client.get_kv_event_sources()
            if sources:
                endpoints = [sources[rank].endpoint for rank in sorted(sources)]
                state.neuron_info["kv_events"].update(endpoint=endpoints[0], endpoints=endpoints)
        if engine_client.vllm_config.lora_config is not None:
            vllm_server.answer_refused_adapters_with_400(state.openai_serving_models)


def _speculative(vllm_config, buckets) -> dict[str, Any] | None:
    """The speculative decoding this server runs (None: off); the endpoint adds its acceptance so far."""
    speculative = vllm_config.speculative_config
    if speculative is None:
        return None
    draft_model = speculative.method == "draft_model"
    head = speculative.method == "eagle3"
    return {
        "method": speculative.method,
        "num_speculative_tokens": speculative.num_speculative_tokens,
        "prompt_lookup_min": speculative.prompt_lookup_min,
        "prompt_lookup_max": speculative.prompt_lookup_max,
        "draft_model": speculative.draft_model_config.model if draft_model or head else None,
        "verify_tokens": buckets.verify_tokens,
        "verify_graphs": len(buckets.verify_shapes()),
        # A draft model compiles a graph of its own for each of the plan's shapes
        # (worker/spec_decode/draft_model.py).
        "draft_graphs": buckets.num_graphs if draft_model else 0,
        # An EAGLE3 head's passes run in one propose graph per decode shape (worker/spec_decode/eagle3.py).
        "propose_graphs": len(buckets.decode_shapes()) if head else 0,
        "applies_to": "requests sampled in the graph without logprobs; others decode a token a step",
    }


def _lora(vllm_config) -> dict[str, Any] | None:
    """The adapter slots' configuration (None: --enable-lora off); the endpoint adds what they hold."""
    lora = vllm_config.lora_config
    if lora is None:
        return None
    return {
        "max_loras": lora.max_loras,
        "max_lora_rank": lora.max_lora_rank,
        "max_cpu_loras": lora.max_cpu_loras,
    }


def _lora_slots(slots: dict[str, Any], serving_models) -> dict[str, Any]:
    """The driver rank's slots by adapter name (None: free), their device bytes, and every adapter the server
    knows (loaded at start or at run time; those not in a slot are loaded by the next request that names
    them)."""
    names = {request.lora_int_id: name for name, request in serving_models.lora_requests.items()}
    return {
        "slots": [names.get(lora_id, str(lora_id)) if lora_id else None for lora_id in slots["slots"]],
        "slot_bytes": slots["slot_bytes"],
        "adapters": sorted(names.values()),
    }


def _calls_per_step() -> dict[str, float | None]:
    """Compiled calls a scheduler step so far, all of them and an EAGLE3 head's propose calls (None before
    any step): a decode step is a verify call and a propose call."""
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

    registry = REGISTRY
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:  # the engine core's series (server/cli.py)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    calls = proposes = steps = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "vllm_neuron:bucket_calls_total":
                calls += sample.value
                proposes += sample.value if sample.labels.get("phase") == "propose" else 0
            elif sample.name == "vllm_neuron:sampled_steps_total":
                steps += sample.value
    return {
        "calls_per_step": calls / steps if steps else None,
        "propose_calls_per_step": proposes / steps if steps else None,
    }


def _registry_totals(names: tuple[str, ...]) -> list[float]:
    """Each counter sample's value in this process's Prometheus registry, summed over labels."""
    # Imported here: server/cli.py imports this module, and sets up Prometheus's multiprocess directory
    # (the engine's series on /metrics) only if prometheus_client is not imported yet.
    from prometheus_client import REGISTRY

    totals = dict.fromkeys(names, 0.0)
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return [totals[name] for name in names]


def _kv_events(vllm_config) -> dict[str, Any] | None:
    """Where this server publishes KV events (None: off), and what a router needs to hash a prompt's blocks
    into the hashes the events carry: the block size (the plugin's one KV cache group hashes whole blocks),
    the algorithm and its seed."""
    events = vllm_config.kv_events_config
    if events is None or not events.enable_kv_cache_events:
        return None
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    # The seed's value stays on the server when it comes from the environment.
    seed = "PYTHONHASHSEED" if "PYTHONHASHSEED" in os.environ else vllm_engine.block_hash_seed(algo)
    return {
        "publisher": events.publisher,
        "endpoint": events.endpoint,
        # One per data-parallel engine, in rank order (the first is `endpoint`).
        "endpoints": [events.endpoint],
        "replay_endpoint": events.replay_endpoint,
        "topic": events.topic,
        "block_size": vllm_config.cache_config.block_size,
        "hash_algo": algo,
        "hash_seed": seed,
        # uint64: the hash's last 8 bytes as a big-endian integer (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
        "block_hashes": "uint64" if vllm_envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else "bytes",
    }


def _kv_cache_dtype(vllm_config) -> str:
    """The cache's element type as --kv-cache-dtype names it, "auto" resolved to the model's dtype."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype == "auto":
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    return cache_dtype


def describe(vllm_config) -> dict[str, Any]:
    """What this server runs, from the engine's resolved configuration."""
    neuron_config = NeuronConfig.of(vllm_config)
    buckets = neuron_config.buckets
    cache = vllm_config.cache_config
    scheduler = vllm_config.scheduler_config
    return {
        "device_mode": device.mode(),
        "compile_backend": neuron_config.compile_backend,
        "model": vllm_config.model_config.served_model_name,
        "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."),
        # CPU mode: the host's ISA, which decides --dtype auto (vllm_neuron/host_cpu.py)
        "host_cpu": host_cpu.describe() if device.mode() == "cpu" else None,
        "max_model_len": vllm_config.model_config.max_model_len,
        "max_num_seqs": neuron_config.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "async_scheduling": bool(scheduler.async_scheduling),
        # With async scheduling: whether a step's calls run on a thread of their own (on Trainium).
        "device_thread": bool(scheduler.async_scheduling) and device.calls_on_a_thread(),
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "data_parallel_size": vllm_config.parallel_config.data_parallel_size,
        # The endpoint's published names (tests/engine/test_server.py pins them); decode_context_tokens is the
        # context buckets decode calls use (BucketConfig.decode_contexts), not the setting
        # decode_context_buckets.
        "buckets": {
            "prefill_tokens": list(buckets.prefill_buckets),
            "decode_batch": list(buckets.decode_batch_buckets),
            "context_tokens": list(buckets.context_buckets),
            "decode_context_tokens": buckets.decode_contexts(),
            "fresh_prefill_tokens": list(buckets.fresh_buckets),
        },
        "graphs": buckets.num_graphs,
        "prefill_tokens_while_decoding": buckets.prefill_tokens_while_decoding,
        "sampling": sampling_rows.summary(sampling_rows.host_only(vllm_config.model_config)),
        "speculative": _speculative(vllm_config, buckets),
        "lora": _lora(vllm_config),
        "kv_events": _kv_events(vllm_config),
        "kv_cache": {
            "block_size": cache.block_size,
            "num_blocks": cache.num_gpu_blocks,
            # --kv-cache-dtype: "auto" stores the model's dtype; fp8 / fp8_e4m3 store e4m3 bits in uint8.
            "dtype": _kv_cache_dtype(vllm_config),
        },
        "versions": device.versions(),
    }
