"""Remote code of a test model (tests/engine/test_check.py): Llama whose rotary angles are unit complex
numbers, as Meta's reference Llama code computes them (torch.polar). StableHLO has no complex types in
torch-mlir's lowering, so its graphs cannot lower: `vllm-neuron check` must say so, naming the op and this
file's line."""

import torch
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel, LlamaRotaryEmbedding


class ComplexRotaryEmbedding(LlamaRotaryEmbedding):
    def forward(self, x, position_ids):
        angles = position_ids[..., None].float() * self.inv_freq
        rotations = torch.polar(torch.ones_like(angles), angles)
        rotations = torch.cat((rotations, rotations), dim=-1)
        return rotations.real.to(x.dtype), rotations.imag.to(x.dtype)


class ComplexLlamaModel(LlamaModel):
    def __init__(self, config):
        super().__init__(config)
        self.rotary_emb = ComplexRotaryEmbedding(config=config)


class ComplexLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model = ComplexLlamaModel(config)
