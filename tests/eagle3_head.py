"""A random EAGLE3 head for tests/tiny_model.py's target, written as a speculators-style checkpoint that
vLLM's Eagle3LlamaForCausalLM loads (vllm/model_executor/models/llama_eagle3.py): one decoder layer whose
attention takes [embedding; hidden] (2H), `fc` over three of the target's hidden states (3H -> H), its own
norm, lm_head and embedding, the target's vocabulary (no d2t map), float32."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# The target's layers whose input the head reads: the embeddings, and the states entering layers 1 and 2
# (2 = after the last layer, before its norm). vLLM's default (2, n // 2, n - 3) needs 4 layers or more.
AUX_LAYERS = [0, 1, 2]


def build_eagle3_head(
    out: Path,
    target_dir: Path,
    seed: int = 7,
    scale: float = 0.05,
    echo: bool = False,
    attention_scale: float | None = None,
) -> Path:
    """`echo`: a head that mostly proposes the target's own next token again: it takes the target's
    embedding and lm_head, `fc` passes the target's last state through, and its attention and MLP add only a
    little (scaled by `scale`) - its drafts are accepted where the output repeats a token, and depend on the
    head's cache a little, so that a wrong cache entry changes a draft now and then."""
    target = json.loads((target_dir / "config.json").read_text())
    hidden, inter = target["hidden_size"], target["intermediate_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = hidden // heads
    vocab = target["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "draft_vocab_size": vocab,
        "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS},
    }
    generator = torch.Generator().manual_seed(seed)

    sharpen = 1.0 if attention_scale is None else attention_scale / scale

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    weights = {
        "midlayer.self_attn.q_proj.weight": randn(heads * head_dim, 2 * hidden) * sharpen,
        "midlayer.self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * hidden) * sharpen,
        "midlayer.self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": randn(inter, hidden),
        "midlayer.mlp.up_proj.weight": randn(inter, hidden),
        "midlayer.mlp.down_proj.weight": randn(hidden, inter),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "fc.weight": randn(hidden, len(AUX_LAYERS) * hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": randn(vocab, hidden) * 20,
        "embed_tokens.weight": randn(vocab, hidden) * 20,
    }
    if echo:
        from safetensors.torch import load_file

        target_weights = load_file(str(target_dir / "model.safetensors"))
        weights["embed_tokens.weight"] = target_weights["model.embed_tokens.weight"].clone()
        weights["lm_head.weight"] = target_weights["lm_head.weight"].clone()
        weights["norm.weight"] = target_weights["model.norm.weight"].clone()
        fc = torch.zeros(hidden, len(AUX_LAYERS) * hidden)
        fc[:, -hidden:] = torch.eye(hidden)
        weights["fc.weight"] = fc
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(out / "model.safetensors"))
    return out
