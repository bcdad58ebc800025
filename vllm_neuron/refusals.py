"""What the plugin refuses at start-up, by name: each area's table of {message: refused}, checked while vLLM
resolves the engine's configuration (NeuronPlatform.check_and_update_config), before anything loads."""

from typing import TYPE_CHECKING

import vllm.envs as vllm_envs

from vllm_neuron import device as neuron_device
from vllm_neuron.config import NeuronConfig
from vllm_neuron.upstream import vllm_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class UnsupportedConfigError(ValueError):
    """A model or engine setting the plugin refuses at start-up; the message says why and what to change."""


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3")


def speculative_method(vllm_config: "VllmConfig") -> str | None:
    """The speculative decoding method (None: off). The plugin verifies n-gram (prompt lookup), draft model
    and EAGLE3 head proposals."""
    speculative = vllm_config.speculative_config
    return None if speculative is None else speculative.method


def _lora_refusals(vllm_config: "VllmConfig") -> dict[str, bool]:
    """What the LoRA slots (vllm_neuron/lora/punica.py) do not serve, refused by name at start-up."""
    lora = vllm_config.lora_config
    if lora is None:
        return {}
    model_config = vllm_config.model_config
    return {
        "LoRA on MoE models is not supported: the experts take no adapter slots": model_config.is_moe,
        "--fully-sharded-loras is not supported: remove it": lora.fully_sharded_loras,
        "VLLM_LORA_ENABLE_DUAL_STREAM is CUDA only: unset it": (vllm_envs.VLLM_LORA_ENABLE_DUAL_STREAM),
        "LoRA with a draft model or an EAGLE3 head is not supported yet: use the ngram method": (
            speculative_method(vllm_config) in ("draft_model", "eagle3")
        ),
    }


def _quantization_refusals(vllm_config: "VllmConfig") -> dict[str, bool]:
    """What the FP8 kernel (vllm_neuron/quantization/fp8.py) does not serve, named before the weights load."""
    checkpoint = getattr(vllm_config.model_config.hf_config, "quantization_config", None) or {}
    if not isinstance(checkpoint, dict):
        checkpoint = checkpoint.to_dict()
    refusals = {
        "block-scaled FP8 (weight_block_size, ModelOpt FP8_PB_WO) is not supported: serve a per-tensor or "
        "per-channel FP8 checkpoint, or the unquantized model with --quantization fp8": (
            checkpoint.get("weight_block_size") is not None or checkpoint.get("quant_algo") == "FP8_PB_WO"
        ),
    }
    kv_scheme = checkpoint.get("kv_cache_scheme") or {}
    refusals[
        "per-head FP8 KV cache scales (kv_cache_scheme strategy attn_head) are not supported: the plugin's "
        "FP8 cache has one key and one value scale per layer; serve a per-tensor kv_cache_scheme, or "
        "--kv-cache-dtype auto"
    ] = (
        isinstance(kv_scheme, dict)
        and kv_scheme.get("strategy") == "attn_head"
        and (vllm_config.cache_config.cache_dtype != "auto")
    )
    for name, group in checkpoint.get("config_groups", {}).items():  # compressed-tensors
        weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
        fp8 = weights.get("type") == "float" and weights.get("num_bits") == 8 and weights.get("symmetric")
        refusals[
            f"compressed-tensors group {name!r} is not FP8 with per-tensor or per-channel weight scales "
            f"(weights {_scheme(weights)}): the plugin serves FP8 weights only"
        ] = not fp8 or weights.get("strategy") not in ("tensor", "channel") or weights.get("dynamic")
        refusals[
            f"compressed-tensors group {name!r} quantizes activations with static scales other than per "
            f"tensor ({_scheme(inputs)}): the plugin applies one static FP8 scale per layer input"
        ] = bool(inputs) and not inputs.get("dynamic") and inputs.get("strategy") != "tensor"
    return refusals


def _scheme(args: dict) -> str:
    return f"{args.get('type')} {args.get('num_bits')}-bit, {args.get('strategy')}" if args else "none"


def _draft_model_refusals(vllm_config: "VllmConfig") -> dict[str, bool]:
    """What the plugin's draft model and EAGLE3 head runners (worker/spec_decode/draft_model.py, eagle3.py) do
    not do."""
    speculative = vllm_config.speculative_config
    if speculative is None or speculative.method not in ("draft_model", "eagle3"):
        return {}
    eagle3 = speculative.method == "eagle3"
    return {
        **(_eagle3_refusals(vllm_config) if eagle3 else {}),
        "a draft model with another vocabulary (use_heterogeneous_vocab) is not supported: use a draft "
        "model with the target's tokenizer": speculative.use_heterogeneous_vocab,
        f"draft_sample_method {speculative.draft_sample_method!r} is not supported: the plugin's draft "
        "model proposes its greedy tokens (draft_sample_method 'greedy')": speculative.draft_sample_method
        != "greedy",
        f"rejection_sample_method {speculative.rejection_sample_method!r} is not supported: the plugin "
        "verifies drafts by standard speculative sampling": speculative.rejection_sample_method != "standard",
        "a draft model with tensor parallelism is not supported yet: use --tensor-parallel-size 1": (
            not eagle3 and vllm_config.parallel_config.tensor_parallel_size > 1
        ),
    }


def _eagle3_refusals(vllm_config: "VllmConfig") -> dict[str, bool]:
    speculative = vllm_config.speculative_config
    return {
        "parallel drafting (P-EAGLE) is not supported: the plugin's head drafts one token a pass": (
            speculative.parallel_drafting
        ),
    }


def _kv_events_refusals(vllm_config: "VllmConfig") -> dict[str, bool]:
    """KV events a router could not use. The rule: the events describe the prefix cache's blocks by hashes a
    router recomputes from a prompt's tokens, so there must be a prefix cache, and the hashes must be
    reproducible outside this server."""
    events = vllm_config.kv_events_config
    if events is None or not events.enable_kv_cache_events:
        return {}
    cache_config = vllm_config.cache_config
    return {
        "--kv-events-config with prefix caching off publishes no block events: remove "
        "--no-enable-prefix-caching": not cache_config.enable_prefix_caching,
        f"--kv-events-config with --prefix-caching-hash-algo {cache_config.prefix_caching_hash_algo} and no "
        "PYTHONHASHSEED hashes blocks from a random seed per process, which no router can reproduce: set "
        "PYTHONHASHSEED to a secret shared with the router, or use --prefix-caching-hash-algo sha256_cbor": (
            vllm_engine.block_hash_seed(cache_config.prefix_caching_hash_algo) is None
        ),
    }


def check(vllm_config: "VllmConfig") -> None:
    """Refuse the model and engine settings the plugin would serve wrong."""
    model_config = vllm_config.model_config
    refusals = {
        "state-space and linear-attention layers (Mamba, hybrid models) are not supported: the plugin's KV "
        "cache holds attention keys and values only": model_config.is_hybrid
        or model_config.is_attention_free
        or model_config.has_inner_state,
        "encoder-decoder models are not supported (cross-attention): serve a decoder-only model": (
            model_config.is_encoder_decoder
        ),
        "MLA (multi-head latent attention) is not supported: the plugin's KV cache stores per-head keys and "
        "values": model_config.use_mla,
        "chunked local attention (attention_chunk_size, Llama 4) is not supported": (
            getattr(model_config.hf_text_config, "attention_chunk_size", None) is not None
        ),
        "vLLM's V2 model runner is not supported: unset VLLM_USE_V2_MODEL_RUNNER": (
            vllm_config.use_v2_model_runner
        ),
        "pipeline parallelism is not supported: use --pipeline-parallel-size 1": (
            vllm_config.parallel_config.pipeline_parallel_size > 1
        ),
        f"speculative decoding method {speculative_method(vllm_config)!r} is not supported: use "
        '--speculative-config \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        '(prompt lookup), \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\' '
        "(a small model with the target's tokenizer), "
        '\'{"method": "eagle3", "model": HEAD, "num_speculative_tokens": 3}\' (an EAGLE3 head), '
        "or remove --speculative-config": speculative_method(vllm_config) not in (None, *SPECULATIVE_METHODS),
        **_draft_model_refusals(vllm_config),
        **_lora_refusals(vllm_config),
        **_quantization_refusals(vllm_config),
        **_kv_events_refusals(vllm_config),
        f"quantized MoE models are not supported ({model_config.quantization} quantization): the plugin's "
        "experts are unquantized (vllm_neuron/moe.py); serve an unquantized checkpoint": (
            model_config.is_moe and model_config.quantization is not None
        ),
        "data parallelism with an MoE model is not supported: vLLM runs MoE engines in lock-step (dummy "
        "steps for idle engines), which the plugin's runner does not; serve DP=1 replicas behind a router": (
            model_config.is_moe and vllm_config.parallel_config.data_parallel_size > 1
        ),
        "expert parallelism is not supported: remove --enable-expert-parallel (every rank holds every "
        "expert's slice, vllm_neuron/moe.py)": vllm_config.parallel_config.enable_expert_parallel,
        "returning routed experts is not supported: remove --enable-return-routed-experts": (
            vllm_config.aux_output_config.enable_return_routed_experts
        ),
        "only text generation models are supported (this model is a pooling or multimodal model)": (
            model_config.runner_type not in ("generate", "draft") or model_config.is_multimodal_model
        ),
    }
    _raise_refused(refusals)


def _raise_refused(refusals: dict[str, bool]) -> None:
    for message, refused in refusals.items():
        if refused:
            raise UnsupportedConfigError(f"Neuron plugin: {message}")


# The KV connectors the worker drives around its compiled steps (worker/kv/kv_transfer.py); NIXL's pull
# connector through host buffers of its own (worker/kv/nixl.py), which the platform points vLLM's factory to.
NIXL_CONNECTORS = ("NixlConnector", "NixlPullConnector")
KV_CONNECTORS = ("ExampleConnector", *NIXL_CONNECTORS)
NIXL_MODULE = "worker.kv.nixl"
# kv_connector_extra_config's switch for nixl's progress thread in each rank's NIXL agent (worker/kv/nixl.py).
NIXL_PROGRESS_THREAD = "progress_thread"


def check_kv_transfer(vllm_config: "VllmConfig", neuron_config: NeuronConfig) -> None:
    """Refuse what --kv-transfer-config asks that the plugin would serve wrong (docs/disaggregation.md), and
    fresh prefill calls with an EAGLE3 head: the refusals that need the resolved buckets."""
    _raise_refused(_kv_transfer_refusals(vllm_config, neuron_config))


def _kv_transfer_refusals(vllm_config: "VllmConfig", neuron_config: NeuronConfig) -> dict[str, bool]:
    transfer = vllm_config.kv_transfer_config
    name = transfer.kv_connector if transfer is not None else None
    # (Not a KV transfer's, but also one that needs the resolved buckets.)
    fresh = {
        "an EAGLE3 head with fresh prefill calls is not supported (its first pass reads the cache): set "
        "fresh_prefill_buckets [] in --additional-config": speculative_method(vllm_config) == "eagle3"
        and bool(neuron_config.buckets.fresh_buckets)
    }
    if name is None:
        return fresh
    scheduler = vllm_config.scheduler_config
    nixl = name in NIXL_CONNECTORS
    return fresh | {
        f"KV connector {name} is not supported: the plugin runs a connector around each step's compiled "
        "calls (every load before them, every save after them, no per-layer hooks inside the graph), which "
        f"{', '.join(KV_CONNECTORS)} work with; use one of them": name not in KV_CONNECTORS
        or transfer.kv_connector_module_path not in (None, NIXL_MODULE if nixl else None),
        f"{name} stages KV through host memory on this platform: remove kv_buffer_device "
        f"{transfer.kv_buffer_device!r} from --kv-transfer-config (or set it to 'cpu')": nixl
        and transfer.kv_buffer_device not in ("cpu", neuron_device.device_type()),
        f"kv_connector_extra_config's {NIXL_PROGRESS_THREAD!r} is true (each rank's NIXL agent runs nixl's "
        "progress thread, vLLM's default) or false (NIXL progresses when vLLM polls it each step), not "
        f"{transfer.get_from_extra_config(NIXL_PROGRESS_THREAD, True)!r}": nixl
        and not isinstance(transfer.get_from_extra_config(NIXL_PROGRESS_THREAD, True), bool),
        "ExampleConnector names its files by layer and prompt only, so the ranks of --tensor-parallel-size "
        "> 1 would overwrite each other's shards: use --tensor-parallel-size 1": name == "ExampleConnector"
        and vllm_config.parallel_config.tensor_parallel_size > 1,
        "ExampleConnector stores a prompt's KV in the step that first schedules it, so a server that saves "
        "(kv_producer, kv_both) must prefill each prompt in one step: add --no-enable-chunked-prefill, "
        "--max-num-batched-tokens of at least --max-model-len and --additional-config "
        "'{\"prefill_tokens_while_decoding\": 0}'": name == "ExampleConnector"
        and transfer.is_kv_producer
        and (scheduler.enable_chunked_prefill or neuron_config.buckets.prefill_tokens_while_decoding > 0),
    }
