"""Speculative decoding (n-gram prompt lookup, a draft model or an EAGLE3 head) against plain decoding, in one
run: the default model in CPU mode, `vllm-neuron serve` once without and once with `--speculative-config`,
each driven by the load generator at concurrency 1, 4 and 16 (eagle3: 1, 2 and 8; `--concurrency`) on these
workloads:

- copy: chat requests that ask the model to repeat or lightly edit a text given in the prompt (prose and
  code), where n-gram lookup finds what comes next in the prompt;
- random: docs/benchmarks.md's workload, 128 random prompt token ids and 128 output tokens (ignore_eos),
  greedy. A small model's greedy continuation of noise falls into loops, which lookup then predicts;
- random-sampled: the same at temperature 1, where the output is noise too and lookup rarely finds a draft
  that holds: the cost of speculating for little.

`--method draft_model` takes as draft the default model's first `--draft-layers` layers with its final norm
and head (an early-exit draft, built once into the work directory): no second model is at hand offline.
`--method eagle3` takes the head benchmarks/eagle3_head.py trains on the default model's own greedy outputs
(about 20 minutes on 2 loaded cores, once: reused from ~/.cache/vllm-neuron/eagle3-smollm2), or `--head DIR`;
both servers then run with `--additional-config '{"fresh_prefill_buckets": []}'` (an EAGLE3 head needs it),
like for like.

The greedy workloads give the same tokens on both servers. Prints one markdown table:
output tok/s, TPOT (mean time per output token after the first: the per-token latency a stream sees, where
one stream chunk may carry several tokens) and ITL p50 (gaps between stream chunks), and the acceptance of
draft tokens, side by side.

    .venv/bin/python benchmarks/speculative.py [--method ngram|draft_model|eagle3] [--draft-layers 6]
        [--head DIR] [--workloads copy,random,random-sampled] [--concurrency 1,4,16] [--requests 4,8,32]
        [--quiet-limit S] [--json-out FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.compare import QUIET_ENV, QUIET_LIMIT_S, machine, wait_quiet  # noqa: E402
from benchmarks.serving import Config, Server  # noqa: E402

CONCURRENCY = (1, 4, 16)
EAGLE3_CONCURRENCY = (1, 2, 8)
EAGLE3_REQUESTS = "4,8,16"
# An EAGLE3 head's first pass reads its cache, which fresh prefill calls do not write: off on both servers.
NO_FRESH_PREFILL = ["--additional-config", json.dumps({"fresh_prefill_buckets": []})]
WORKLOADS = ("copy", "random", "random-sampled")
MAX_MODEL_LEN = 1024
DRAFT_TOKENS = 3
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": DRAFT_TOKENS,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
SERVE_ARGS = ["--dtype", "bfloat16", "--max-num-seqs", "16"]

# Texts the copy workload asks the model to repeat or edit: prose and code, each a few sentences long.
TEXTS = [
    "The river rises in the northern hills and runs south for two hundred miles before it reaches the sea. "
    "Along its banks stand small towns, each with a market square, a stone bridge and a mill that once "
    "ground the grain of the valley. In spring the water runs high and fast; in late summer it slows, and "
    "children wade across the shallows near the old ford.",
    "To reset the device, hold the power button for ten seconds until the light turns amber. Release the "
    "button and wait for the light to turn green. If the light does not turn green within two minutes, "
    "unplug the device, wait thirty seconds, plug it back in and repeat the steps above.",
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += "
    "item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n",
    "Our meeting on Tuesday covered three topics. First, the team agreed to move the release to the end of "
    "the month. Second, the new test machines will arrive next week and will be set up by Friday. Third, "
    "everyone should review the design document before the next meeting and add comments directly to it.",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self, step=1):\n"
    "        self.count += step\n        return self.count\n\n    def reset(self):\n        self.count = 0\n",
    "Preheat the oven to two hundred degrees. Mix the flour, sugar and salt in a large bowl, then add the "
    "butter and rub it in until the mixture looks like breadcrumbs. Stir in the milk, shape the dough into "
    "a round, and bake it for twenty minutes until it is golden brown.",
]
ASKS = [
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Fix any spelling mistakes in the following text and return the whole text:\n\n{text}",
    "Rewrite the following text, changing nothing but replacing every 'the' with 'THE':\n\n{text}",
]


def copy_dataset(path: Path) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": ask.format(text=text)}], "max_tokens": 160}
        for text in TEXTS
        for ask in ASKS
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(
    server: Server, workload: str, concurrency: list[int], requests: list[int], dataset: Path, json_out: Path
) -> dict:
    from loadtest.cli import main as loadtest_main

    args = ["--base-url", server.base, "--model", "m", "--no-progress", "--json-out", str(json_out)]
    args += ["--concurrency", ",".join(map(str, concurrency)), "--requests", ",".join(map(str, requests))]
    args += ["--warmup", "2", "--seed", "0", "--temperature", "1" if workload == "random-sampled" else "0"]
    if workload == "copy":
        args += ["--endpoint", "chat", "--dataset", str(dataset)]
    else:
        args += ["--endpoint", "completions", "--prompt-kind", "token-ids", "--token-id-range", "100:40000"]
        args += ["--input-len", "128", "--output-len", "128", "--ignore-eos"]
    return loadtest_main(args)


def early_exit_draft(model: str, layers: int, out: Path) -> Path:
    """The model's first `layers` layers, its final norm and head: a draft with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (out / "config.json").exists():
        draft = AutoModelForCausalLM.from_pretrained(model, num_hidden_layers=layers, dtype="auto")
        draft.save_pretrained(out)
        AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


def eagle3_head(head: Path | None) -> Path:
    """`head` where it holds one, else benchmarks/eagle3_head.py's head for the default model, trained into
    `head` or its cache directory once (about 20 minutes on 2 loaded cores), then reused."""
    if head is not None and (head / "config.json").exists():
        return head
    out = head or Path.home() / ".cache" / "vllm-neuron" / "eagle3-smollm2"
    recipe = Path(__file__).resolve().parent / "eagle3_head.py"
    subprocess.run([sys.executable, str(recipe), "--out", str(out)], check=True)
    return out


def run_config(
    name: str,
    serve_args: list[str],
    model: str,
    concurrency: list[int],
    requests: list[int],
    workloads: list[str],
    workdir: Path,
) -> dict:
    wait_quiet()
    config = Config(name, model, serve_args, MAX_MODEL_LEN)
    server = Server(config, str(workdir / "compile-cache"), workdir / f"{name}.log")
    try:
        healthy_s = server.wait_healthy(limit_s=1800)
        print(f"{name}: healthy after {healthy_s:.0f} s", flush=True)
        dataset = copy_dataset(workdir / "copy.jsonl")
        return {
            workload: load(
                server, workload, concurrency, requests, dataset, workdir / f"{name}-{workload}.json"
            )
            for workload in workloads
        }
    finally:
        server.stop()


def markdown(result: dict, method: str, concurrency: list[int]) -> str:
    lines = [
        f"| workload | c | out tok/s plain | out tok/s {method} | ratio | TPOT ms plain | TPOT ms {method} "
        f"| ITL p50 ms plain | ITL p50 ms {method} | accepted | tokens a verify step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in result["plain"]:
        plain = {lv["concurrency"]: lv for lv in result["plain"][workload]["levels"]}
        ngram = {lv["concurrency"]: lv for lv in result[method][workload]["levels"]}
        for c in concurrency:
            a, b = plain[c], ngram[c]
            spec = (b.get("server") or {}).get("speculative") or {}
            rate, per_step = spec.get("acceptance_rate"), spec.get("tokens_per_verify_step")
            accepted = "-" if rate is None else f"{rate:.1%}"
            per_step = "-" if per_step is None else f"{per_step:.2f}"
            lines.append(
                f"| {workload} | {c} | {a['output_tokens_per_s']:.1f} | {b['output_tokens_per_s']:.1f} "
                f"| {b['output_tokens_per_s'] / a['output_tokens_per_s']:.2f} "
                f"| {a['tpot_ms']['mean']:.1f} | {b['tpot_ms']['mean']:.1f} "
                f"| {a['itl_ms']['p50']:.1f} | {b['itl_ms']['p50']:.1f} "
                f"| {accepted} | {per_step} |"
            )
    return "\n".join(lines)


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", choices=("ngram", "draft_model", "eagle3"), default="ngram")
    parser.add_argument(
        "--draft-layers", type=int, default=6, help="draft_model: the default model's first N"
    )
    parser.add_argument("--head", type=Path, help="eagle3: the head's directory (default: trained, cached)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--concurrency", help="levels (default 1,4,16; eagle3: 1,2,8)")
    parser.add_argument(
        "--requests", help=f"measured requests a level (default 4,8,32; eagle3: {EAGLE3_REQUESTS})"
    )
    parser.add_argument(
        "--quiet-limit", type=float, default=1800.0, help="seconds to wait at most for a quiet machine"
    )
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--workdir", type=Path, help="server logs and load reports (default: a temp dir)")
    args = parser.parse_args()
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    os.environ.pop("VLLM_NEURON_DEVICE", None)  # the CLI chooses CPU mode by itself where no device exists

    from server.default_model import ensure_default_model

    started = time.monotonic()
    model = str(ensure_default_model())
    eagle3 = args.method == "eagle3"
    levels = args.concurrency or ",".join(map(str, EAGLE3_CONCURRENCY if eagle3 else CONCURRENCY))
    concurrency = [int(n) for n in levels.split(",")]
    requests = [int(n) for n in (args.requests or (EAGLE3_REQUESTS if eagle3 else "4,8,32")).split(",")]
    QUIET_LIMIT_S[0] = args.quiet_limit
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-neuron-speculative-"))
    workdir.mkdir(parents=True, exist_ok=True)
    workloads = args.workloads.split(",")
    speculative = NGRAM
    if args.method == "draft_model":
        draft = early_exit_draft(model, args.draft_layers, workdir / f"draft-{args.draft_layers}-layers")
        speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": DRAFT_TOKENS}
    serve_args = SERVE_ARGS
    if eagle3:
        head = eagle3_head(args.head)
        speculative = {"method": "eagle3", "model": str(head), "num_speculative_tokens": DRAFT_TOKENS}
        serve_args = [*SERVE_ARGS, *NO_FRESH_PREFILL]
    result: dict = {"machine": machine(), "model": model, "speculative_config": speculative}
    result["serve_args"] = serve_args
    result["plain"] = run_config("plain", serve_args, model, concurrency, requests, workloads, workdir)
    spec_args = [*serve_args, "--speculative-config", json.dumps(speculative)]
    result[args.method] = run_config(args.method, spec_args, model, concurrency, requests, workloads, workdir)
    result["seconds"] = time.monotonic() - started
    print(markdown(result, args.method, concurrency))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
