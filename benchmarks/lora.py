"""Multi-LoRA serving in CPU mode (issue 39): output tokens/s at concurrency 8 with 0, 1 and 4 adapters in the
mix, on a server with `--enable-lora --max-loras 4 --max-lora-rank 16`, against the base model alone (LoRA
off), in one run, side by side.

    .venv/bin/python benchmarks/lora.py [--model smollm2|tiny] [--requests-per-client N] [--threads N]

Four adapters of rank 16 on every projection (q, k, v, o, gate, up, down) are built offline with peft (random
nonzero A and B: tests/helpers.py build_adapter). Two servers, one after the other, with the same buckets:
the base alone, then the LoRA server with the four adapters on its command line. Traffic: 8 clients, prompts
of 128 random token ids, 64 output tokens, greedy, EOS ignored. Mixes on the LoRA server: every request names
the base ("0 adapters"), every request names a0 ("1 adapter"), requests round-robin over a0..a3 ("4
adapters"); one untimed request per adapter first, so loading an adapter is not timed. Also prints each
server's unexpected recompiles (should be 0) and the LoRA server's `/v1/neuron/info` "lora" section. Prints
figures; asserts nothing.
"""

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching import run_clients  # noqa: E402
from serving import ROOT, Config, Server, get  # noqa: E402

BASE = "m"  # the served base name: serving.Server passes --served-model-name m
ADAPTERS = ("a0", "a1", "a2", "a3")
RANK, ALPHA = 16, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS, MAX_MODEL_LEN = 8, 128, 64, 256
# One small bucket plan for both servers (warm-up in seconds, not minutes): every prompt is one 128-token
# prefill, every decode call at most 8 rows, every context within 256 tokens.
BUCKETS = {"prefill_buckets": [128], "decode_batch_buckets": [1, 8], "context_buckets": [MAX_MODEL_LEN]}
MIXES = {"0 (base only)": (BASE,), "1 (a0)": ADAPTERS[:1], "4 (a0..a3 round-robin)": ADAPTERS}


def load_model(name: str) -> tuple[str, int, list[str]]:
    """(model directory, vocabulary bound for prompt ids, extra serve arguments)."""
    if name == "smollm2":
        from server.default_model import ensure_default_model

        return str(ensure_default_model()), 49000, []
    from tests.tiny_model import build_tiny_llama

    target = Path(tempfile.gettempdir()) / "vllm-neuron-bench-tiny-llama"
    if not (target / "config.json").exists():
        build_tiny_llama(target)
    return str(target), 400, ["--dtype", "float32"]


def build_adapters(model: str, folder: Path) -> dict[str, Path]:
    from tests.helpers import build_adapter

    paths = {name: folder / name for name in ADAPTERS}
    for seed, path in enumerate(paths.values()):
        build_adapter(Path(model), path, RANK, ALPHA, TARGETS, seed=100 + seed)
    return paths


def jobs_for(models: tuple[str, ...], count: int, rng: random.Random, vocab: int) -> list[tuple]:
    """`count` requests with fresh random prompts (the prefix cache never hits), models round-robin."""
    return [
        ([rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)], OUTPUT_TOKENS, models[i % len(models)])
        for i in range(count)
    ]


def serve(
    config: Config, workdir: Path, warm: tuple[str, ...], mixes: dict, vocab: int, requests: int
) -> dict:
    """Start the server, warm it untimed (one short request per model name), run each mix, stop it."""
    server = Server(config, str(workdir / "cache"), workdir / f"{config.name}.log")
    rows, rng = {}, random.Random(0)
    try:
        print(f"{config.name}: healthy after {server.wait_healthy():.1f} s", flush=True)
        # 8 tokens each: enough to load every adapter into its slot before the timed mixes.
        warm_jobs = [
            (prompt, 8, name) for prompt, _, name in jobs_for(warm, len(warm), random.Random(1), vocab)
        ]
        run_clients(server.base, warm_jobs, 1)
        for label, models in mixes.items():
            rows[label] = run_clients(server.base, jobs_for(models, requests, rng, vocab), CONCURRENCY)
            print(json.dumps({"server": config.name, "mix": label, **rows[label]}), flush=True)
        recompiles = server.metrics().get("vllm_neuron:unexpected_recompiles_total")
        lora = json.loads(get(server.base + "/v1/neuron/info")[1] or "{}").get("lora")
    finally:
        server.stop()
    return {"rows": rows, "recompiles": recompiles, "lora": lora}


def main() -> None:
    from vllm_neuron import host_cpu

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument(
        "--threads",
        type=int,
        help="OpenMP threads of each server's model process (default: every core); 1 where another job "
        "shares a 2-core machine",
    )
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(ROOT))
    model, vocab, extra = load_model(args.model)
    workdir = Path(tempfile.mkdtemp(prefix="vllm-neuron-lora-"))
    adapters = build_adapters(model, workdir / "adapters")
    print(f"adapters (rank {RANK}, {len(TARGETS)} projections) in {workdir / 'adapters'}", flush=True)
    common = [*extra, "--max-num-seqs", str(CONCURRENCY), "--additional-config", json.dumps(BUCKETS)]
    lora_args = ["--enable-lora", "--max-loras", str(len(ADAPTERS)), "--max-lora-rank", str(RANK)]
    lora_args += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    requests = args.requests_per_client * CONCURRENCY
    base = serve(
        Config("base-alone", model, common, MAX_MODEL_LEN),
        workdir,
        (BASE,),
        {"- (LoRA off)": (BASE,)},
        vocab,
        requests,
    )
    lora = serve(
        Config("lora", model, [*common, *lora_args], MAX_MODEL_LEN),
        workdir,
        (BASE, *ADAPTERS),
        MIXES,
        vocab,
        requests,
    )
    reference = base["rows"]["- (LoRA off)"]["output_tok_s"]
    print(
        f"\n{args.model}, concurrency {CONCURRENCY}, prompts {PROMPT_TOKENS} tokens, outputs {OUTPUT_TOKENS}"
    )
    print("\n| server | adapters in the mix | requests | output tok/s | ratio to base alone |")
    print("|---|---|---|---|---|")
    for name, result in (("base alone", base), ("LoRA on, 4 slots of rank 16", lora)):
        for label, row in result["rows"].items():
            print(
                f"| {name} | {label} | {row['requests']} | {row['output_tok_s']:.1f} | "
                f"{row['output_tok_s'] / reference:.2f} |"
            )
    threads = f"OMP_NUM_THREADS={args.threads}" if args.threads else "default OpenMP threads"
    print(f"\n{host_cpu.summary()}; {threads} per server")
    steal = {
        f"{r}/{label}": round(row["cpu_steal_pct"])
        for r, res in (("base", base), ("lora", lora))
        for label, row in res["rows"].items()
    }
    print(f"CPU steal % per level: {steal}")
    print(f"unexpected recompiles: base alone {base['recompiles']}, LoRA {lora['recompiles']}")
    print(f"LoRA server /v1/neuron/info lora: {json.dumps(lora['lora'])}")
    print(f"logs in {workdir}")


if __name__ == "__main__":
    main()
