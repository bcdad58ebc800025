"""vLLM 0.32's internals as the model runner and its parts reach them: helpers of vLLM's GPU model runner, its
persistent batch (InputBatch), the speculative-decoding proposers and the forward context. The helpers the
runner calls as they are are re-exported here, the same objects (the forward context's run inside traced
code); the rest are small functions. tests/unit/test_upstream.py pins each one; docs/maintaining.md says what
to do when one moves."""

from typing import TYPE_CHECKING, Any

import torch

# The forward context vLLM's layers read: built per call, and set around the model inside the traced step.
from vllm.forward_context import create_forward_context, override_forward_context

# vLLM's sampler, on the host for requests the graph cannot sample.
from vllm.v1.sample.sampler import Sampler

# Structured output (the grammar's bitmask on the host logits) and the scheduler's -1 draft placeholders.
from vllm.v1.structured_output.utils import apply_grammar_bitmask, strip_speculative_padding

# A KV connector's part of a step (--kv-transfer-config), as vLLM's GPU runner drives it: bind the scheduler's
# metadata, start the loads, wait for the saves, collect the finished transfers into the step's output.
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

# Each attention layer's KV cache tensor, bound into the layer and the runner's list.
from vllm.v1.worker.utils import bind_kv_cache

if TYPE_CHECKING:
    import numpy as np
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

__all__ = [
    "INPUT_BATCH_MEMBERS",
    "KVConnectorModelRunnerMixin",
    "Sampler",
    "apply_grammar_bitmask",
    "bind_kv_cache",
    "create_forward_context",
    "host_input_batch",
    "kv_cache_scales",
    "load_draft_model",
    "new_request_state",
    "ngram_proposer",
    "override_forward_context",
    "propose_ngram_drafts",
    "strip_speculative_padding",
]

# What the plugin reads and calls of vLLM's InputBatch (worker/step/persistent_batch.py,
# worker/spec_decode/speculation.py, worker/step/model_runner.py): the GPU runner's persistent batch, kept on
# the host. vLLM 0.32: vllm/v1/worker/gpu_input_batch.py.
INPUT_BATCH_MEMBERS = (
    "req_ids",
    "req_id_to_index",
    "num_reqs",
    "token_ids_cpu",
    "is_token_ids",
    "num_tokens_no_spec",
    "num_prompt_tokens",
    "num_computed_tokens_cpu",
    "block_table",
    "generators",
    "sampling_metadata",
    "add_request",
    "remove_request",
    "condense",
    "refresh_metadata",
)


def host_input_batch(
    vllm_config: "VllmConfig", max_num_reqs: int, block_size: int, max_blocks_per_req: int
) -> "InputBatch":
    """vLLM's persistent batch on the host: `max_num_reqs` rows, one block table of `block_size` blocks, the
    model's logits processors (with custom ones, output token ids kept for them). vLLM 0.32:
    `vllm.v1.worker.gpu_input_batch.InputBatch` and `vllm.v1.sample.logits_processor.build_logitsprocs`."""
    from vllm.v1.sample.logits_processor import build_logitsprocs
    from vllm.v1.worker.gpu_input_batch import InputBatch

    model_config = vllm_config.model_config
    scheduler_config = vllm_config.scheduler_config
    host = torch.device("cpu")
    custom_logitsprocs = tuple(model_config.logits_processors or ())
    return InputBatch(
        max_num_reqs=max_num_reqs,
        max_model_len=model_config.max_model_len,
        max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        device=host,
        vocab_size=model_config.get_vocab_size(),
        block_sizes=[block_size],
        max_num_blocks_per_req=[max_blocks_per_req],
        logitsprocs=build_logitsprocs(vllm_config, host, False, False, custom_logitsprocs),
        logitsprocs_need_output_token_ids=bool(custom_logitsprocs),
    )


def new_request_state(**fields: Any) -> "CachedRequestState":
    """A request's state in the persistent batch, from its fields (req_id, prompt_token_ids, sampling_params,
    generator, block_ids, num_computed_tokens, output_token_ids, ...). vLLM 0.32:
    `vllm.v1.worker.gpu_input_batch.CachedRequestState`."""
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(**fields)


def kv_cache_scales(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention layer's FP8 KV cache scales, 0-d float32 buffers (1.0, or a checkpoint's after loading):
    the key's and the value's. vLLM 0.32: `Attention._k_scale` / `_v_scale`, registered by
    `vllm.model_executor.layers.attention.attention.set_default_quant_scales`."""
    return layer._k_scale, layer._v_scale


def ngram_proposer(vllm_config: "VllmConfig") -> Any:
    """vLLM's n-gram (prompt lookup) proposer for `vllm_config`'s speculative config. vLLM 0.32:
    `vllm.v1.spec_decode.ngram_proposer.NgramProposer`."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    return NgramProposer(vllm_config)


def propose_ngram_drafts(
    proposer: Any,
    num_speculative_tokens: int,
    sampled_token_ids: list[list[int]],
    num_tokens_no_spec: "np.ndarray",
    token_ids_cpu: "np.ndarray",
) -> list[list[int]]:
    """Each row's drafts (none for a row whose sampled list is empty). vLLM 0.32: `NgramProposer.propose`,
    over the batch's token ids and lengths."""
    return proposer.propose(num_speculative_tokens, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)


def load_draft_model(vllm_config: "VllmConfig") -> torch.nn.Module:
    """The draft model of `vllm_config`'s speculative config, loaded the way vLLM's DraftModelProposer loads
    it (its draft config, layer prefix "draft_model"), without the proposer's GPU buffers and kernels. vLLM
    0.32: `DraftModelProposer.__new__` (its __init__ skipped), with the two attributes `_get_model` and
    `_create_draft_vllm_config` read, then `DraftModelProposer._get_model`."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    proposer = DraftModelProposer.__new__(DraftModelProposer)
    proposer.vllm_config = vllm_config
    proposer.speculative_config = vllm_config.speculative_config
    return proposer._get_model()


def load_eagle3_head(vllm_config: "VllmConfig", target: torch.nn.Module) -> torch.nn.Module:
    """An EAGLE3 head of `vllm_config`'s speculative config, loaded the way vLLM's EagleProposer loads it
    (its draft config, model tag "eagle_head"), with the target's embedding and lm_head shared where the
    head has none of its own or the same ones. vLLM 0.32: `EagleProposer.__new__` (its __init__ and its GPU
    buffers skipped), the attributes `vllm_config`, `speculative_config`, `model` and
    `use_local_argmax_reduction` (off: the plugin takes the argmax over the whole vocabulary) set, then
    `_get_model`, `_maybe_share_embeddings` and `_maybe_share_lm_head` of SpecDecodeBaseProposer."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    proposer = EagleProposer.__new__(EagleProposer)
    proposer.vllm_config = vllm_config
    proposer.speculative_config = vllm_config.speculative_config
    proposer.use_local_argmax_reduction = False
    proposer.model = proposer._get_model()
    proposer._maybe_share_embeddings(target)
    proposer._maybe_share_lm_head(target)
    return proposer.model


def eagle3_aux_layers(vllm_config: "VllmConfig", target: torch.nn.Module) -> tuple[int, ...]:
    """The target layers whose input an EAGLE3 head reads, as vLLM's GPU runner picks them: the head's
    config's (`eagle_aux_hidden_state_layer_ids`, also under `eagle_config`), else the target's default.
    vLLM 0.32: GPUModelRunner._get_eagle3_aux_layers_from_config reads only `speculative_config`."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = SimpleNamespace(speculative_config=vllm_config.speculative_config)
    layers = GPUModelRunner._get_eagle3_aux_layers_from_config(runner)
    return tuple(layers) if layers else tuple(target.get_eagle3_default_aux_hidden_state_layers())
