"""Scale-out on one host in CPU mode (issue 41): TTFT and ITL at a fixed request rate for one engine, for
`--data-parallel-size 2` (vLLM's coordinator in front of two engines, each worker pinned to its half of the
CPUs by the plugin), for two DP=1 replicas (each process pinned to half of the CPUs) behind a round-robin
client, and for a prefill server and a decode server (each on half of the CPUs; the KV moved by vLLM's
NixlConnector over UCX on 127.0.0.1, or by its ExampleConnector over a shared folder: docs/disaggregation.md)
behind a client doing vLLM's handshake (prefill with max_tokens 1, then decode with the returned
kv_transfer_params; TTFT counts both), in one run, side by side.

    .venv/bin/python benchmarks/scale_out.py [--model smollm2|tiny] [--rate R] [--requests N]
                                             [--setups one,dp2,replicas,nixl,example]

Traffic: open loop, request i sent at i / rate seconds whatever the answers (a fixed rate, as a router
sees it), prompts of 128 random token ids (the prefix cache never hits), 64 output tokens, greedy, EOS
ignored, streamed. Every server warms every graph before the load (VLLM_NEURON_READINESS=full). Prints
figures; asserts nothing.
"""

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching import percentile, stream_one  # noqa: E402
from lora import load_model  # noqa: E402
from serving import ROOT, Config, Server  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS, MAX_MODEL_LEN, MAX_NUM_SEQS = 128, 64, 256, 8
BUCKETS = {"prefill_buckets": [128], "decode_batch_buckets": [1, 8], "context_buckets": [MAX_MODEL_LEN]}


SETUPS = {
    "one": "one engine (DP=1, every CPU)",
    "dp2": "DP=2 (vLLM's coordinator, one address)",
    "replicas": "2 x DP=1 replicas, round-robin client",
    "nixl": "prefill + decode servers (NixlConnector, UCX), handshake client",
    "example": "prefill + decode servers (ExampleConnector), handshake client",
}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


# What vLLM's disaggregation proxies send a prefill server: prefill, sample one token, hand the KV over.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}


def disaggregated(prefill, decode, prompt: list[int]) -> dict:
    """One request through a prefill server then a decode server; TTFT from before the prefill request."""
    start = time.monotonic()
    handed = prefill.completions.create(
        model="m", prompt=prompt, max_tokens=1, extra_body={"kv_transfer_params": PREFILL_PARAMS}
    )
    params = (handed.model_extra or {}).get("kv_transfer_params")
    prefill_seconds = time.monotonic() - start
    result = stream_one(decode, prompt, OUTPUT_TOKENS, extra_body={"kv_transfer_params": params})
    return {**result, "ttft": prefill_seconds + result["ttft"]}


def open_loop(bases: list[str], jobs: list[list[int]], rate: float, split: bool = False) -> dict:
    """Send job i at i / rate seconds to bases[i % len(bases)] (round-robin), each on its own thread; with
    `split`, to bases[0] to prefill and bases[1] to decode."""
    from openai import OpenAI

    clients = [OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1800) for base in bases]
    results: list[dict] = []
    lock = threading.Lock()

    def send(index: int, prompt: list[int]) -> None:
        if split:
            result = disaggregated(*clients, prompt)
        else:
            result = stream_one(clients[index % len(clients)], prompt, OUTPUT_TOKENS)
        with lock:
            results.append(result)

    start = time.monotonic()
    threads = []
    for index, prompt in enumerate(jobs):
        time.sleep(max(0.0, start + index / rate - time.monotonic()))
        thread = threading.Thread(target=send, args=(index, prompt))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - start
    ttft = [r["ttft"] for r in results]
    itl = [gap for r in results for gap in r["itl"]]
    return {
        "requests": len(results),
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * percentile(itl, 0.5),
        "itl_p99_ms": 1e3 * percentile(itl, 0.99),
        "output_tok_s": sum(r["tokens"] for r in results) / seconds,
    }


def threads(cpus: list[int]) -> dict[str, str]:
    """A pinned server's compute threads: one per CPU it may use, as the plugin sets for each DP engine
    (more threads than CPUs make them wait on each other)."""
    return {"OMP_NUM_THREADS": str(len(cpus))}


def run_setup(
    name: str, configs: list[Config], workdir: Path, jobs: list[list[int]], rate: float, split: bool = False
) -> dict:
    servers = [Server(config, str(workdir / "cache"), workdir / f"{config.name}.log") for config in configs]
    try:
        for server in servers:
            print(f"{name}: {server.log_path.stem} healthy after {server.wait_healthy():.1f} s", flush=True)
        bases = [server.base for server in servers]
        # untimed: every server's first requests (fresh prompts: the timed ones hit no cache)
        warm = [[token + 1 for token in prompt] for prompt in jobs[: 2 * len(bases)]]
        open_loop(bases, warm, rate, split)
        row = open_loop(bases, jobs, rate, split)
        row["recompiles"] = sum(
            s.metrics().get("vllm_neuron:unexpected_recompiles_total", 0) for s in servers
        )
    finally:
        for server in servers:
            server.stop()
    print(json.dumps({"setup": name, **row}), flush=True)
    return row


def main() -> None:
    from vllm_neuron import host_cpu

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (default 1)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--setups", default=",".join(SETUPS), help="which, comma-separated (default all)")
    args = parser.parse_args()
    print(host_cpu.summary(), flush=True)
    chosen = args.setups.split(",")
    if unknown := set(chosen) - set(SETUPS):
        parser.error(f"unknown setups {sorted(unknown)}: choose from {', '.join(SETUPS)}")
    sys.path.insert(0, str(ROOT))
    model, vocab, extra = load_model(args.model)
    rng = random.Random(0)
    jobs = [[rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(args.requests)]
    workdir = Path(tempfile.mkdtemp(prefix="vllm-neuron-scale-out-"))
    common = [*extra, "--max-num-seqs", str(MAX_NUM_SEQS), "--additional-config", json.dumps(BUCKETS)]
    cpus = sorted(os.sched_getaffinity(0))
    halves = [cpus[: len(cpus) // 2], cpus[len(cpus) // 2 :]]
    setups = {
        "one": [Config("one", model, common, MAX_MODEL_LEN)],
        "dp2": [Config("dp2", model, [*common, "--data-parallel-size", "2"], MAX_MODEL_LEN)],
        "replicas": [
            Config(f"replica{i}", model, common, MAX_MODEL_LEN, cpus=half, env=threads(half))
            for i, half in enumerate(halves)
        ],
    }
    rows = {
        SETUPS[key]: run_setup(SETUPS[key], configs, workdir, jobs, args.rate)
        for key, configs in setups.items()
        if key in chosen
    }
    if "nixl" in chosen:
        rows[SETUPS["nixl"]] = run_setup(
            SETUPS["nixl"],
            [
                Config(
                    role,
                    model,
                    [
                        *common,
                        "--kv-transfer-config",
                        json.dumps({"kv_connector": "NixlConnector", "kv_role": role}),
                    ],
                    MAX_MODEL_LEN,
                    cpus=half,
                    # Each server's NIXL side channel on its own port of the loopback.
                    env=threads(half)
                    | {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)},
                )
                for role, half, port in zip(
                    ("kv_producer", "kv_consumer"), halves, free_ports(2), strict=True
                )
            ],
            workdir,
            jobs,
            args.rate,
            split=True,
        )
    if "example" not in chosen:
        print_table(args, rows, workdir)
        return
    # A saving prefill server prefills each prompt in one step (ExampleConnector stores it in that step).
    storage = workdir / "kv-storage"

    def transfer(role: str) -> list[str]:
        config = {"kv_connector": "ExampleConnector", "kv_role": role}
        return [
            "--kv-transfer-config",
            json.dumps(config | {"kv_connector_extra_config": {"shared_storage_path": str(storage)}}),
        ]

    one_step = {**BUCKETS, "prefill_buckets": [128, MAX_MODEL_LEN], "prefill_tokens_while_decoding": 0}
    prefill_args = [*extra, "--max-num-seqs", str(MAX_NUM_SEQS), "--additional-config", json.dumps(one_step)]
    prefill_args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(MAX_MODEL_LEN)]
    split = SETUPS["example"]
    rows[split] = run_setup(
        split,
        [
            Config(
                "prefill",
                model,
                [*prefill_args, *transfer("kv_producer")],
                MAX_MODEL_LEN,
                cpus=halves[0],
                env=threads(halves[0]),
            ),
            Config(
                "decode",
                model,
                [*common, *transfer("kv_consumer")],
                MAX_MODEL_LEN,
                cpus=halves[1],
                env=threads(halves[1]),
            ),
        ],
        workdir,
        jobs,
        args.rate,
        split=True,
    )
    print_table(args, rows, workdir)


def print_table(args: argparse.Namespace, rows: dict[str, dict], workdir: Path) -> None:
    from vllm_neuron import host_cpu

    print(
        f"\n{args.model}, {args.rate} requests/s, {args.requests} requests, prompts {PROMPT_TOKENS} tokens, "
    )
    print(f"outputs {OUTPUT_TOKENS}, max_num_seqs {MAX_NUM_SEQS} per engine")
    print("\n| setup | TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s | unexpected recompiles |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} | {row['itl_p50_ms']:.0f} / "
            f"{row['itl_p99_ms']:.0f} | {row['output_tok_s']:.1f} | {row['recompiles']:.0f} |"
        )
    print(f"\n{host_cpu.summary()}; logs in {workdir}")


if __name__ == "__main__":
    main()
