"""The architecture matrix's cases: tiny random-weight models of vLLM's text-generation architectures, built
offline from transformers configs with their structural features kept (head dims, GQA ratios, biases, norms,
rotary variants, tied embeddings, sliding windows, soft-capping, MoE routing).

Each case is a transformers `model_type` and the config values that make it tiny but keep what the
architecture is about. A case the plugin refuses names the words its start-up error must contain. Where a
case exercises a feature that could be silently ignored (a sliding window, soft-capping, routing),
`feature_off` names it with the config values that switch it off: the matrix checks that HF's own tokens
then change, so serving with the feature ignored could not pass.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from tests.tiny_model import build_tokenizer

# Shared by every case unless it overrides them: 2 layers, hidden 64, 4 query heads of 16 over 2 KV heads.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# A window shorter than the matrix's longer prompts, so that keys fall out of it.
WINDOW = 24
# transformers keeps a partial rotary factor among the RoPE parameters.
FULL_ROTARY = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}


@dataclass(frozen=True)
class Architecture:
    name: str
    model_type: str
    features: tuple[str, ...]
    config: dict = field(default_factory=lambda: dict(TINY))
    refusal: str | None = None
    feature_off: dict[str, dict] = field(default_factory=dict)
    # Engine settings this case needs beyond the matrix's (tests/model_matrix.py).
    engine: dict = field(default_factory=dict)
    # Config values of the HF reference where vLLM's model code deliberately differs from transformers'.
    reference_config: dict = field(default_factory=dict)
    # Random weights of this scale: large enough that soft-capping and routing bind, not so large that
    # logits saturate.
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        assert set(self.feature_off) <= set(self.features), "feature_off names features of the case"


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Llama", "llama", ("RoPE", "GQA 2:1", "RMSNorm", "SwiGLU")),
    Architecture(
        "Mistral",
        "mistral",
        ("RoPE", "GQA 2:1", f"sliding window {WINDOW}"),
        config=TINY | dict(sliding_window=WINDOW),
        feature_off={f"sliding window {WINDOW}": dict(sliding_window=None)},
    ),
    Architecture(
        "Qwen2", "qwen2", ("QKV bias", "GQA 2:1", "tied embeddings"), TINY | dict(tie_word_embeddings=True)
    ),
    Architecture(
        "Qwen3",
        "qwen3",
        ("q/k RMSNorm", "head dim 32 != hidden/heads", "tied embeddings"),
        TINY | dict(head_dim=32, tie_word_embeddings=True),
    ),
    Architecture(
        "Gemma 2",
        "gemma2",
        (
            "attention logit soft-capping",
            "final logit soft-capping",
            f"sliding window {WINDOW} on alternate layers",
            "GeGLU",
            "query_pre_attn_scalar",
            "tied embeddings",
        ),
        TINY
        | dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        ),
        feature_off={
            "attention logit soft-capping": dict(attn_logit_softcapping=None),
            "final logit soft-capping": dict(final_logit_softcapping=None),
            # Longer than any prompt (HF needs a value).
            f"sliding window {WINDOW} on alternate layers": dict(sliding_window=256),
        },
        initializer_range=0.2,
    ),
    Architecture(
        "Gemma",
        "gemma",
        ("GeGLU", "embedding normalizer", "MQA"),
        TINY | dict(head_dim=16, num_key_value_heads=1),
    ),
    Architecture("Phi-3", "phi3", ("fused QKV and gate/up projections", "GQA 2:1"), TINY),
    Architecture(
        "Granite",
        "granite",
        ("embedding, residual, attention and logit multipliers",),
        TINY
        | dict(
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0625,
            logits_scaling=8.0,
        ),
        feature_off={
            "embedding, residual, attention and logit multipliers": dict(
                embedding_multiplier=1.0,
                residual_multiplier=1.0,
                attention_multiplier=0.25,
                logits_scaling=1.0,
            )
        },
    ),
    Architecture(
        "GPT-2",
        "gpt2",
        ("learned positions", "LayerNorm", "GELU", "biases", "MHA", "tied embeddings"),
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    ),
    Architecture(
        "OPT",
        "opt",
        ("learned positions (offset 2)", "LayerNorm", "ReLU", "biases", "MHA", "tied embeddings"),
        dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
        ),
    ),
    Architecture(
        "StableLM",
        "stablelm",
        ("partial rotary 1/4", "LayerNorm", "QKV bias"),
        TINY | dict(partial_rotary_factor=0.25, use_qkv_bias=True),
        feature_off={"partial rotary 1/4": dict(rope_parameters=FULL_ROTARY)},
    ),
    Architecture(
        "GPT-J",
        "gptj",
        ("rotary on 8 of 16 dims, interleaved", "parallel attention and MLP"),
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=8),
        feature_off={"rotary on 8 of 16 dims, interleaved": dict(rotary_dim=16)},
    ),
    Architecture(
        "Falcon",
        "falcon",
        ("multi-query attention", "parallel attention and MLP"),
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=True,
            parallel_attn=True,
            alibi=False,
            bias=False,
            new_decoder_architecture=False,
        ),
    ),
    Architecture(
        "Cohere",
        "cohere",
        ("parallel block", "LayerNorm", "logit scale"),
        TINY | dict(logit_scale=0.5, tie_word_embeddings=True),
        feature_off={"logit scale": dict(logit_scale=1.0)},
    ),
    Architecture(
        "Nemotron",
        "nemotron",
        ("partial rotary 1/2", "squared ReLU", "LayerNorm1p"),
        TINY | dict(partial_rotary_factor=0.5, head_dim=16),
        feature_off={"partial rotary 1/2": dict(rope_parameters=FULL_ROTARY)},
    ),
    Architecture(
        "GLM-4",
        "glm4",
        ("partial rotary 1/2", "post-attention and post-MLP norms", "QKV bias"),
        TINY | dict(head_dim=16, attention_bias=True),
    ),
    Architecture(
        "Gemma 3",
        "gemma3_text",
        (
            f"sliding window {WINDOW} on 1 layer in 2",
            "local and global RoPE bases",
            "q/k RMSNorm",
            "tied embeddings",
        ),
        TINY
        | dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=True,
        ),
        feature_off={f"sliding window {WINDOW} on 1 layer in 2": dict(sliding_window=256)},
        initializer_range=0.2,
    ),
    Architecture(
        "Cohere 2",
        "cohere2",
        (f"sliding window {WINDOW} on 1 layer in 2", "global layers without RoPE", "parallel block"),
        TINY
        | dict(
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            logit_scale=0.5,
            tie_word_embeddings=True,
        ),
        feature_off={f"sliding window {WINDOW} on 1 layer in 2": dict(sliding_window=256)},
        initializer_range=0.2,
        # vLLM's Cohere 2 code (commandr.py) widens the window by one, the model's training convention.
        reference_config=dict(sliding_window=WINDOW + 1),
    ),
    Architecture(
        "EXAONE 4",
        "exaone4",
        (f"sliding window {WINDOW} on 1 layer in 2", "q/k RMSNorm", "post-norms"),
        TINY | dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
        feature_off={f"sliding window {WINDOW} on 1 layer in 2": dict(sliding_window=256)},
        initializer_range=0.2,
    ),
    Architecture("ERNIE 4.5", "ernie4_5", ("RoPE interleaved", "GQA 2:1"), TINY | dict(head_dim=16)),
    Architecture("Apertus", "apertus", ("xIELU activation", "q/k RMSNorm"), TINY),
    Architecture(
        "Llama 4",
        "llama4_text",
        ("chunked local attention", "MoE with a shared expert"),
        TINY | dict(attention_chunk_size=16, num_local_experts=2, head_dim=16, intermediate_size_mlp=128),
        refusal="chunked local attention",
    ),
    Architecture(
        "gpt-oss",
        "gpt_oss",
        ("attention sinks", f"sliding window {WINDOW} on 1 layer in 2", "MoE"),
        TINY | dict(num_local_experts=4, head_dim=16, sliding_window=WINDOW),
        refusal="attention sinks",
    ),
    Architecture(
        "Qwen3-Next",
        "qwen3_next",
        ("gated delta-net linear attention", "MoE"),
        TINY | dict(num_experts=4, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2),
        refusal="state-space",
    ),
    Architecture(
        "MiniCPM3",
        "minicpm3",
        ("low-rank (MLA-style) query and KV projections, run as per-head attention",),
        TINY
        | dict(
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
    ),
    Architecture("Ministral 3", "ministral3", ("RoPE", "GQA 2:1"), TINY | dict(head_dim=16)),
    Architecture(
        "Granite SWA",
        "granite_swa",
        (f"sliding window {WINDOW}", "attention sinks"),
        TINY | dict(sliding_window=WINDOW),
        refusal="attention sinks",
    ),
    Architecture(
        "Falcon-H1",
        "falcon_h1",
        ("hybrid attention and Mamba-2",),
        TINY | dict(head_dim=16),
        refusal="state-space",
    ),
    Architecture(
        "Mamba-2",
        "mamba2",
        ("state-space layers",),
        dict(hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, n_groups=1, state_size=8),
        refusal="state-space",
    ),
    Architecture(
        "Nemotron-H",
        "nemotron_h",
        ("hybrid attention and Mamba-2",),
        TINY | dict(hybrid_override_pattern="M*", head_dim=16),
        refusal="state-space",
    ),
    Architecture("LFM2", "lfm2", ("short convolutions and attention",), TINY, refusal="state-space"),
    Architecture(
        "DeepSeek-V3",
        "deepseek_v3",
        ("MLA", "MoE"),
        TINY
        | dict(
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
        ),
        refusal="MLA",
    ),
    Architecture("Kimi Linear", "kimi_linear", ("KDA linear attention", "MLA"), TINY, refusal="state-space"),
    Architecture(
        "Mixtral",
        "mixtral",
        ("MoE: 4 experts, top-2 routing", "GQA 2:1"),
        TINY | dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        feature_off={"MoE: 4 experts, top-2 routing": dict(num_experts_per_tok=1)},
        initializer_range=0.1,
    ),
    Architecture(
        "Qwen2-MoE",
        "qwen2_moe",
        ("MoE: 4 experts, top-2 routing", "shared expert with sigmoid gate", "QKV bias"),
        TINY
        | dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            norm_topk_prob=False,
        ),
        feature_off={"MoE: 4 experts, top-2 routing": dict(num_experts_per_tok=1)},
        initializer_range=0.1,
    ),
    Architecture(
        "Qwen3-MoE",
        "qwen3_moe",
        ("MoE: 4 experts, top-2 routing, normalised", "q/k RMSNorm"),
        TINY
        | dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
        feature_off={"MoE: 4 experts, top-2 routing, normalised": dict(num_experts_per_tok=1)},
        initializer_range=0.1,
    ),
    Architecture(
        "OLMoE",
        "olmoe",
        ("MoE: 4 experts, top-2 routing", "q/k RMSNorm"),
        TINY | dict(num_experts=4, num_experts_per_tok=2),
        feature_off={"MoE: 4 experts, top-2 routing": dict(num_experts_per_tok=1)},
        initializer_range=0.1,
    ),
    Architecture(
        "Granite-MoE",
        "granitemoe",
        ("MoE: 4 experts, top-2 routing", "multipliers"),
        TINY
        | dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0, logits_scaling=8.0),
        feature_off={"MoE: 4 experts, top-2 routing": dict(num_experts_per_tok=1)},
        initializer_range=0.1,
    ),
    Architecture(
        "ERNIE 4.5 MoE",
        "ernie4_5_moe",
        ("MoE with expert-bias top-k routing", "shared expert"),
        TINY
        | dict(
            head_dim=16,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=1,
            moe_layer_start_index=0,
        ),
        initializer_range=0.1,
        refusal="routing is not supported",
    ),
    Architecture(
        "GLM-4-MoE",
        "glm4_moe",
        ("MoE with grouped sigmoid top-k routing",),
        TINY
        | dict(
            head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        initializer_range=0.1,
        refusal="routing is not supported",
    ),
    Architecture(
        "DeepSeek-V2",
        "deepseek_v2",
        ("MLA",),
        TINY
        | dict(
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
        ),
        refusal="MLA",
    ),
    Architecture(
        "Mamba",
        "mamba",
        ("state-space layers",),
        dict(hidden_size=64, num_hidden_layers=2, state_size=8),
        refusal="state-space",
    ),
    Architecture(
        "Jamba",
        "jamba",
        ("hybrid attention and Mamba layers", "MoE"),
        TINY
        | dict(
            num_experts=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            mamba_d_state=8,
            mamba_dt_rank=8,
        ),
        refusal="state-space",
    ),
    Architecture("BLOOM", "bloom", ("ALiBi",), dict(hidden_size=64, n_layer=2, n_head=4), refusal="ALiBi"),
    Architecture(
        "T5",
        "t5",
        ("encoder-decoder",),
        dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16),
        refusal="encoder-decoder",
        # vLLM turns chunked prefill off for encoder-decoder models: a step must hold max_model_len tokens
        # before its config reaches the platform.
        engine=dict(max_num_batched_tokens=128),
    ),
)


def build(arch: Architecture, out: Path, seed: int = 0) -> Path:
    """Save the case's tokenizer, config and float32 random weights to out."""
    tokenizer = build_tokenizer(out)
    config = AutoConfig.for_model(
        arch.model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=arch.initializer_range,
        torch_dtype="float32",
        **arch.config,
    )
    torch.manual_seed(seed)
    auto_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = auto_class.from_config(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out
