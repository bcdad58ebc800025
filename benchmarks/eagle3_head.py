"""Trains an EAGLE3 head for the default model (SmolLM2-135M-Instruct) on the model's own greedy outputs, on
the CPU (22 minutes on a 2-core host under load, most of it making the data), and writes it where vLLM's
`Eagle3LlamaForCausalLM` loads it from: config.json and model.safetensors (bfloat16), without embed_tokens
and lm_head, so that vLLM shares the target's.

The recipe, every seed fixed:
- prompts: chat-template questions and instructions, then requests to repeat or edit the model's own
  answers (the copy workload of benchmarks/speculative.py, on other texts), and raw random token ids
  (its random workload);
- data: the target's greedy continuations in bfloat16 (a plain loop with a KV cache), then one forward over
  prompt + output for the hidden states entering the aux layers (vLLM's default 2, n/2, n - 3) and the
  target's greedy token at every position;
- the head (HeadModel below) mirrors llama_eagle3.py: at position i it reads the token at i + 1 and
  fc(aux states at i), and learns the target's token at i + 2 (cross-entropy); `--steps` unrolls vLLM's
  draft chain (pass s reads pass s - 1's greedy token and pre-norm state, and attends to the first pass's
  keys before its chain and to the chain's own), the target's embedding and lm_head frozen.

Prints the train and held-out top-1 accuracy of each draft position (alone, and the chain's: every draft
before it right too). Reuses the head where the directory holds one made with the same recipe.

    .venv/bin/python benchmarks/eagle3_head.py [--out DIR] [--epochs 4] [--steps 2] [--force]
"""

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_DIR = Path.home() / ".cache" / "vllm-neuron" / "eagle3-smollm2"
RECIPE_VERSION = 1
SEED = 0
TOPICS = [
    *("the moon", "photosynthesis", "a bicycle", "the ocean", "volcanoes", "the human heart", "rainbows"),
    *("coffee", "honey bees", "the internet", "a library", "chess", "the Roman empire", "electricity"),
    *("clouds", "a computer", "bread", "trees", "gravity", "the piano", "sleep", "recycling", "dinosaurs"),
    *("the sun", "a train", "mathematics", "friendship", "the desert", "penguins", "a city park", "email"),
    *("vaccines", "the alphabet", "soccer", "a kitchen", "glaciers", "money", "the weather", "music", "maps"),
]
QUESTIONS = (
    "What is {t}?",
    "Explain {t} in simple words.",
    "Write a short poem about {t}.",
    "Give me three facts about {t}.",
    "Write a short story about {t}.",
    "Why is {t} important?",
    "Describe {t} to a child.",
    "List some questions people ask about {t}.",
)
ASKS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Fix any spelling mistakes in the following text and return the whole text:\n\n{text}",
    "Rewrite the following text, changing nothing but replacing every 'the' with 'THE':\n\n{text}",
    "Copy this text and put it in quotes:\n\n{text}",
)


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def greedy(model, prompts: list[list[int]], new: int, eos: int | None, pad: int, batch: int = 16) -> list:
    """Each prompt's greedy continuation of `new` tokens (cut after `eos` where given), batched with left
    padding and a KV cache."""
    outputs = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        tokens = [out.logits[:, -1].argmax(-1)]
        for _ in range(new - 1):
            mask = torch.cat([mask, torch.ones(len(chunk), 1, dtype=mask.dtype)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=tokens[-1][:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            tokens.append(out.logits[:, -1].argmax(-1))
        for row in torch.stack(tokens, dim=1).tolist():
            if eos is not None and eos in row:
                row = row[: row.index(eos) + 1]
            outputs.append(row)
    return outputs


@torch.inference_mode()
def features(model, sequences: list[tuple[list[int], list[int]]], aux_ids: list[int]) -> list[dict]:
    """One forward over each prompt + output: the tokens, the hidden states entering the aux layers
    (concatenated, bfloat16), the target's greedy token at each position, and where the output starts."""
    rows = []
    for prompt, output in sequences:
        ids = torch.tensor([prompt + output])
        out = model(input_ids=ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in aux_ids], dim=-1).to(torch.bfloat16)
        rows.append({"ids": ids[0], "aux": aux, "greedy": out.logits[0].argmax(-1), "prompt": len(prompt)})
    return rows


def build_data(model, tokenizer, aux_ids: list[int], args) -> list[dict]:
    rng = random.Random(SEED)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    questions = [q.format(t=t) for t in TOPICS for q in QUESTIONS]
    rng.shuffle(questions)
    questions = questions[: args.questions]
    started = time.monotonic()
    q_prompts = [chat_ids(tokenizer, q) for q in questions]
    q_outputs = greedy(model, q_prompts, args.new_tokens, eos, pad)
    # Requests to repeat or edit the model's own answers (without their end-of-text).
    answers = [tokenizer.decode([t for t in out if t != eos]).strip() for out in q_outputs]
    answers = [a for a in answers if len(a) > 80][: args.copies]
    copy_prompts = [chat_ids(tokenizer, rng.choice(ASKS).format(text=a)) for a in answers]
    copy_outputs = greedy(model, copy_prompts, args.new_tokens + 32, eos, pad)
    # Random token ids (the load generator's random workload: ids 100..40000, no chat template), ignore_eos.
    r_prompts = [[rng.randrange(100, 40000) for _ in range(args.random_len)] for _ in range(args.randoms)]
    r_outputs = greedy(model, r_prompts, args.new_tokens, None, pad)
    print(
        f"generated {len(q_prompts) + len(copy_prompts) + len(r_prompts)} continuations in "
        f"{time.monotonic() - started:.0f} s",
        flush=True,
    )
    sequences = list(
        zip(q_prompts + copy_prompts + r_prompts, q_outputs + copy_outputs + r_outputs, strict=True)
    )
    return features(model, sequences, aux_ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's and HF's RMSNorm: in float32, back to the input's dtype, times the weight."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE (vLLM's Llama and HF's rotate_half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class HeadModel(torch.nn.Module):
    """llama_eagle3.py's one-layer head (LlamaModel.forward with one LlamaDecoderLayer, layer_idx 0, norm
    after residual), over sequences, with the caller's attention mask and extra keys for the draft chain."""

    def __init__(self, config: dict, n_aux: int) -> None:
        super().__init__()
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or hidden // self.heads
        self.eps = config["rms_norm_eps"]

        def linear(i: int, o: int) -> torch.nn.Linear:
            return torch.nn.Linear(i, o, bias=False)

        self.fc = linear(n_aux * hidden, hidden)
        self.q_proj = linear(2 * hidden, self.heads * self.head_dim)
        self.k_proj = linear(2 * hidden, self.kv_heads * self.head_dim)
        self.v_proj = linear(2 * hidden, self.kv_heads * self.head_dim)
        self.o_proj = linear(self.heads * self.head_dim, hidden)
        self.gate_proj, self.up_proj = linear(hidden, inter), linear(hidden, inter)
        self.down_proj = linear(inter, hidden)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
            setattr(self, name, torch.nn.Parameter(torch.ones(hidden)))

    def qkv(self, embeds, hidden, cos, sin):
        """The layer's input (its residual: `hidden`), queries, keys and values [B, heads, T, D]."""
        x = torch.cat(
            [rms_norm(embeds, self.input_layernorm, self.eps), rms_norm(hidden, self.hidden_norm, self.eps)],
            -1,
        )
        b, t = x.shape[:2]
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def rest(self, hidden, q, keys, values, mask):
        """Attention over `keys`/`values` under `mask` [T, S], post-attention norm with the residual, MLP,
        then (final norm's output, pre-norm state)."""
        groups = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        attn = self.o_proj(attn.transpose(1, 2).flatten(2))
        residual = attn + hidden
        x = rms_norm(residual, self.post_attention_layernorm, self.eps)
        x = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        prenorm = x + residual
        return rms_norm(prenorm, self.norm, self.eps), prenorm


def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos()[None, None], angles.sin()[None, None]


def chain_masks(t: int, steps: int) -> list[torch.Tensor]:
    """Pass s's (0-based) mask over the keys of passes 0..s: at index j, pass 0's keys up to j - s (the
    cache the first pass wrote from the target's states) and pass r's key at j - (s - r), r = 1..s."""
    j = torch.arange(t)
    masks = []
    for s in range(steps):
        parts = [j[None, :] <= (j[:, None] - s)]
        parts += [j[None, :] == (j[:, None] - (s - r)) for r in range(1, s + 1)]
        masks.append(torch.cat(parts, dim=1))
    return masks


def shifted(mask: torch.Tensor, s: int) -> torch.Tensor:
    """`mask` moved s positions on: True at j where mask is at j - s."""
    return F.pad(mask[:, : mask.shape[1] - s], (s, 0)) if s else mask


def run_chain(head, batch, embed, lm_head, theta, steps):
    """The head's passes over a batch: each pass's logits at its positions, their labels, and the positions
    [B, T] (pass s at j: a chain that starts at j - s, both where a draft is proposed)."""
    ids, aux, labels, loss_mask = batch
    t = ids.shape[1]
    cos, sin = rope(torch.arange(t), head.head_dim, theta)
    masks = chain_masks(t, steps)
    tokens, hidden = ids, head.fc(aux)
    keys, values, outputs = [], [], []
    for s in range(steps):
        q, k, v = head.qkv(embed[tokens], hidden, cos, sin)
        keys.append(k)
        values.append(v)
        out, prenorm = head.rest(hidden, q, torch.cat(keys, 2), torch.cat(values, 2), masks[s])
        valid = loss_mask & shifted(loss_mask, s)
        logits = out[valid] @ lm_head.T
        outputs.append((logits, labels[valid], valid))
        if s + 1 < steps:
            # The next pass at index j reads this pass's greedy token and pre-norm state at j - 1.
            greedy = torch.zeros_like(ids)
            greedy[valid] = logits.detach().argmax(-1)
            tokens = F.pad(greedy[:, :-1], (1, 0))
            hidden = F.pad(prenorm[:, :-1], (0, 0, 1, 0))
    return outputs


def make_batch(rows: list[dict]):
    """Head position i of a sequence: the token at i + 1, the aux states at i, the target's greedy token
    after i + 1; the loss where a draft is proposed (the input token is the first output token or later)."""
    t = max(len(r["ids"]) - 1 for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    aux = torch.zeros(len(rows), t, rows[0]["aux"].shape[-1], dtype=torch.bfloat16)
    labels = torch.zeros(len(rows), t, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for n, r in enumerate(rows):
        length = len(r["ids"]) - 1
        ids[n, :length] = r["ids"][1:]
        aux[n, :length] = r["aux"][:-1]
        labels[n, :length] = r["greedy"][1:]
        loss_mask[n, r["prompt"] - 1 : length] = True
    return ids, aux.float(), labels, loss_mask


def batches(rows: list[dict], size: int, rng: random.Random | None):
    order = list(range(len(rows)))
    if rng is not None:
        rng.shuffle(order)
    return [make_batch([rows[i] for i in order[k : k + size]]) for k in range(0, len(order), size)]


@torch.no_grad()
def accuracy(head, data, embed, lm_head, theta, steps) -> list[tuple[float, float]]:
    """Per draft position: top-1 alone (given the head's own drafts before it), and the chain's (this draft
    and every one before it right: the share of chains that get this far)."""
    right, seen, chained = [0] * steps, [0] * steps, [0] * steps
    starts = 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in data:
            loss_mask = batch[3]
            starts += int(loss_mask.sum())
            chain = loss_mask.clone()
            for s, (logits, labels, valid) in enumerate(run_chain(head, batch, embed, lm_head, theta, steps)):
                correct = torch.zeros_like(loss_mask)
                correct[valid] = logits.argmax(-1) == labels
                right[s] += int(correct.sum())
                seen[s] += int(valid.sum())
                # chain[j]: the chain from j right so far; pass s's draft of it sits at j + s.
                chain = chain & F.pad(correct[:, s:], (0, s))
                chained[s] += int(chain.sum())
    return [(right[s] / max(seen[s], 1), chained[s] / max(starts, 1)) for s in range(steps)]


def train(head, train_data, held_out, embed, lm_head, theta, args) -> None:
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(train_data)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: min(1.0, (n + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(n, total) / total))
    )
    rng = random.Random(SEED)
    started = time.monotonic()
    for epoch in range(args.epochs):
        rng.shuffle(train_data)
        losses = []
        for batch in train_data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs = run_chain(head, batch, embed, lm_head, theta, args.steps)
            loss = sum(
                0.8**s * F.cross_entropy(logits.float(), labels)
                for s, (logits, labels, _) in enumerate(outputs)
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
        held = accuracy(head, held_out, embed, lm_head, theta, args.steps)
        print(
            f"epoch {epoch + 1}: loss {sum(losses) / len(losses):.3f}, held-out top-1 "
            + ", ".join(f"{alone:.1%}" for alone, _ in held)
            + f" ({time.monotonic() - started:.0f} s)",
            flush=True,
        )


def save(head: HeadModel, out: Path, config: dict, aux_ids: list[int], meta: dict) -> None:
    hidden = config["hidden_size"]
    head_config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": config["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": head.head_dim,
        "vocab_size": config["vocab_size"],
        "draft_vocab_size": config["vocab_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": rope_theta(config),
        "rope_parameters": {"rope_theta": rope_theta(config), "rope_type": "default"},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids},
    }
    layer = "midlayer."
    names = {"fc": "fc.weight", "norm": "norm.weight"}
    names |= {p: f"{layer}self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    names |= {p: f"{layer}mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    names |= {p: f"{layer}{p}.weight" for p in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    state = {name: p.detach() for name, p in head.named_parameters()}
    weights = {
        names[key.removesuffix(".weight")]: value.to(torch.bfloat16).contiguous()
        for key, value in state.items()
    }
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(head_config, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def rope_theta(config: dict) -> float:
    return float((config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta", 10000.0))


DATA_KEYS = ("questions", "copies", "randoms", "random_len", "new_tokens")


def recipe(args, keys=(*DATA_KEYS, "epochs", "steps", "lr", "batch")) -> dict:
    return {"version": RECIPE_VERSION, "seed": SEED} | {k: getattr(args, k) for k in keys}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--model", help="the target (default: the default model)")
    parser.add_argument("--questions", type=int, default=240, help="chat questions and instructions")
    parser.add_argument("--copies", type=int, default=64, help="requests to repeat or edit an answer")
    parser.add_argument("--randoms", type=int, default=64, help="random token-id prompts")
    parser.add_argument("--random-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="draft passes unrolled in training")
    parser.add_argument("--eval-steps", type=int, default=3, help="draft positions measured")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=8, help="sequences a training step")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier where other work shares the cores)"
    )
    parser.add_argument("--force", action="store_true", help="train again where a head is present")
    return parser.parse_args(argv)


def ensure_head(argv: list[str] | None = None) -> Path:
    """The head directory: reused where it holds a head of the same recipe, else trained (about 20 minutes
    on 2 loaded cores)."""
    args = parse(argv)
    meta_path = args.out / "training.json"
    present = meta_path.exists() and (args.out / "model.safetensors").exists()
    if not args.force and present and json.loads(meta_path.read_text()).get("recipe") == recipe(args):
        print(f"EAGLE3 head: reusing {args.out}", flush=True)
        return args.out
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model is None:
        from server.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    started = time.monotonic()
    config = json.loads((Path(args.model) / "config.json").read_text())
    layers = config["num_hidden_layers"]
    aux_ids = [2, layers // 2, layers - 3]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    # The data (the slow part) is kept beside the head, for training again with other settings.
    data_path, data_key = args.out / "data.pt", recipe(args, DATA_KEYS)
    cached = torch.load(data_path, weights_only=False) if data_path.exists() else {}
    if cached.get("recipe") == data_key:
        rows = cached["rows"]
    else:
        rows = build_data(model, tokenizer, aux_ids, args)
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"recipe": data_key, "rows": rows}, data_path)
    data_s = time.monotonic() - started
    embed = model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    lm_head = model.get_output_embeddings().weight.detach().to(torch.bfloat16)
    final_norm = model.model.norm.weight.detach().float()
    del model
    rng = random.Random(SEED)
    rng.shuffle(rows)
    n_held = max(1, len(rows) // 10)
    held_rows, train_rows = rows[:n_held], rows[n_held:]
    print(
        f"{len(train_rows)} training sequences, {len(held_rows)} held out, "
        f"{sum(int(r['ids'].shape[0] - r['prompt']) for r in rows)} output tokens; data in {data_s:.0f} s",
        flush=True,
    )
    head = HeadModel(config, len(aux_ids))
    with torch.no_grad():
        head.norm.copy_(final_norm)
    theta = rope_theta(config)
    train_data = batches(train_rows, args.batch, rng)
    held_out = batches(held_rows, args.batch, None)
    train_started = time.monotonic()
    train(head, train_data, held_out, embed, lm_head, theta, args)
    train_s = time.monotonic() - train_started
    measured = {
        name: accuracy(head, data, embed, lm_head, theta, args.eval_steps)
        for name, data in (("train", train_data), ("held_out", held_out))
    }
    for name, per_pos in measured.items():
        print(
            f"{name} top-1 by draft position (alone / chain): "
            + ", ".join(f"{k + 1}: {a:.1%} / {c:.1%}" for k, (a, c) in enumerate(per_pos)),
            flush=True,
        )
    meta = {
        "recipe": recipe(args),
        "model": args.model,
        "aux_layer_ids": aux_ids,
        "data_s": round(data_s),
        "train_s": round(train_s),
        "accuracy": measured,
        "sequences": len(rows),
    }
    save(head, args.out, config, aux_ids, meta)
    print(f"EAGLE3 head written to {args.out} ({time.monotonic() - started:.0f} s in all)", flush=True)
    return args.out


if __name__ == "__main__":
    ensure_head()
