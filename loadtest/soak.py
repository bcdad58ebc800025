"""`vllm-neuron soak`: hours of mixed traffic against a running server, and its resources over time.

A mixed workload keeps the server at its capacity: streaming and non-streaming chat and completions, short
and long prompts, n > 1, clients that leave mid-stream, and bursts far above capacity (past the admission
bound those get 429: counted, not errors). Every `--sample-every` seconds it reads the server's /metrics:
resident memory, open files and threads of the API and engine processes (vllm_neuron:process_*), KV cache
usage and unexpected recompiles. It starts once every graph is compiled (vllm_neuron:graphs_pending 0:
under staged readiness the rest compile in the background, and their memory is not a leak). At the end it
lets the server go idle, sends one last request and checks:
- no 5xx and no transport error;
- no growth after the warm-up share of the run (`--settle`): resident memory within 10% + 64 MiB of the
  first sample after it, open files within +16, threads within +8;
- every KV block free (vllm:kv_cache_usage_perc 0), no unexpected recompile.
Exits 1 if a check fails. Works against any deployment of ours (the process series are the plugin's).

    vllm-neuron soak --base-url http://127.0.0.1:8000 --minutes 30 --json-out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.metrics import parse_prometheus

PROCESS_SERIES = {
    "rss": "vllm_neuron:process_resident_memory_bytes",
    "fds": "vllm_neuron:process_open_fds",
    "threads": "vllm_neuron:process_threads",
}
# Allowed growth from the first sample after the warm-up share to the last one.
RSS_GROWTH = (0.10, 64 * 2**20)  # relative, plus absolute bytes
FDS_GROWTH = 16
THREADS_GROWTH = 8
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wise",
    "owls",
    "count",
    "stars",
]


@dataclass
class Outcomes:
    counts: Counter = field(default_factory=Counter)  # ok, cancelled, 429, 4xx, 5xx, transport
    examples: list[str] = field(default_factory=list)  # the first failures of each kind

    def add(self, outcome: str, detail: str = "") -> None:
        self.counts[outcome] += 1
        if outcome in ("4xx", "5xx", "transport") and self.counts[outcome] <= 5:
            self.examples.append(f"{outcome}: {detail[:300]}")


def sample(text: str) -> dict[str, float]:
    """The soak's signals from one /metrics scrape: process series by process, and the server's gauges."""
    samples = parse_prometheus(text)
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        for short, series in PROCESS_SERIES.items():
            if name == series:
                out[f"{short}_{dict(labels).get('process', '?')}"] = value
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm_neuron:compiled_graphs",
        "vllm_neuron:graphs_pending",
        "vllm_neuron:unexpected_recompiles_total",
        "vllm:admission_rejections_total",
    ):
        out[name] = sum(value for (series, _), value in samples.items() if series == name)
    return out


def growth_failures(samples: list[dict], settle: float) -> list[str]:
    """Process series that grew past their allowance after the warm-up share of the run."""
    if len(samples) < 2:
        return ["fewer than two samples of /metrics"]
    start = next((s for s in samples if s["t"] >= settle), samples[-1])
    end = samples[-1]
    failures = []
    for key in sorted(k for k in end if k.startswith(("rss_", "fds_", "threads_"))):
        if key not in start:
            continue
        before, after = start[key], end[key]
        if key.startswith("rss_"):
            allowed = before * (1 + RSS_GROWTH[0]) + RSS_GROWTH[1]
        else:
            allowed = before + (FDS_GROWTH if key.startswith("fds_") else THREADS_GROWTH)
        if after > allowed:
            failures.append(f"{key} grew from {before:,.0f} to {after:,.0f} (allowed {allowed:,.0f})")
    return failures


class Soak:
    def __init__(self, args: argparse.Namespace, model: str, max_model_len: int) -> None:
        self.args = args
        self.model = model
        self.long_words = max(16, max_model_len // 8)  # words of a long prompt: well within the context
        self.outcomes = Outcomes()
        self.rng = random.Random(args.seed)
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def body(self) -> tuple[str, dict, bool]:
        rng = self.rng
        words = (
            rng.randint(3, 30) if rng.random() < 0.7 else rng.randint(self.long_words // 2, self.long_words)
        )
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        stream = rng.random() < 0.6
        body = {"model": self.model, "max_tokens": rng.randint(4, self.args.max_tokens), "stream": stream}
        body |= {"temperature": rng.choice([0.0, 0.8]), "ignore_eos": rng.random() < 0.5}
        if body["temperature"] > 0 and rng.random() < 0.3:
            body["n"] = 2  # (greedy takes n = 1 only)
        if rng.random() < 0.5:
            return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": text}]}, stream
        return "/v1/completions", body | {"prompt": text}, stream

    async def one(self, client: httpx.AsyncClient) -> None:
        path, body, stream = self.body()
        leave_after = self.rng.randint(1, 4) if stream and self.rng.random() < 0.15 else None
        try:
            async with client.stream("POST", path, json=body, headers=self.headers) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    status = response.status_code
                    outcome = "429" if status == 429 else "5xx" if status >= 500 else "4xx"
                    self.outcomes.add(outcome, f"{status} {path} {text}")
                    if status == 429:  # wait as asked, as OpenAI's clients do
                        await asyncio.sleep(min(float(response.headers.get("retry-after", 1)), 5.0))
                    return
                chunks = 0
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    if '"error"' in line:
                        self.outcomes.add("5xx", f"error event in a stream: {line}")
                        return
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        self.outcomes.add("cancelled")
                        return  # leaving the block closes the connection mid-stream
                self.outcomes.add("ok")
        except httpx.HTTPError as error:
            self.outcomes.add("transport", f"{type(error).__name__}: {error}")

    async def clients(self, client: httpx.AsyncClient, count: int, until: float) -> None:
        async def loop() -> None:
            while time.monotonic() < until:
                await self.one(client)

        await asyncio.gather(*(loop() for _ in range(count)))

    async def run(self) -> dict:
        args = self.args
        limits = httpx.Limits(max_connections=args.concurrency + args.burst + 8)
        samples: list[dict] = []
        start = time.monotonic()
        end = start + args.minutes * 60
        async with httpx.AsyncClient(base_url=args.base_url, timeout=600, limits=limits) as client:

            async def scrape() -> None:
                response = await client.get("/metrics")
                samples.append({"t": time.monotonic() - start, **sample(response.text)})

            async def sampler() -> None:
                while time.monotonic() < end:
                    await scrape()
                    await asyncio.sleep(args.sample_every)

            async def bursts() -> None:
                while time.monotonic() + args.burst_every < end:
                    await asyncio.sleep(args.burst_every)
                    # A burst far above capacity, all at once: past the admission bound it gets 429.
                    await asyncio.gather(*(self.one(client) for _ in range(args.burst)))

            await asyncio.gather(sampler(), bursts(), self.clients(client, args.concurrency, end))
            # Idle, then one last request, so the gauges are those of an idle server.
            for _ in range(120):
                await scrape()
                last = samples[-1]
                if last["vllm:num_requests_running"] == 0 and last["vllm:num_requests_waiting"] == 0:
                    break
                await asyncio.sleep(1)
            final = await client.post(
                "/v1/completions",
                json={"model": self.model, "prompt": "the end", "max_tokens": 2},
                headers=self.headers,
            )
            self.outcomes.add("ok" if final.status_code == 200 else "5xx", f"final request: {final.text}")
            await asyncio.sleep(1)
            await scrape()
        return self.report(samples)

    def report(self, samples: list[dict]) -> dict:
        counts = self.outcomes.counts
        first, last = samples[0], samples[-1]
        failures = [f"{counts[kind]} {kind}" for kind in ("5xx", "transport", "4xx") if counts[kind]]
        failures += growth_failures(samples, self.args.settle * self.args.minutes * 60)
        if last["vllm:kv_cache_usage_perc"] > 0:
            failures.append(f"KV cache {100 * last['vllm:kv_cache_usage_perc']:.1f}% used once idle")
        recompiles = (
            last["vllm_neuron:unexpected_recompiles_total"] - first["vllm_neuron:unexpected_recompiles_total"]
        )
        if recompiles:
            failures.append(f"{recompiles:.0f} unexpected recompiles")
        return {
            "minutes": self.args.minutes,
            "requests": dict(counts),
            "samples": samples,
            "failures": failures,
            "examples": self.outcomes.examples,
        }


def at(samples: list[dict], seconds: float) -> dict:
    return next((s for s in samples if s["t"] >= seconds), samples[-1])


def summary(result: dict) -> str:
    samples = result["samples"]
    points = [("start", samples[0]), ("5 min", at(samples, 300)), ("end", samples[-1])]
    keys = sorted(k for k in samples[-1] if k.startswith(("rss_", "fds_", "threads_")))
    lines = ["| when | t (s) | " + " | ".join(keys) + " | KV used | graphs |", "|---" * (len(keys) + 4) + "|"]
    for name, s in points:
        values = [
            "-" if k not in s else f"{s[k] / 2**20:,.0f} MiB" if k.startswith("rss_") else f"{s[k]:.0f}"
            for k in keys
        ]
        kv = f"{100 * s['vllm:kv_cache_usage_perc']:.1f}%"
        lines.append(
            f"| {name} | {s['t']:.0f} | "
            + " | ".join(values)
            + f" | {kv} | {s['vllm_neuron:compiled_graphs']:.0f} |"
        )
    lines.append("")
    lines.append("requests: " + ", ".join(f"{k} {v}" for k, v in sorted(result["requests"].items())))
    lines.append(
        "result: " + ("PASS" if not result["failures"] else "FAIL: " + "; ".join(result["failures"]))
    )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-neuron soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--api-key", help="the server's --api-key, if it has one")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, help="steady clients (default: the server's max_num_seqs)")
    p.add_argument(
        "--burst",
        type=int,
        help="requests in a burst (default: twice the server's admission bound, so that some get 429)",
    )
    p.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between /metrics samples")
    p.add_argument("--settle", type=float, default=0.2, help="share of the run before growth is judged")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--graphs-timeout", type=float, default=7200.0, help="seconds to wait for every graph")
    return p


def wait_for_graphs(base_url: str, timeout: float) -> None:
    """Until the server has compiled every graph of its plan (its background compiles are done)."""
    deadline = time.monotonic() + timeout
    while (
        pending := sample(httpx.get(base_url + "/metrics", timeout=30).text)["vllm_neuron:graphs_pending"]
    ) > 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"{pending:.0f} graphs still compiling after {timeout:.0f} s")
        print(f"waiting for {pending:.0f} graphs to compile before the soak starts", flush=True)
        time.sleep(10)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    models = httpx.get(args.base_url + "/v1/models", headers=headers, timeout=30).json()["data"]
    model, max_model_len = models[0]["id"], models[0].get("max_model_len") or 2048
    info = httpx.get(args.base_url + "/v1/neuron/info", headers=headers, timeout=30)
    served = info.json() if info.status_code == 200 else {}
    if args.concurrency is None:
        args.concurrency = served.get("max_num_seqs", 8)
    if args.burst is None:
        # Past the bound whatever the steady clients are doing: a burst of the bound alone, arriving between
        # two steady requests, would be admitted whole (and a fast server empties its queue between bursts).
        # A server that does not say its bound gets bursts of twice the steady clients.
        args.burst = 2 * (served.get("admission", {}).get("max_requests_in_flight") or args.concurrency)
    wait_for_graphs(args.base_url, args.graphs_timeout)
    result = asyncio.run(Soak(args, model, max_model_len).run())
    print(summary(result))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    sys.exit(1 if result["failures"] else 0)
