"""`vllm-neuron loadtest` / `python -m loadtest`: drive an OpenAI-compatible endpoint with streamed requests
and report TTFT, ITL, end-to-end latency, throughput, errors, given a price the cost per million tokens and,
when the target is ours, the server's recompiles, padding efficiency and KV usage over the run.

examples:
  vllm-neuron loadtest --base-url http://127.0.0.1:8000 --concurrency 1,8,32 --requests 64 \\
      --input-len 128 --output-len 128 --ignore-eos --json-out run.json --plot-dir plots/
  vllm-neuron loadtest --rate 2 --duration 300 --input-len lognormal:200:0.8:1500 --output-len uniform:32:256
  vllm-neuron loadtest --dataset prompts.jsonl --endpoint completions --api-key "$KEY"
  vllm-neuron loadtest --concurrency 32 --instance trn2.48xlarge --chips 1      # TP=4 on 1 of 16 chips

lengths: N | fixed:N | uniform:LOW:HIGH | lognormal:MEDIAN:SIGMA[:MAX] (tokens)
dataset: JSONL, one request a line: {"prompt": "..." or [token ids]} or {"messages": [...]},
         optionally with "max_tokens"
cost:    $/M out and $/M in are what a level's measured window cost at the hourly charge, divided by its
         output tokens and by its input (prompt) tokens, per million: each divides the whole cost, they
         are not a split of it. Instance prices and their sources: docs/benchmarks.md#prices
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from loadtest import report
from loadtest.client import CHAT, COMPLETIONS, Target
from loadtest.metrics import neuron_info
from loadtest.runner import Level, LevelResult, run_level
from loadtest.workload import LengthDist, Workload
from vllm_neuron.planning.pricing import INSTANCES, instance_share


def _numbers(kind: type, text: str) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive(kind: type) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    return parse


def _id_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError("expected LOW:HIGH") from None
    if not 0 <= low < high:
        raise argparse.ArgumentTypeError("expected 0 <= LOW < HIGH")
    return low, high


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-neuron loadtest",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    target.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    target.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    target.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key (default $OPENAI_API_KEY)"
    )
    load = p.add_argument_group("load (each value of a list is one measured level: a sweep)")
    load.add_argument(
        "--concurrency",
        type=lambda t: _numbers(int, t),
        help="requests in flight, e.g. 1,8,32 (default 8); with --rate, the most in flight (default 256)",
    )
    load.add_argument("--rate", type=lambda t: _numbers(float, t), help="Poisson arrivals, requests/s")
    load.add_argument(
        "--requests",
        type=lambda t: _numbers(int, t),
        help="measured requests per level (default 100), or one number per level, e.g. 8,32,64",
    )
    load.add_argument("--duration", type=float, help="seconds per level: no request is sent after it")
    load.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each level")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    work = p.add_argument_group("workload")
    work.add_argument("--input-len", type=_length, default=LengthDist("fixed", 128), help="prompt tokens")
    work.add_argument("--output-len", type=_length, default=LengthDist("fixed", 128), help="max_tokens")
    work.add_argument("--dataset", type=Path, help="JSONL prompts instead of synthetic ones")
    work.add_argument(
        "--prompt-kind",
        choices=["text", "token-ids"],
        default="text",
        help="synthetic prompts as words (about one token each) or as random token ids (exact lengths; "
        "completions only)",
    )
    work.add_argument("--token-id-range", type=_id_range, default=(100, 1000), metavar="LOW:HIGH")
    work.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM's ignore_eos)"
    )
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--seed", type=int, default=0)
    cost = p.add_argument_group("cost (none given: no cost is reported)")
    cost.add_argument(
        "--price-per-hour",
        type=_positive(float),
        metavar="DOLLARS",
        help="$ per hour: of the whole instance with --instance (instead of its documented price), "
        "otherwise of what the server runs on",
    )
    cost.add_argument(
        "--instance",
        choices=sorted(INSTANCES),
        help="the instance the server runs on: its documented price and chip count",
    )
    cost.add_argument(
        "--chips",
        type=_positive(int),
        help="with --instance, the chips the server uses (default all): charged chips / the instance's "
        "chips of its price, e.g. 1 for TP=4 on a trn2.48xlarge",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json-out", type=Path, help="write the results as JSON")
    out.add_argument("--plot-dir", type=Path, help="write latency_cdf.png (and throughput.png for sweeps)")
    out.add_argument("--metrics-interval", type=float, default=2.0, help="seconds between /metrics scrapes")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def levels_from(args: argparse.Namespace) -> list[Level]:
    if args.rate:
        if args.concurrency and len(args.concurrency) > 1:
            raise SystemExit("with --rate, --concurrency is one number: the most requests in flight")
        cap = args.concurrency[0] if args.concurrency else 256
        shapes = [(cap, rate) for rate in args.rate]
    else:
        shapes = [(c, None) for c in (args.concurrency or [8])]
    requests = args.requests or [None if args.duration else 100]
    if len(requests) == 1:
        requests = requests * len(shapes)
    if len(requests) != len(shapes):
        raise SystemExit(f"--requests: give one number, or one per level ({len(shapes)})")
    return [
        Level(concurrency=c, rate=rate, requests=n, duration_s=args.duration, warmup=args.warmup)
        for (c, rate), n in zip(shapes, requests, strict=True)
    ]


def price_from(args: argparse.Namespace) -> dict | None:
    """The hourly charge of the run and how it was formed, or None without a price. ValueError for a
    combination the parser cannot refuse by itself."""
    if args.instance is None:
        if args.chips is not None:
            raise ValueError("--chips needs --instance: the chips are a share of an instance")
        return None if args.price_per_hour is None else {"dollars_per_hour": args.price_per_hour}
    instance = INSTANCES[args.instance]
    chips = args.chips or instance.chips
    try:
        share = instance_share(chips, instance.chips)
    except ValueError as err:
        raise ValueError(f"--chips: {err}") from None
    own_price = args.price_per_hour is not None
    instance_price = args.price_per_hour if own_price else instance.dollars_per_hour
    return {
        "dollars_per_hour": instance_price * share,
        "instance": instance.name,
        "chips": chips,
        "instance_chips": instance.chips,
        "instance_dollars_per_hour": instance_price,
        "basis": "--price-per-hour" if own_price else instance.basis,
        "source": None if own_price else instance.source,
        "read": None if own_price else instance.read,
    }


async def _discover_model(base_url: str, headers: dict[str, str]) -> str:
    async with httpx.AsyncClient() as client:
        response = await client.get(base_url + "/v1/models", headers=headers, timeout=30)
    if response.status_code != 200:
        raise SystemExit(f"GET /v1/models answered {response.status_code}; give --model (and --api-key?)")
    return response.json()["data"][0]["id"]


async def run(args: argparse.Namespace, price: dict | None = None) -> tuple[list[LevelResult], dict]:
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or await _discover_model(base_url, headers)
    target = Target(
        base_url=base_url,
        model=model,
        endpoint=CHAT if args.endpoint == "chat" else COMPLETIONS,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
    )
    workload = Workload(
        args.input_len,
        args.output_len,
        chat=args.endpoint == "chat",
        prompt_kind=args.prompt_kind,
        token_id_range=args.token_id_range,
        dataset=args.dataset,
        seed=args.seed,
    )
    async with httpx.AsyncClient() as client:
        info = await neuron_info(client, base_url, headers)
    results: list[LevelResult] = []
    first_index = 0
    for level in levels_from(args):
        result = await run_level(
            target,
            workload,
            level,
            first_index=first_index,
            seed=args.seed,
            timeout_s=args.timeout,
            metrics_interval_s=args.metrics_interval,
            progress=not args.no_progress,
            dollars_per_hour=price["dollars_per_hour"] if price else None,
        )
        results.append(result)
        first_index += level.warmup + len(result.records)
    config = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "endpoint": target.endpoint,
        "ignore_eos": target.ignore_eos,
        "temperature": target.temperature,
        "seed": args.seed,
        "requests_per_level": args.requests,
        "duration_s_per_level": args.duration,
        "warmup_per_level": args.warmup,
        "price": price,
        **workload.describe(),
    }
    target_doc = {"base_url": base_url, "model": model, "ours": info is not None, "neuron_info": info}
    return results, report.document(results, config, target_doc)


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    try:
        price = price_from(args)
    except ValueError as err:
        p.error(str(err))
    results, doc = asyncio.run(run(args, price))
    print(report.table(results))
    if price:
        print(report.price_line(price))
    if args.json_out:
        report.write_json(doc, args.json_out)
        print(f"JSON: {args.json_out}")
    if args.plot_dir:
        for path in report.write_plots(results, args.plot_dir):
            print(f"plot: {path}")
    failed = sum(r.summary["failed"] for r in results)
    if failed and not any(r.summary["completed"] for r in results):
        print("every request failed", file=sys.stderr)
        raise SystemExit(1)
    return doc


if __name__ == "__main__":
    main()
