"""The host's share of a decode step, before and after, side by side in one run: vLLM's host sampler with
async scheduling off (host+sync, before), the graph's sampler with async scheduling off (device+sync), and
the graph's sampler with vLLM's async scheduling (device+async, after), and that with the calls on a thread
of their own as on Trainium (device+async+thread: VLLM_NEURON_DEVICE_THREAD=on; in CPU mode the thread's
OpenMP team slows the calls, but the host time between them is Trainium's arrangement).
SmolLM2-135M-Instruct (bfloat16) served by `vllm-neuron serve` in CPU mode, B streams decoding at once
(B = 1, 8, 32), greedy and sampled (temperature 0.8, top-k 50, top-p 0.9) traffic.

    .venv/bin/python benchmarks/host_time.py [--output-tokens 64] [--json-out host_time.json]
        [--variants host+sync,device+sync,device+async,device+async+thread]

From the server's step trace (VLLM_NEURON_STEP_TRACE), over the steps that decode exactly B rows and
prefill nothing, medians of: schedule (the engine between two steps' outputs: output processing and
scheduling; with async scheduling it runs during the calls), prepare, forward (the compiled calls, which
sample too with the device sampler), sample (outputs to the host, and vLLM's sampler where used), host (the
device's idle time between two steps' calls: the host time not overlapped with the device; without async
scheduling about schedule + prepare + sample), the bytes copied from the device per step, the transfers to
the device and the decode rows whose token came through the host (traces before issue 37 have neither),
with the share of steps that took the host sampler. In CPU mode the "device" is the host: a copy costs no
transfer here, so the bytes are what a Trainium step would move, and the host's work competes with the calls
for the same cores. Prints markdown; asserts nothing. Takes about 15 minutes on 2 cores.

Targets (issue 22), per decode step at batch 32: host time not overlapped with the device call under 1 ms;
under 64 KB to the host for greedy/top-k/top-p traffic.
"""

import argparse
import datetime
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import ROOT, Config, Server  # noqa: E402

BATCHES = (1, 8, 32)
PROMPT_TOKENS = 128
MAX_MODEL_LEN = 512
TRAFFIC = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.9, "extra_body": {"top_k": 50}},
}
PARTS = ("schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "host_ms")
# name (sampler + scheduling [+ device thread]) -> (VLLM_NEURON_SAMPLER, serve arguments, more environment)
VARIANTS = {
    "host+sync": ("host", ["--no-async-scheduling"], {}),
    "device+sync": ("device", ["--no-async-scheduling"], {}),
    "device+async": ("device", ["--async-scheduling"], {}),
    "device+async+thread": ("device", ["--async-scheduling"], {"VLLM_NEURON_DEVICE_THREAD": "on"}),
}


def run_batch(base: str, batch: int, output_tokens: int, sampling: dict, rng: random.Random) -> None:
    """`batch` streams at once, each a prompt of random ids and `output_tokens` tokens (EOS ignored)."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    prompts = [[rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
    extra = {"ignore_eos": True, **sampling.get("extra_body", {})}
    params = {key: value for key, value in sampling.items() if key != "extra_body"}

    def one(prompt: list[int]) -> None:
        stream = client.completions.create(
            model="m", prompt=prompt, max_tokens=output_tokens, stream=True, extra_body=extra, **params
        )
        for _ in stream:
            pass

    threads = [threading.Thread(target=one, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def summarise(steps: list[dict], batch: int) -> dict[str, float]:
    """Medians over the steps that decode `batch` rows and prefill nothing (the steady state)."""
    decode = [
        s
        for s in steps
        if s["decode_rows"] == batch and s["prefill_tokens"] == 0 and s["host_ms"] is not None
    ]
    for step in decode:
        step["schedule_ms"] = step["since_previous_ms"]
    figures = {part: statistics.median(s[part] for s in decode) for part in PARTS} if decode else {}
    figures["steps"] = len(decode)
    if decode:
        figures["to_host_bytes"] = statistics.median(s["to_host_bytes"] for s in decode)
        figures["host_sampled_share"] = sum(s["sampler"] == "host" for s in decode) / len(decode)
        # Transfers to the device and tokens through the host per step (traces before issue 37 have none).
        for field in ("to_device_transfers", "tokens_from_host"):
            if field in decode[0]:
                figures[field] = statistics.median(s[field] for s in decode)
    return figures


def measure(variant: str, model: str, output_tokens: int, workdir: Path) -> dict:
    sampler, serve_args, environment = VARIANTS[variant]
    name = variant.replace("+", "-")
    trace = workdir / f"steps-{name}.jsonl"
    config = Config(
        name,
        model,
        ["--dtype", "bfloat16", *serve_args],
        MAX_MODEL_LEN,
        env={"VLLM_NEURON_SAMPLER": sampler, "VLLM_NEURON_STEP_TRACE": str(trace), **environment},
    )
    server = Server(config, str(workdir / "compile-cache"), workdir / f"server-{name}.log")
    results: dict = {}
    try:
        server.wait_healthy()
        rng = random.Random(0)
        run_batch(server.base, 2, 8, TRAFFIC["greedy"], rng)  # unmeasured
        for traffic, sampling in TRAFFIC.items():
            for batch in BATCHES:
                before = len(trace.read_text().splitlines())
                run_batch(server.base, batch, output_tokens, sampling, rng)
                steps = [json.loads(line) for line in trace.read_text().splitlines()[before:]]
                results[f"{traffic}/{batch}"] = summarise(steps, batch)
                print(variant, traffic, batch, results[f"{traffic}/{batch}"], flush=True)
    finally:
        server.stop()
    return results


def markdown(doc: dict) -> str:
    lines = [
        "| traffic | batch | variant | schedule ms | prepare ms | forward ms | sample ms | **host ms** | "
        "bytes to host | transfers to device | tokens via host | host-sampled steps | steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in next(iter(doc["results"].values())):
        traffic, batch = key.split("/")
        for variant in doc["results"]:
            f = doc["results"][variant][key]
            if not f.get("steps"):
                lines.append(
                    f"| {traffic} | {batch} | {variant} | no steady decode steps | | | | | | | | | 0 |"
                )
                continue
            lines.append(
                f"| {traffic} | {batch} | {variant} | {f['schedule_ms']:.2f} | {f['prepare_ms']:.2f} | "
                f"{f['forward_ms']:.2f} | {f['sample_ms']:.2f} | **{f['host_ms']:.2f}** | "
                f"{f['to_host_bytes']:,.0f} | {f.get('to_device_transfers', '-')} | "
                f"{f.get('tokens_from_host', '-')} | {100 * f['host_sampled_share']:.0f}% | {f['steps']} |"
            )
    return "\n".join(lines)


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--workdir", type=Path, help="server logs and step traces (default: a temp dir)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}"
    )
    args = parser.parse_args()

    from server.default_model import ensure_default_model

    model = str(ensure_default_model())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="host-time-"))
    workdir.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    doc = {
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "command": " ".join(sys.argv),
    }
    chosen = [name.strip() for name in args.variants.split(",")]
    doc["results"] = {variant: measure(variant, model, args.output_tokens, workdir) for variant in chosen}
    print(f"\n{doc['date']}, commit {doc['commit']}: `{doc['command']}`\n")
    print(markdown(doc))
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
