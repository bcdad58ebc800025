"""Decode attention (kv_cache.ops.page_attention) alone, before and after a change, in one run: XLA's bytes
accessed and flops for the lowered op (the `xla` backend's cost analysis) against the floor, whether the KV
write stays in place, and the eager CPU time of the op.

    .venv/bin/python benchmarks/attention.py [--before main] [--batch 8] [--context 2048]

`--before REV`: kv_cache/ops.py as of that git revision, beside the working tree's. The synthetic call: each
row one query at position context - 1, its pages (128 tokens, blocks of 16) scattered over a cache that holds
exactly the call's KV plus the null block. XLA charges each gather with its whole operand (the cache), so
that cache size makes its bytes comparable to the floor: the KV read once, the queries read, the output
written. Asserts nothing.
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_neuron.compiler import hlo_text, xla  # noqa: E402
from vllm_neuron.compiler.stablehlo import StableHLOBackend  # noqa: E402

BLOCK_SIZE, PAGE_TOKENS, SCALE = 16, 128, 0.125


def load_ops(name: str, source: str) -> ModuleType:
    """A copy of kv_cache/ops.py as a module of its own (dynamo needs it importable by name)."""
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def decode_call(args: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    pages_per_row = args.context // PAGE_TOKENS
    num_blocks = 1 + args.batch * args.context // BLOCK_SIZE
    cache = torch.randn(2 * args.kv_heads, num_blocks, BLOCK_SIZE, args.head_size, generator=gen).to(dtype)
    blocks = torch.randperm(num_blocks - 1, generator=gen) + 1
    page_blocks = blocks.view(args.batch * pages_per_row, PAGE_TOKENS // BLOCK_SIZE)
    page_rows = torch.arange(args.batch).repeat_interleave(pages_per_row)
    page_starts = torch.arange(pages_per_row).repeat(args.batch) * PAGE_TOKENS
    positions = torch.full((args.batch,), args.context - 1)
    query = torch.randn(args.batch, args.heads, args.head_size, generator=gen).to(dtype)
    new_kv = torch.randn(2, args.batch, args.kv_heads, args.head_size, generator=gen).to(dtype)
    slots = page_blocks[torch.arange(args.batch) * pages_per_row + pages_per_row - 1, -1] * BLOCK_SIZE
    return cache, query, page_blocks, page_rows, page_starts, positions, new_kv, slots


def lowered(function, inputs: tuple[torch.Tensor, ...]):
    backend = StableHLOBackend(execute="none")
    torch._dynamo.reset()
    torch.compile(function, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    (graph,) = backend.graphs
    return graph


def measure(ops: ModuleType, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, object]:
    cache, query, blocks, rows, starts, positions, new_kv, slots = decode_call(args, dtype)

    def attend(cache, query, blocks, rows, starts, positions):
        return ops.page_attention(query, cache, blocks, rows, starts, positions, SCALE)

    def write_then_attend(cache, key, value, slots, query, blocks, rows, starts, positions):
        ops.write_kv(cache, key, value, slots)
        return ops.page_attention(query, cache, blocks, rows, starts, positions, SCALE)

    graph = lowered(attend, (cache, query, blocks, rows, starts, positions))
    program = xla.compile(graph.stablehlo, {})
    written = lowered(
        write_then_attend, (cache.clone(), *new_kv, slots, query, blocks, rows, starts, positions)
    )
    problems = [problem for write in hlo_text.cache_writes(written.stablehlo) for problem in write.problems]
    floor = (cache.numel() + 2 * query.numel()) * cache.element_size()
    return {
        "bytes_accessed": int(program.cost.bytes_accessed),
        "floor_bytes": floor,
        "over_floor": round(program.cost.bytes_accessed / floor, 2),
        "flops": int(program.cost.flops),
        "temp_bytes": program.memory.temp,
        "kv_write_in_place": not problems,
    }


def eager_ms(
    versions: dict[str, ModuleType], args: argparse.Namespace, dtype: torch.dtype
) -> dict[str, float]:
    """Median eager time of each version, the versions interleaved so that a busy machine slows them alike."""
    cache, query, blocks, rows, starts, positions, _, _ = decode_call(args, dtype)
    seconds: dict[str, list[float]] = {label: [] for label in versions}
    for _ in range(args.repeats):
        for label, ops in versions.items():
            masks = ops.page_masks(rows, starts, positions, PAGE_TOKENS)
            start = time.perf_counter()
            ops.page_attention(query, cache, blocks, rows, starts, positions, SCALE, masks)
            seconds[label].append(time.perf_counter() - start)
    return {label: round(statistics.median(times) * 1e3, 2) for label, times in seconds.items()}


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", default="main", help="git revision of the formulation to compare with")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    before = subprocess.run(
        ["git", "show", f"{args.before}:kv_cache/ops.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    versions = {
        args.before: load_ops("ops_before", before),
        "working tree": load_ops("ops_after", (ROOT / "kv_cache/ops.py").read_text()),
    }
    for dtype in (torch.float32, torch.bfloat16):
        for label, ops in versions.items():
            print(f"{str(dtype).removeprefix('torch.')} {label}: {measure(ops, args, dtype)}", flush=True)
        print(f"{str(dtype).removeprefix('torch.')} eager ms, median: {eager_ms(versions, args, dtype)}")


if __name__ == "__main__":
    main()
