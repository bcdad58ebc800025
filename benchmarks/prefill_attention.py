"""A fresh prefill chunk's attention, the two forms side by side in one run: the masked form over the cache
(`kv_cache.ops.table_attention` after the write: what every first chunk ran before fresh prefill graphs) and
the fresh form over the chunk's own keys (`kv_cache.ops.causal_attention`: SDPA's causal flag, no mask, the
call TorchNeuron hands its NKI flash kernel). For each: the lowered graph's largest intermediate (outside the
flash kernel) and whether the kernel takes its attention, XLA's bytes accessed and flops, and the eager CPU
time (the forms interleaved, medians; skipped above --eager-max tokens, where the masked form's mask alone
is gigabytes).

    .venv/bin/python benchmarks/prefill_attention.py [--tokens 2048,8192] [--heads 32 --kv-heads 8]

The chunk fills its token bucket and its context bucket (T tokens at position 0 over T positions); one
layer; the cache holds exactly the chunk's blocks plus the null block. Asserts nothing.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_cache import ops  # noqa: E402
from vllm_neuron.compiler import xla  # noqa: E402
from vllm_neuron.compiler.stablehlo import LoweredGraph, StableHLOBackend  # noqa: E402

BLOCK_SIZE = 32
SCALE = 0.125


def chunk(tokens: int, args: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    blocks = tokens // BLOCK_SIZE
    cache = torch.zeros(2 * args.kv_heads, 1 + blocks, BLOCK_SIZE, args.head_size, dtype=dtype)
    query = torch.randn(tokens, args.heads, args.head_size, generator=gen).to(dtype)
    key, value = (torch.randn(tokens, args.kv_heads, args.head_size, generator=gen).to(dtype) for _ in "kv")
    slots = torch.arange(BLOCK_SIZE, (1 + blocks) * BLOCK_SIZE)
    table = torch.arange(1, 1 + blocks).view(1, blocks)
    return cache, query, key, value, slots, table, torch.arange(tokens).view(1, tokens)


def masked(cache, query, key, value, slots, table, positions) -> torch.Tensor:
    ops.write_kv(cache, key, value, slots)
    return ops.table_attention(query.unsqueeze(0), cache, table, positions, SCALE)[0]


def fresh(cache, query, key, value, slots, table, positions) -> torch.Tensor:
    ops.write_kv(cache, key, value, slots)
    return ops.causal_attention(query, key, value, SCALE)


FORMS = {"masked, over the cache": masked, "fresh, own keys": fresh}


def lowered(function, inputs: tuple[torch.Tensor, ...]) -> LoweredGraph:
    backend = StableHLOBackend(execute="none")
    torch._dynamo.reset()
    torch.compile(function, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    (graph,) = backend.graphs
    return graph


def eager_ms(inputs: tuple[torch.Tensor, ...], repeats: int) -> dict[str, float]:
    seconds: dict[str, list[float]] = {label: [] for label in FORMS}
    for _ in range(repeats):
        for label, function in FORMS.items():
            start = time.perf_counter()
            function(*inputs)
            seconds[label].append(time.perf_counter() - start)
    return {label: round(statistics.median(times) * 1e3, 1) for label, times in seconds.items()}


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--eager-max", type=int, default=2048)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shape = f"{args.heads} heads, {args.kv_heads} KV heads, head size {args.head_size}"
    print(f"one layer: {shape}, {args.dtype}")
    print("| tokens | form | flash kernel takes it | largest intermediate | MiB | XLA bytes | XLA flops |")
    print("|---|---|---|---|---|---|---|")
    for tokens in (int(value) for value in args.tokens.split(",")):
        inputs = chunk(tokens, args, dtype)
        for label, function in FORMS.items():
            graph = lowered(function, tuple(t.clone() for t in inputs))
            cost = xla.compile(graph.stablehlo, {}).cost
            largest, kind = graph.largest_tensor
            mib = graph.largest_tensor_bytes / 2**20
            print(
                f"| {tokens} | {label} | {'yes' if graph.flash_attention else 'no'} | {kind} {list(largest)} "
                f"| {mib:.0f} | {cost.bytes_accessed:,.0f} | {cost.flops:,.0f} |",
                flush=True,
            )
        if tokens <= args.eager_max:
            print(f"eager ms at {tokens} tokens, median of {args.repeats}: {eager_ms(inputs, args.repeats)}")


if __name__ == "__main__":
    main()
