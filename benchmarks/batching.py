"""Continuous batching under load, over HTTP, in CPU mode: output tokens/s, TTFT and ITL percentiles at
concurrency 1, 8 and 32 with mixed lengths, and the ITL of running streams while prompts of max_model_len
arrive, as a ratio to their ITL without them.

    .venv/bin/python benchmarks/batching.py [--model smollm2|tiny] [--requests-per-client N]

Targets (issue 4): output tokens/s at concurrency 32 >= 6 x concurrency 1; ITL p99 with long prompts
arriving <= 3 x ITL p50 without them. Prints figures; asserts nothing.
"""

import argparse
import json
import math
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import ROOT, Config, Server  # noqa: E402

# The auto policy's 21 prefill and decode graphs for this traffic in CPU mode, plus the 9 mixed calls of its
# light-load decode batches (1, 8, 16) at its three decode context buckets (384, 512, 2048).
GRAPH_BUDGET = 30


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))
    return ordered[index]


def stream_one(
    client, prompt: list[int], max_tokens: int, on_first_token=None, model: str = "m", extra_body=None
) -> dict:
    """One streamed completion of `model` (the served base name, or a LoRA adapter's): time to first token
    and the gaps between chunks that carry tokens.

    A chunk is counted by its token ids, not its text: a token that ends inside a multi-byte character has
    no text of its own (its chunk comes with empty text), and counting text alone made one gap of two steps.
    """
    start = time.monotonic()
    arrivals = []
    tokens = 0
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True, **(extra_body or {})},
    )
    for chunk in stream:
        if chunk.choices and getattr(chunk.choices[0], "token_ids", None):
            arrivals.append(time.monotonic())
            if len(arrivals) == 1 and on_first_token is not None:
                on_first_token()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {
        "ttft": arrivals[0] - start if arrivals else float("nan"),
        "itl": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
        "tokens": tokens,
    }


def cpu_ticks() -> tuple[int, int]:
    """(stolen, total) CPU ticks of this machine so far: on a shared virtual machine the hypervisor's steal
    stalls every step at once, and a few such stalls decide a p99."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields)


def run_clients(base: str, jobs: list[tuple], concurrency: int, on_first_token=None) -> dict:
    """`concurrency` clients in a closed loop; each job is (prompt, max_tokens) or (prompt, max_tokens,
    model)."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1800)
    pending, results, lock = list(jobs), [], threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                prompt, max_tokens, *model = pending.pop(0)
            result = stream_one(client, prompt, max_tokens, on_first_token, *model)
            with lock:
                results.append(result)

    start, (stolen, total) = time.monotonic(), cpu_ticks()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - start
    stolen_after, total_after = cpu_ticks()
    ttft = [r["ttft"] for r in results]
    itl = [gap for r in results for gap in r["itl"]]
    return {
        "requests": len(results),
        "output_tok_s": sum(r["tokens"] for r in results) / seconds,
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * percentile(itl, 0.5),
        "itl_p99_ms": 1e3 * percentile(itl, 0.99),
        "seconds": seconds,
        "cpu_steal_pct": 100 * (stolen_after - stolen) / max(1, total_after - total),
    }


def mixed_jobs(rng: random.Random, count: int, max_model_len: int, vocab: int) -> list[tuple[list[int], int]]:
    jobs = []
    for _ in range(count):
        output = rng.randint(64, 128)
        length = int(math.exp(rng.uniform(math.log(16), math.log(min(1024, max_model_len - output)))))
        jobs.append(([rng.randrange(100, vocab) for _ in range(length)], output))
    return jobs


def long_prompt_interference(base: str, max_model_len: int, vocab: int) -> dict:
    """ITL of 4 running streams alone, then while prompts of max_model_len - 16 tokens keep arriving: the
    first once every stream has its first token (the streams are running), each next one when the one
    before has finished."""
    from openai import OpenAI

    rng = random.Random(1)
    streams = [([rng.randrange(100, vocab) for _ in range(32)], 160) for _ in range(4)]
    alone = run_clients(base, streams, 4)
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1800)
    running, stop = threading.Semaphore(0), threading.Event()
    sent = []

    def long_prompts() -> None:
        for _ in streams:
            running.acquire()
        while not stop.is_set():
            prompt = [rng.randrange(100, vocab) for _ in range(max_model_len - 16)]
            client.completions.create(model="m", prompt=prompt, max_tokens=1)
            sent.append(1)

    thread = threading.Thread(target=long_prompts)
    thread.start()
    with_long = run_clients(base, streams, 4, on_first_token=running.release)
    stop.set()
    thread.join()
    return {
        "itl_p50_alone_ms": alone["itl_p50_ms"],
        "itl_p99_with_long_prompts_ms": with_long["itl_p99_ms"],
        "itl_p50_with_long_prompts_ms": with_long["itl_p50_ms"],
        "long_prompts_sent": len(sent),
        "ratio_p99_with_over_p50_alone": with_long["itl_p99_ms"] / alone["itl_p50_ms"],
        "cpu_steal_pct_alone": alone["cpu_steal_pct"],
        "cpu_steal_pct_with_long_prompts": with_long["cpu_steal_pct"],
    }


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    # Enough requests per client that the run measures steady state, not the ramp at the start and the tail.
    parser.add_argument("--requests-per-client", type=int, default=4)
    args = parser.parse_args()
    if args.model == "smollm2":
        from server.default_model import ensure_default_model

        model, max_model_len, vocab, extra = str(ensure_default_model()), 2048, 49000, []
    else:
        sys.path.insert(0, str(ROOT))
        from tests.tiny_model import build_tiny_llama

        target = Path(tempfile.gettempdir()) / "vllm-neuron-bench-tiny-llama"
        if not (target / "config.json").exists():
            build_tiny_llama(target)
        model, max_model_len, vocab, extra = str(target), 256, 400, ["--dtype", "float32"]
    traffic = {"prompt_len": [16, 1024], "output_len": [64, 128], "concurrency": 32}
    serve_args = [
        *extra,
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "512",
        "--additional-config",
        json.dumps({"bucket_policy": "auto", "graph_budget": GRAPH_BUDGET, "traffic": traffic}),
    ]
    workdir = Path(tempfile.mkdtemp(prefix="vllm-neuron-batching-"))
    trace = workdir / "steps.jsonl"
    server = Server(
        # The step trace lets a slow gap be matched to the server's steps afterwards.
        Config(args.model, model, serve_args, max_model_len, env={"VLLM_NEURON_STEP_TRACE": str(trace)}),
        str(workdir / "cache"),
        workdir / "server.log",
    )
    try:
        print(f"healthy after {server.wait_healthy():.1f} s", flush=True)
        # Untimed: the first requests after start-up pay one-off costs (lazy set-up in the server and the
        # engine) that would otherwise land on concurrency 1, the denominator of the throughput ratio.
        run_clients(server.base, mixed_jobs(random.Random(2), 2, max_model_len, vocab), 1)
        rng = random.Random(0)
        levels = {}
        for concurrency in (1, 8, 32):
            # Concurrency 1 gets twice the requests: its few long requests make a noisy denominator.
            requests = args.requests_per_client * (2 if concurrency == 1 else concurrency)
            jobs = mixed_jobs(rng, requests, max_model_len, vocab)
            levels[concurrency] = run_clients(server.base, jobs, concurrency)
            print(json.dumps({"concurrency": concurrency, **levels[concurrency]}), flush=True)
        interference = long_prompt_interference(server.base, max_model_len, vocab)
        print(json.dumps(interference), flush=True)
        recompiles = server.metrics().get("vllm_neuron:unexpected_recompiles_total")
    finally:
        server.stop()
    print("\n| concurrency | requests | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | CPU steal |")
    print("|---|---|---|---|---|---|")
    for concurrency, row in levels.items():
        print(
            f"| {concurrency} | {row['requests']} | {row['output_tok_s']:.1f} | {row['ttft_p50_ms']:.0f} / "
            f"{row['ttft_p99_ms']:.0f} | {row['itl_p50_ms']:.1f} / {row['itl_p99_ms']:.1f} | "
            f"{row['cpu_steal_pct']:.0f}% |"
        )
    print(
        f"\nthroughput c=32 / c=1: {levels[32]['output_tok_s'] / levels[1]['output_tok_s']:.2f} (target >= 6)"
    )
    print(
        "ITL p99 with long prompts / ITL p50 without: "
        f"{interference['ratio_p99_with_over_p50_alone']:.2f} (target <= 3; CPU steal "
        f"{interference['cpu_steal_pct_alone']:.0f}% alone, "
        f"{interference['cpu_steal_pct_with_long_prompts']:.0f}% with long prompts)"
    )
    print(f"unexpected recompiles: {recompiles}; logs in {workdir}")


if __name__ == "__main__":
    main()
