"""Cold and warm start of `vllm-neuron serve`, side by side: time from process start to the first /health
200 and to every graph compiled, and a stream's inter-token latency while background compiles run against
the same stream after them (streams run back to back for at most --during-seconds of the background
compiles; the rest compile without load).

    .venv/bin/python benchmarks/cold_start.py [--scenarios full-eager,staged-eager-cold,...]
        [--serve-args "--max-num-seqs 8"] [--json-out cold_start.json]

Scenarios are `<readiness>-<backend>[-cold|-warm][-w<N>]`: readiness `full` (every graph before 200) or
`staged` (two graphs before 200, the rest in the background); backend `eager` or `inductor` (CPU mode's
stand-in for neuronx-cc: an expensive compile per graph in compile processes, cached on disk); `-warm`
restarts on the compile cache the same backend's latest `-cold` run of this invocation left (run it first);
`-w<N>` runs N compiles at once (VLLM_NEURON_COMPILE_WORKERS). Every server serves the default model
(`make serve`'s) with the CPU mode defaults unless --serve-args says otherwise.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import VLLM_NEURON, free_port, get, stop_process  # noqa: E402

STREAM_TOKENS = 64


@dataclass
class Scenario:
    name: str
    readiness: str
    backend: str
    warm: bool
    workers: int = 0  # VLLM_NEURON_COMPILE_WORKERS; 0: the default


@dataclass
class StreamStats:
    requests: int = 0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    seconds: float = 0.0  # first token to last, summed over requests

    def add(self, arrivals: list[float]) -> None:
        self.requests += 1
        self.tokens += len(arrivals)
        self.gaps += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        self.seconds += arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0

    def summary(self) -> dict[str, float | int | None]:
        if not self.gaps:
            return {"requests": self.requests, "tokens": self.tokens}
        gaps = sorted(self.gaps)
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "itl_p50_ms": round(1e3 * statistics.median(gaps), 1),
            "itl_p99_ms": round(1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 1),
            "itl_max_ms": round(1e3 * gaps[-1], 1),
            "tok_per_s": round(len(self.gaps) / self.seconds, 2) if self.seconds else None,
        }


def parse_scenario(name: str) -> Scenario:
    parts = name.split("-")
    workers = 0
    if len(parts) > 2 and parts[-1].startswith("w") and parts[-1][1:].isdigit():
        workers = int(parts.pop()[1:])
    readiness, backend, cache = (*parts, "", "")[:3] if len(parts) <= 3 else ("", "", "")
    if readiness not in ("full", "staged") or not backend or cache not in ("", "cold", "warm"):
        raise SystemExit(f"scenario {name!r}: use <full|staged>-<backend>[-cold|-warm][-w<workers>]")
    return Scenario(name, readiness, backend, cache == "warm", workers)


def stream_once(base: str, prompt: str) -> list[float]:
    """One streaming completion of STREAM_TOKENS tokens; the arrival time of each token."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    arrivals = []
    for chunk in client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=STREAM_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
    return arrivals


def compile_info(base: str) -> dict:
    status, body = get(base + "/v1/neuron/info")
    return json.loads(body)["compile"] if status == 200 else {}


def run(
    scenario: Scenario,
    cache_root: Path,
    serve_args: list[str],
    log_dir: Path,
    after_requests: int,
    during_s: float,
) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_NEURON_DEVICE", "PROMETHEUS_MULTIPROC_DIR")}
    env.update(
        VLLM_NEURON_COMPILE_BACKEND=scenario.backend,
        VLLM_NEURON_READINESS=scenario.readiness,
        VLLM_NEURON_CACHE_ROOT=str(cache_root),
        VLLM_NEURON_COMPILE_WORKERS=str(scenario.workers),
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the compile cache's folder holds inductor's cache
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"{scenario.name}.log"
    command = [VLLM_NEURON, "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    with open(log_path, "w") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while get(base + "/health")[0] != 200:
            if process.poll() is not None:
                raise RuntimeError(f"server exited; see {log_path}")
            time.sleep(0.25)
        first_200 = time.perf_counter() - started
        info = compile_info(base)
        # Warm-up's start, on the process clock: the first 200 came seconds_to_ready after it.
        warmup_start = first_200 - info["seconds_to_ready"]
        during, after = StreamStats(), StreamStats()
        prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
        # Streams while the background compiles (for at most during_s), then no load until they are done.
        while info.get("graphs_pending") and time.perf_counter() - started - first_200 < during_s:
            arrivals = stream_once(base, prompt)
            info = compile_info(base)
            # A request counts as "during" if background compiles were still running when it ended.
            (during if info.get("graphs_pending") else after).add(arrivals)
        while info.get("graphs_pending"):
            time.sleep(1)
            info = compile_info(base)
        for _ in range(after_requests):
            after.add(stream_once(base, prompt))
        all_graphs = warmup_start + info["seconds_to_all_graphs"]
        return {
            **asdict(scenario),
            "first_200_s": round(first_200, 1),
            "before_warmup_s": round(warmup_start, 1),
            "warmup_to_200_s": round(info["seconds_to_ready"], 1),
            "all_graphs_s": round(all_graphs, 1),
            "graphs": info["graphs_total"],
            "graphs_before_200": len_before_ready(log_path),
            "failed": info["graphs_failed"],
            "during": during.summary(),
            "after": after.summary(),
            "log": str(log_path),
        }
    finally:
        stop_process(process)


def len_before_ready(log_path: Path) -> int | None:
    """Graphs compiled before the first 200, from warm-up's log line."""
    for line in log_path.read_text().splitlines():
        if "Warm-up compiled" in line:
            return int(line.split("Warm-up compiled", 1)[1].split()[0])
    return None


def markdown(results: list[dict]) -> str:
    head = (
        "| scenario | graphs before 200 / all | first 200 (s) | of which warm-up (s) | all graphs (s) | "
        "ITL p50 / p99 during compiles (ms) | tok/s during | ITL p50 / p99 after (ms) | tok/s after |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in results:
        d, a = r["during"], r["after"]
        during = f"{d['itl_p50_ms']} / {d['itl_p99_ms']}" if "itl_p50_ms" in d else "-"
        rows.append(
            f"| {r['name']} | {r['graphs_before_200']} / {r['graphs']} | {r['first_200_s']} | "
            f"{r['warmup_to_200_s']} | {r['all_graphs_s']} | {during} | {d.get('tok_per_s') or '-'} | "
            f"{a.get('itl_p50_ms', '-')} / {a.get('itl_p99_ms', '-')} | {a.get('tok_per_s') or '-'} |"
        )
    return head + "\n".join(rows) + "\n"


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", default="full-eager,staged-eager-cold,staged-eager-warm")
    parser.add_argument("--serve-args", default="", help="extra `vllm-neuron serve` arguments, one string")
    parser.add_argument("--after-requests", type=int, default=3, help="streams after every graph is ready")
    parser.add_argument(
        "--during-seconds", type=float, default=120, help="stream for at most this long while graphs compile"
    )
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    scenarios = [parse_scenario(name) for name in args.scenarios.split(",")]
    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    results = []
    cold_roots: dict[str, Path] = {}  # backend -> the cache root its latest cold run filled
    for scenario in scenarios:
        if scenario.warm:
            if scenario.backend not in cold_roots:
                raise SystemExit(f"{scenario.name}: run a cold scenario of {scenario.backend} before it")
            cache_root = cold_roots[scenario.backend]
        else:
            cache_root = cold_roots[scenario.backend] = work / f"cache-{scenario.name}"
        print(f"== {scenario.name} (cache {cache_root})", flush=True)
        result = run(
            scenario, cache_root, args.serve_args.split(), work, args.after_requests, args.during_seconds
        )
        print(json.dumps(result), flush=True)
        results.append(result)
    document = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "command": " ".join(sys.argv),
        "results": results,
    }
    print(markdown(results))
    if args.json_out:
        args.json_out.write_text(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
