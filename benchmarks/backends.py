"""The plugin's CPU-mode compile backends side by side, one run, one machine: `eager` (the FX graph as
dynamo traced it), `stablehlo` (TorchNeuron's route to StableHLO, then the functional FX graph runs) and
`xla` (the same StableHLO compiled and run by XLA's CPU compiler, the KV caches in place), each serving
SmolLM2-135M-Instruct with benchmarks/compare.py's workload (128 random prompt tokens, 128 output tokens,
concurrency 1, 8 and 32) and one small bucket plan (BUCKETS).

    .venv/bin/python benchmarks/backends.py [--dtype bfloat16] [--requests 4,16,64] [--json-out FILE]
    .venv/bin/python benchmarks/backends.py --agreement-only --backends stablehlo,xla

Prints output tokens/s per backend and concurrency with the ratios to `eager`, time to healthy, per graph the
lowering and XLA compile seconds (from /v1/neuron/info), and how far each backend's greedy tokens agree with
`stablehlo`'s on the same prompts (8 prompts of 64 random token ids, 32 tokens each, asked before the load).
Asserts nothing: in bfloat16 a different but valid order of additions can round a near-tie the other way.
--agreement-only asks the agreement prompts and skips the load (xla in bfloat16 is slow: docs/lowering.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare import CONCURRENCY, QUIET_ENV, TOKEN_IDS, machine, serve_and_load, wait_quiet  # noqa: E402
from serving import Config, Server, get  # noqa: E402

BACKENDS = ("eager", "stablehlo", "xla")
# One bucket plan for all three, small enough that lowering and XLA compiling the 30-layer model's graphs
# take minutes, not an hour: prompt 128 + output 128 tokens fit one context bucket.
MAX_LEN = 256
BUCKETS = {"prefill_buckets": [128], "decode_batch_buckets": [1, 8, 32], "context_buckets": [MAX_LEN]}
AGREEMENT_PROMPTS, AGREEMENT_PROMPT_TOKENS, AGREEMENT_TOKENS = 8, 64, 32


def probe(server: Server) -> dict:
    """The server's lowered graphs, and its greedy tokens for the agreement prompts."""
    picks = random.Random(1)
    prompts = [
        [picks.randrange(*TOKEN_IDS) for _ in range(AGREEMENT_PROMPT_TOKENS)]
        for _ in range(AGREEMENT_PROMPTS)
    ]
    tokens = []
    for prompt in prompts:
        body = {"model": "m", "prompt": prompt, "max_tokens": AGREEMENT_TOKENS, "temperature": 0}
        body |= {"ignore_eos": True, "return_token_ids": True}
        request = urllib.request.Request(
            server.base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            tokens.append(json.loads(response.read())["choices"][0]["token_ids"])
    graphs = json.loads(get(server.base + "/v1/neuron/info")[1])["lowered_graphs"]
    return {"lowered_graphs": graphs, "greedy_tokens": tokens}


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """Prompts whose tokens all equal the reference's, and the mean share of tokens before the first
    difference."""
    same, shares = 0, []
    for got, expected in zip(tokens, reference, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), len(got))
        same += first == len(got)
        shares.append(first / len(got))
    return same, statistics.mean(shares)


def run_backend(backend: str, model: str, dtype: str, requests: list[int] | None, workdir: Path) -> dict:
    """The backend's load figures at each concurrency (none where requests is None) and its probe."""
    print(f"{backend} ...", flush=True)
    serve_args = ["--dtype", dtype, "--additional-config", json.dumps(BUCKETS)]
    config = Config(backend, model, serve_args, MAX_LEN, backend=backend)
    wait_quiet()
    server = Server(config, str(workdir / f"cache-{backend}"), workdir / f"{backend}.log")
    if requests is not None:
        return serve_and_load(server, requests, workdir / f"{backend}.json", probe)
    try:
        healthy_s = server.wait_healthy(limit_s=1800)
        return {"levels": [], "healthy_s": healthy_s, "info": probe(server)}
    finally:
        server.stop()


def markdown(results: dict[str, dict]) -> str:
    rate = {
        backend: {lv["concurrency"]: lv["output_tokens_per_s"] for lv in doc["levels"]}
        for backend, doc in results.items()
    }
    heads = " | ".join(f"c={k}" for k in CONCURRENCY)
    lines = [f"| output tok/s | {heads} | healthy s |", "|---|" + "---|" * (len(CONCURRENCY) + 1)]
    for backend, doc in results.items():
        values = " | ".join(f"{rate[backend][k]:.1f}" if k in rate[backend] else "-" for k in CONCURRENCY)
        lines.append(f"| {backend} | {values} | {doc['healthy_s']:.0f} |")
    if "eager" in rate and all(rate.values()):
        lines += ["", f"| ratio to eager | {heads} |", "|---|" + "---|" * len(CONCURRENCY)]
        for backend in rate:
            ratios = " | ".join(f"{rate[backend][k] / rate['eager'][k]:.2f}" for k in CONCURRENCY)
            lines.append(f"| {backend} | {ratios} |")
    lines += ["", "| per graph, seconds | graphs | lowering median / max | XLA compile median / max |"]
    lines.append("|---|---|---|---|")
    for backend, doc in results.items():
        graphs = doc["info"]["lowered_graphs"]
        if not graphs:
            continue
        lowering = [graph["lowering_seconds"] for graph in graphs]
        compiled = [graph["xla_compile_seconds"] for graph in graphs if "xla_compile_seconds" in graph]
        xla_cell = f"{statistics.median(compiled):.1f} / {max(compiled):.1f}" if compiled else "-"
        lines.append(
            f"| {backend} | {len(graphs)} | {statistics.median(lowering):.1f} / {max(lowering):.1f} | "
            f"{xla_cell} |"
        )
    if "stablehlo" in results:
        reference = results["stablehlo"]["info"]["greedy_tokens"]
        lines += [
            "",
            "| greedy tokens against stablehlo's | prompts all equal | tokens before the first difference |",
        ]
        lines.append("|---|---|---|")
        for backend, doc in results.items():
            same, share = agreement(doc["info"]["greedy_tokens"], reference)
            lines.append(f"| {backend} | {same} of {len(reference)} | {share:.0%} |")
    return "\n".join(lines)


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", default="4,16,64", help="measured requests at concurrency 1,8,32")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--agreement-only", action="store_true", help="the probe, no load")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    os.environ.pop("VLLM_NEURON_DEVICE", None)  # the CLI chooses CPU mode by itself where no device exists
    from server.default_model import ensure_default_model

    model = str(ensure_default_model())
    requests = None if args.agreement_only else [int(n) for n in args.requests.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="vllm-neuron-backends-"))
    print(json.dumps(machine()), flush=True)
    results = {
        backend: run_backend(backend, model, args.dtype, requests, workdir)
        for backend in args.backends.split(",")
    }
    print("\n" + markdown(results))
    print(f"\nlogs and reports in {workdir}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"machine": machine(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
