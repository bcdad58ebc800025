"""A tiny random-weight Llama and byte-level BPE tokenizer with a ChatML template, built offline."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, my name is Neuron and I run on Trainium.",
    "vLLM is a fast and easy-to-use library for LLM inference and serving.",
    "Once upon a time there was a tiny language model that lived in a test folder.",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "user assistant system: you are a helpful assistant.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
] * 50


def build_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of about 500 tokens with a ChatML template, trained offline, into out."""
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|eos|>", "<|im_start|>"],
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(out)
    return hf_tokenizer


def build_tiny_llama(
    out: Path, *, num_kv_heads: int = 2, max_positions: int = 1024, seed: int = 0, num_layers: int = 2
) -> Path:
    """num_layers layers, hidden 128, 4 query heads of 32 (GQA over num_kv_heads), ~500-token vocabulary,
    float32."""
    hf_tokenizer = build_tokenizer(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(hf_tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=hf_tokenizer.bos_token_id,
        eos_token_id=hf_tokenizer.eos_token_id,
        pad_token_id=hf_tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = hf_tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    return out
