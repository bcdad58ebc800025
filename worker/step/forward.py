"""What a call runs: the model forward and its sampler, compiled once per bucket shape (and, with a draft
model, the draft's forward beside it), and the forward context every attention layer reads."""

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from vllm.forward_context import ForwardContext
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model

from vllm_neuron import envs, fused_moe, metrics, sampling
from vllm_neuron.attention_backend import NeuronAttentionMetadata, drop_masks
from vllm_neuron.calls import Call
from vllm_neuron.compiler import compile as neuron_compile
from vllm_neuron.config import NeuronConfig
from vllm_neuron.lora.punica import LORA_ROWS, LORA_SLOTS
from vllm_neuron.upstream import vllm_runner
from vllm_neuron.upstream.vllm_runner import create_forward_context, override_forward_context
from worker.lora.slots import LoRASlots
from worker.spec_decode import draft_model, eagle3
from worker.spec_decode.head_inputs import HiddenSlots
from worker.step.call_inputs import CallInputs
from worker.step.step_state import token_slot_count

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.vllm_neuron.forward")


class ForwardAndSample(torch.nn.Module):
    """What gets compiled: the model forward, the logits of the rows we keep, and a token sampled from each
    (with each row's parameters, vllm_neuron/sampling.py). The logits stay on the device unless a step needs
    vLLM's host sampler. Decode rows whose token the previous step sampled take it from the token slots,
    and each row's sample goes there for the next step (worker/step/step_state.py); with a draft model the
    call's token ids are returned too, for the draft's forward; with an EAGLE3 head the head's first pass
    runs in the call (worker/spec_decode/eagle3.py)."""

    def __init__(
        self, model: torch.nn.Module, returns_input_ids: bool, head: torch.nn.Module | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.returns_input_ids = returns_input_ids
        self.head = head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        sampling_rows: torch.Tensor,
        token_slots: torch.Tensor,
        token_feed: torch.Tensor,
        token_keep: torch.Tensor,
        forward_context: ForwardContext,
        hidden_slots: torch.Tensor | None = None,
        extra: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        fed = token_slots.index_select(0, token_feed).to(input_ids.dtype)
        input_ids = torch.where(token_feed > 0, fed, input_ids)
        # vLLM's layers read the forward context from a global; set here, in the traced code, dynamo takes
        # the attention metadata from this argument, so serving and a background compile, in two threads,
        # each run with their own.
        with override_forward_context(forward_context):
            hidden = self.model(input_ids=input_ids, positions=positions)
            if self.head is not None:  # the target returns its aux layers' hidden states too
                hidden, aux = hidden
                eagle3.first_pass(self.head, input_ids, aux, logits_indices, hidden_slots, extra)
            logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        drop_masks(forward_context.attn_metadata)
        sampled = sampling.sample(logits, sampling_rows)
        token_slots.index_copy_(0, token_keep, sampled.token_ids)
        outputs = (
            logits,
            sampled.token_ids,
            sampled.logprob_token_ids,
            sampled.logprobs,
            sampled.ranks,
            sampled.draft_probs,
        )
        return (*outputs, input_ids) if self.returns_input_ids else outputs


class CompiledModel:
    """The target model, and the draft model with speculative decoding's draft_model method, loaded by vLLM
    and compiled through one compile recorder (vllm_neuron/compiler/compile.py) with `num_graphs` graphs
    each."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        backend: str,
        num_graphs: int,
        compile_workers: int,
        tp_rank: int,
        device: torch.device,
        lora: LoRASlots | None = None,
    ) -> None:
        start = time.perf_counter()
        self.vllm_config = vllm_config
        fused_moe.register()  # before vLLM builds the model's MoE layers
        self.model = get_model(vllm_config=vllm_config)
        if lora is not None:  # vLLM's LoRA layers in place of the model's, before the graphs are traced
            self.model = lora.wrap(self.model)
        dump_dir = envs.VLLM_NEURON_DUMP_GRAPHS
        if dump_dir and vllm_config.parallel_config.tensor_parallel_size > 1:
            dump_dir = f"{dump_dir}/rank-{tp_rank}"
        speculative = vllm_config.speculative_config
        method = speculative.method if speculative is not None else None
        with_draft = method == "draft_model"
        self.head: torch.nn.Module | None = None
        if method == "eagle3":
            self.model.set_aux_hidden_state_layers(vllm_runner.eagle3_aux_layers(vllm_config, self.model))
            self.head = vllm_runner.load_eagle3_head(vllm_config, self.model)
            self.head_layers = eagle3.layer_names(self.head)
        self.step, self.recorder = neuron_compile.compile_static(
            ForwardAndSample(self.model, returns_input_ids=with_draft, head=self.head),
            backend,
            num_graphs,
            strict=envs.VLLM_NEURON_STRICT_SHAPES,
            dump_dir=Path(dump_dir) if dump_dir else None,
            compile_workers=compile_workers,
        )
        self.draft_model: torch.nn.Module | None = None
        self.draft = None
        if with_draft:
            self.draft_model = draft_model.load_draft_model(vllm_config)
            self.draft, _ = neuron_compile.compile_static(
                draft_model.DraftForward(self.draft_model), backend, num_graphs, recorder=self.recorder
            )
        max_num_seqs = NeuronConfig.of(vllm_config).max_num_seqs
        self.token_slots = self.recorder.zeros((token_slot_count(max_num_seqs),), torch.int32, device)
        self.hidden_slots: HiddenSlots | None = None
        self.hidden_buffer: torch.Tensor | None = None
        self.propose = None
        if self.head is not None:
            entries = 1 + speculative.num_speculative_tokens
            self.hidden_slots = HiddenSlots(max_num_seqs, entries, vllm_config.cache_config.block_size)
            hidden_size = self.head.config.hidden_size
            dtype = vllm_config.model_config.dtype
            self.hidden_buffer = self.recorder.zeros((self.hidden_slots.rows, hidden_size), dtype, device)
            self.propose, _ = neuron_compile.compile_static(
                eagle3.ProposeForward(self.head), backend, num_graphs, recorder=self.recorder
            )
        # The layers whose KV cache a call's metadata describes (the draft model's too): set once the cache is
        # bound to them.
        self.attention_layers: list[str] = []
        logger.info("Model loaded in %.1f s", time.perf_counter() - start)

    @property
    def drafts(self) -> bool:
        """A second model proposes drafts: a draft model or an EAGLE3 head."""
        return self.draft is not None or self.head is not None

    @property
    def models(self) -> list[torch.nn.Module]:
        second = self.draft_model if self.draft_model is not None else self.head
        return [self.model, *([second] if second is not None else [])]

    @torch.no_grad()  # one grad mode for warm-up and serving: dynamo guards on it and would recompile
    def run(self, call: Call, inputs: CallInputs) -> tuple[torch.Tensor, ...]:
        """One compiled call (`forward`), named to the compile recorder (recompile messages, lowered graphs'
        labels) and, on a Neuron runtime error, in the log; the seconds of a graph it compiled are counted."""
        self.recorder.thread.call = call
        start, graphs = time.perf_counter(), len(self.recorder.graphs)
        try:
            outputs = self.forward(inputs)
        except Exception as error:
            # A Neuron runtime error says nothing of our shapes: name the call (phase and bucket).
            logger.error("Compiled call failed: %s: %s", call, error)
            raise
        if len(self.recorder.graphs) > graphs:
            metrics.COMPILE_SECONDS.labels(phase=call.phase).inc(time.perf_counter() - start)
        return outputs

    def run_draft(self, call: Call, inputs: CallInputs) -> torch.Tensor:
        """The draft model's own call (`draft_tokens`), named to the compile recorder."""
        self.recorder.thread.call = call
        return self.draft_tokens(inputs)

    @torch.no_grad()
    def run_propose(self, call: Call, inputs: "eagle3.ProposeInputs") -> torch.Tensor:
        """An EAGLE3 head's propose call (worker/spec_decode/eagle3.py) on `call`'s decode shape: each row's
        drafts, on the device."""
        self.recorder.thread.call = f"propose of {call}"
        contexts = [
            create_forward_context(dict.fromkeys(self.head_layers, step.metadata), self.vllm_config)
            for step in inputs.passes
        ]
        positions = [step.positions for step in inputs.passes]
        return self.propose(inputs.token_ids, inputs.hidden_index, self.hidden_buffer, positions, contexts)

    def forward(self, inputs: CallInputs) -> tuple[torch.Tensor, ...]:
        """The compiled model and sampler on one call's inputs, then the draft model's on the same tokens
        (its KV cache follows the target's); the outputs (ForwardAndSample's) stay on the device."""
        outputs = self.step(
            inputs.input_ids,
            inputs.positions,
            inputs.logits_indices,
            inputs.sampling_rows,
            self.token_slots,
            inputs.token_feed,
            inputs.token_keep,
            self._context(inputs.metadata, inputs),
            *((self.hidden_buffer, inputs.extra) if self.head is not None else ()),
        )
        if self.draft is None:
            return outputs
        *outputs, input_ids = outputs
        self.draft_tokens(inputs, input_ids)
        return tuple(outputs)

    def draft_tokens(self, inputs: CallInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The compiled draft model on a call's inputs (`input_ids`: its tokens as the target's graph took
        them, default the call's own): each logits row's greedy token, on the device."""
        return self.draft(
            inputs.input_ids if input_ids is None else input_ids,
            inputs.positions,
            inputs.logits_indices,
            self._context(inputs.metadata.without_masks()),
        )

    def _context(self, metadata: NeuronAttentionMetadata, inputs: CallInputs | None = None) -> ForwardContext:
        # Every attention layer, the draft model's too, reads the call's metadata: they share block tables.
        # With --enable-lora the punica wrapper reads the call's LoRA slots from it too.
        lora = inputs is not None and inputs.lora_slots is not None
        layers = dict.fromkeys(self.attention_layers, metadata)
        if self.head is not None and inputs is not None:  # the head's first pass: its own metadata
            layers |= dict.fromkeys(self.head_layers, eagle3.head_metadata(inputs))
        return create_forward_context(
            layers,
            self.vllm_config,
            additional_kwargs={LORA_SLOTS: inputs.lora_slots, LORA_ROWS: inputs.lora_rows} if lora else None,
        )
