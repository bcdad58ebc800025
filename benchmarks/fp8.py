"""FP8 against bfloat16 on the default model (SmolLM2-135M-Instruct) in CPU mode, one run, side by side:
bf16, FP8 weights (`--quantization fp8`), and FP8 weights with an FP8 KV cache (`--kv-cache-dtype fp8`).

    .venv/bin/python benchmarks/fp8.py [--positions 256] [--threads N]

For each configuration, an engine in a child process (the plugin, CPU mode, eager backend) reports:
- teacher-forced next-token predictions over held-out text (docs/performance.md, tokenized; not in any
  calibration, since FP8 here has none): each prefix of the text's first `--positions` + 64 tokens asks for
  one greedy token with its top 20 logprobs. Against bf16: the share of positions whose greedy token agrees,
  and the mean and max |logprob difference| of bf16's token (where it is in the other's top 20);
- KV tokens per GiB, from the engine's own cache tensors;
- output tokens/s: 8 prompts of 128 random token ids, 128 greedy tokens each, in one batch after a warm-up.
Prints a markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "bf16": {},
    "FP8 weights": {"quantization": "fp8"},
    "FP8 weights + FP8 KV": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
CONTEXT_TOKENS = 64  # the first prediction sees this much text
TOP = 20  # the graph's logprobs cap
ENGINE = {
    "dtype": "bfloat16",
    "max_model_len": 1024,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "seed": 0,
    # Few graphs (eager backend): every prefix is one prefill call, decode batches up to 8.
    "additional_config": {
        "prefill_buckets": [128, 512],
        "decode_batch_buckets": [1, 8],
        "context_buckets": [512, 1024],
    },
}
ENVIRONMENT = {
    "VLLM_NEURON_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def child(request: dict) -> dict:
    """One engine: predictions over the text's prefixes, KV tokens per GiB, and output tokens/s."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=request["model"], **ENGINE, **request["engine"])
    text = request["text"]
    prefixes = [TokensPrompt(prompt_token_ids=text[:end]) for end in range(CONTEXT_TOKENS, len(text))]
    scored = llm.generate(prefixes, SamplingParams(max_tokens=1, temperature=0, logprobs=TOP), use_tqdm=False)
    predictions = []
    for output in scored:
        [step] = output.outputs[0].logprobs
        predictions.append({str(token): entry.logprob for token, entry in step.items()})
    greedy = [output.outputs[0].token_ids[0] for output in scored]
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    cache = runner.kv_cache.tensors  # per layer: [2 x KV heads, blocks, block size, head size]
    bytes_per_token = sum(t.numel() * t.element_size() for t in cache) / (
        cache[0].shape[1] * cache[0].shape[2]
    )
    rng = random.Random(0)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(100, 49152) for _ in range(128)]) for _ in range(8)
    ]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(output.outputs[0].token_ids) for output in outputs)
    return {
        "greedy": greedy,
        "predictions": predictions,
        "kv_tokens_per_gib": 2**30 / bytes_per_token,
        "kv_dtype": str(cache[0].dtype),
        "tokens_per_s": produced / seconds,
    }


def run_child(model: str, engine: dict, text: list[int], threads: int | None) -> dict:
    env = {**os.environ, **ENVIRONMENT, "PYTHONPATH": str(ROOT)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    request = json.dumps({"model": model, "engine": engine, "text": text})
    done = subprocess.run(
        [sys.executable, __file__, "--child", request], env=env, capture_output=True, text=True, timeout=3600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:  # (a child that printed its result may still abort at exit, in torch's thread teardown)
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no result"}
    return json.loads(lines[-1].removeprefix("RESULT "))


def held_out_text(model: str, positions: int) -> list[int]:
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(model)((ROOT / "docs" / "performance.md").read_text())["input_ids"]
    return tokens[: CONTEXT_TOKENS + positions]


def against(reference: dict, other: dict) -> tuple[float, float, float, int]:
    """Greedy agreement, mean and max |logprob difference| of the reference's token, and the positions where
    that token left the other's top 20."""
    agree = sum(a == b for a, b in zip(reference["greedy"], other["greedy"], strict=True)) / len(
        other["greedy"]
    )
    differences, missing = [], 0
    for token, mine, theirs in zip(
        reference["greedy"], reference["predictions"], other["predictions"], strict=True
    ):
        if str(token) in theirs:
            differences.append(abs(mine[str(token)] - theirs[str(token)]))
        else:
            missing += 1
    return agree, sum(differences) / len(differences), max(differences), missing


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="OMP threads of each engine")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    sys.path.insert(0, str(ROOT))
    from server.default_model import ensure_default_model

    model = str(ensure_default_model())
    text = held_out_text(model, args.positions)
    results = {name: run_child(model, engine, text, args.threads) for name, engine in CONFIGS.items()}
    base = results["bf16"]
    print(f"\n{args.positions} positions of held-out text (docs/performance.md), SmolLM2-135M-Instruct\n")
    print(
        "| configuration | greedy agreement with bf16 | mean / max abs logprob diff | KV cache "
        "| KV tokens / GiB | output tok/s |"
    )
    print("|---|---|---|---|---|---|")
    for name, result in results.items():
        if "error" in result:
            print(f"| {name} | refused or failed: {result['error']} | | | | |")
            continue
        agree, mean, most, missing = against(base, result)
        left = f" ({missing} outside the top {TOP})" if missing else ""
        kv_dtype = result["kv_dtype"].removeprefix("torch.")
        print(
            f"| {name} | {agree:.1%}{left} | {mean:.4f} / {most:.4f} | {kv_dtype} | "
            f"{result['kv_tokens_per_gib']:,.0f} | {result['tokens_per_s']:.1f} "
            f"({result['tokens_per_s'] / base['tokens_per_s']:.2f}x) |"
        )


if __name__ == "__main__":
    main()
