"""Speculative decoding with a draft model (vLLM's `draft_model` method): a small model with the target's
tokenizer proposes each row's next tokens greedily; the target verifies them in its verify calls
(worker/speculation.py says how they are accepted).

The draft's attention layers sit in vLLM's KV cache groups beside the target's (vLLM registers them in the
same forward context), so they share each request's block table. Its graphs have the target's shapes:
- every call of the target runs the draft on the same inputs too (prefill, mixed, decode and verify), so
  the draft's cache holds every position the target's holds, rolled back the same way: a rejected draft's
  entry is written again before it is read;
- after the step, k decode calls of the draft alone, from each row's newest token, give its k drafts.
So each bucket shape compiles one graph for the target and one for the draft, both at warm-up.
"""

from typing import TYPE_CHECKING

import torch
from vllm.forward_context import ForwardContext

from vllm_neuron.upstream import vllm_runner
from vllm_neuron.upstream.vllm_runner import override_forward_context

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def load_draft_model(vllm_config: "VllmConfig") -> torch.nn.Module:
    """The draft model, loaded the way vLLM's own DraftModelProposer loads it (its draft config, layer
    prefix "draft_model"), without the proposer's GPU buffers and kernels, which the plugin does not use."""
    return vllm_runner.load_draft_model(vllm_config)


class DraftForward(torch.nn.Module):
    """What gets compiled for the draft: its forward on a call's inputs (writing its KV cache) and the
    greedy token of each logits row."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        forward_context: ForwardContext,
    ) -> torch.Tensor:
        with override_forward_context(forward_context):
            hidden = self.model(input_ids=input_ids, positions=positions)
            logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        return logits.argmax(dim=-1)
