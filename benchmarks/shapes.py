"""Static-shape figures of the plugin in CPU mode: graphs compiled, compile seconds, cold vs warm-cache time
to healthy, unexpected recompiles and padding efficiency per phase under a mixed-length workload.

    .venv/bin/python benchmarks/shapes.py [--models tiny,smollm2] [--requests N] [--concurrency C]

Each configuration runs `vllm-neuron serve` on 127.0.0.1, drives it with the openai client, reads the
plugin's series from /metrics, and stops the server by its pid. Prints one table; nothing is asserted.
"""

import argparse
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import ROOT, Config, Server  # noqa: E402


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def mixed_workload(base: str, max_model_len: int, requests: int, concurrency: int, seed: int = 0) -> dict:
    """Prompts log-uniform 8..max, outputs log-uniform 8..256; every 10th request is a stream the client
    abandons after three chunks (a cancellation)."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(seed)
    jobs = []
    for index in range(requests):
        output = log_uniform(rng, 8, 256)
        prompt = log_uniform(rng, 8, max(8, max_model_len - output))
        jobs.append((index, [rng.randrange(100, 20000) for _ in range(prompt)], output))
    vocab_cap = 400 if max_model_len <= 256 else 20000  # the tiny model's vocabulary is ~450 tokens
    jobs = [(i, [t % vocab_cap for t in p], o) for i, p, o in jobs]
    lock, done = threading.Lock(), {"completed": 0, "cancelled": 0, "output_tokens": 0}

    def run(job):
        index, prompt, output = job
        if index % 10 == 9:
            stream = client.completions.create(
                model="m", prompt=prompt, max_tokens=output, stream=True, extra_body={"ignore_eos": True}
            )
            for chunks, _ in enumerate(stream):
                if chunks >= 2:
                    break
            stream.close()
            with lock:
                done["cancelled"] += 1
            return
        result = client.completions.create(
            model="m", prompt=prompt, max_tokens=output, temperature=0, extra_body={"ignore_eos": True}
        )
        with lock:
            done["completed"] += 1
            done["output_tokens"] += result.usage.completion_tokens

    start = time.monotonic()
    pending = list(jobs)
    workers = []
    for _ in range(concurrency):

        def loop():
            while True:
                with lock:
                    if not pending:
                        return
                    job = pending.pop(0)
                run(job)

        worker = threading.Thread(target=loop)
        worker.start()
        workers.append(worker)
    for worker in workers:
        worker.join()
    done["seconds"] = time.monotonic() - start
    return done


def efficiency(metrics: dict[str, float], phase: str) -> float:
    real = metrics.get(f'vllm_neuron:padding_real_tokens_total{{phase="{phase}"}}', 0.0)
    slots = metrics.get(f'vllm_neuron:padding_slots_total{{phase="{phase}"}}', 0.0)
    return real / slots if slots else float("nan")


def measure(config: Config, requests: int, concurrency: int, workdir: Path, cold_warm: bool) -> dict:
    cache_root = tempfile.mkdtemp(prefix="cache-", dir=workdir)
    server = Server(config, cache_root, workdir / f"{config.name}-cold.log")
    try:
        cold_s = server.wait_healthy()
        startup = server.metrics()
        load = mixed_workload(server.base, config.max_model_len, requests, concurrency) if requests else {}
        after = server.metrics()
    finally:
        server.stop()
    row = {
        "config": config.name,
        "graphs": int(startup.get("vllm_neuron:compiled_graphs", 0)),
        "warmup_prefill_s": startup.get('vllm_neuron:warmup_seconds{phase="prefill"}', float("nan")),
        "warmup_decode_s": startup.get('vllm_neuron:warmup_seconds{phase="decode"}', float("nan")),
        # 0 when the bucket set has no mixed calls (decode rows and a capped prefill chunk in one call)
        "warmup_mixed_s": startup.get('vllm_neuron:warmup_seconds{phase="mixed"}', 0.0),
        "cold_healthy_s": cold_s,
        "unexpected_recompiles": after.get("vllm_neuron:unexpected_recompiles_total", float("nan")),
        "prefill_efficiency": efficiency(after, "prefill"),
        "decode_efficiency": efficiency(after, "decode"),
        **{f"load_{k}": v for k, v in load.items()},
    }
    if cold_warm:
        server = Server(config, cache_root, workdir / f"{config.name}-warm.log")
        try:
            row["warm_healthy_s"] = server.wait_healthy()
        finally:
            server.stop()
        row["warm_over_cold"] = row["warm_healthy_s"] / cold_s
    return row


def configs(models: list[str], budget: int) -> list[tuple[Config, bool]]:
    chosen = []
    auto = json.dumps(
        {
            "bucket_policy": "auto",
            "graph_budget": budget,
            "traffic": {"prompt_len": [8, 0], "output_len": [8, 256], "concurrency": 8},
        }
    )
    if "tiny" in models:
        tiny = str(prepare_tiny_model())
        traffic = auto.replace('"prompt_len": [8, 0]', '"prompt_len": [8, 256]')
        base = ["--dtype", "float32", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]
        chosen.append((Config("tiny eager, default buckets", tiny, base, 256), False))
        chosen.append(
            (Config("tiny eager, auto buckets", tiny, [*base, "--additional-config", traffic], 256), False)
        )
        chosen.append(
            (
                Config(
                    "tiny inductor, auto buckets",
                    tiny,
                    [*base, "--additional-config", traffic],
                    256,
                    "inductor",
                ),
                True,
            )
        )
    if "smollm2" in models:
        from server.default_model import ensure_default_model

        smol = str(ensure_default_model())
        traffic = auto.replace('"prompt_len": [8, 0]', '"prompt_len": [8, 2048]')
        base = ["--max-num-seqs", "16", "--max-num-batched-tokens", "512"]
        chosen.append((Config("SmolLM2 eager, default buckets", smol, base, 2048), False))
        chosen.append(
            (
                Config("SmolLM2 eager, auto buckets", smol, [*base, "--additional-config", traffic], 2048),
                False,
            )
        )
        few = json.dumps({"prefill_buckets": [512], "decode_batch_buckets": [16], "context_buckets": [2048]})
        chosen.append(
            (
                Config(
                    "SmolLM2 inductor, 2 graphs", smol, [*base, "--additional-config", few], 2048, "inductor"
                ),
                True,
            )
        )
    return chosen


def prepare_tiny_model() -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.tiny_model import build_tiny_llama

    target = Path(tempfile.gettempdir()) / "vllm-neuron-bench-tiny-llama"
    if not (target / "config.json").exists():
        build_tiny_llama(target)
    return target


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument(
        "--requests", type=int, default=0, help="requests per configuration (default: 200 tiny, 40 SmolLM2)"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--graph-budget", type=int, default=24)
    parser.add_argument("--only", default="", help="run only configurations whose name contains this")
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    os.environ.pop("VLLM_NEURON_DEVICE", None)
    workdir = Path(tempfile.mkdtemp(prefix="vllm-neuron-shapes-"))
    rows = []
    for config, cold_warm in configs(args.models.split(","), args.graph_budget):
        if args.only not in config.name:
            continue
        requests = args.requests or (200 if config.max_model_len <= 256 else 40)
        if config.backend == "inductor":
            requests = 0  # cold vs warm start only
        print(f"... {config.name}", flush=True)
        rows.append(measure(config, requests, args.concurrency, workdir, cold_warm))
        print(json.dumps(rows[-1]), flush=True)
    columns = [
        ("config", "{}"),
        ("graphs", "{}"),
        ("warmup_prefill_s", "{:.1f}"),
        ("warmup_decode_s", "{:.1f}"),
        ("warmup_mixed_s", "{:.1f}"),
        ("cold_healthy_s", "{:.1f}"),
        ("warm_healthy_s", "{:.1f}"),
        ("warm_over_cold", "{:.2f}"),
        ("unexpected_recompiles", "{:.0f}"),
        ("prefill_efficiency", "{:.3f}"),
        ("decode_efficiency", "{:.3f}"),
        ("load_completed", "{}"),
        ("load_cancelled", "{}"),
    ]
    print("\n| " + " | ".join(name for name, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [fmt.format(row[name]) if name in row else "-" for name, fmt in columns]
        print("| " + " | ".join(cells) + " |")
    print(f"\nlogs: {workdir}")


if __name__ == "__main__":
    main()
