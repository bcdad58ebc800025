"""The `xla` backend after lowering: XLA compiles each graph's plain StableHLO, the compiled program is what
runs each call (the KV caches donated and updated in place), and what XLA made of the program is checked and
reported: its buffer assignment (caches aliased, and no buffer of a cache's size in the optimised HLO but
the one in-place write of each: no copy, no second write) and its cost (flops and bytes accessed), beside
the call's physical minimum and a trn2 time estimate.

XLA's cost model charges an op that takes a whole cache as an operand (the in-place scatter, the gathers of
blocks) with the whole cache's bytes, so its bytes accessed overstate a call's cache traffic: an upper bound
where the caches are large beside the weights.
"""

import math
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from vllm_neuron import trn2
from vllm_neuron.calls import Call
from vllm_neuron.compiler import hlo_text, xla

# One logical core of a trn2 (LNC=2): its share of the chip's HBM bandwidth and dense BF16 FLOP/s.
_CORE_FLOPS = trn2.CHIP_BF16_FLOPS / trn2.RANKS_PER_CHIP

# An instruction of the optimised HLO's entry computation: `%name = f32[2,4,64]{2,1,0} opcode(`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.-]+ = \w+\[([\d,]*)\]\S* ([\w-]+)\(")
# What names a buffer without making one.
_NO_BUFFER = {"parameter", "bitcast", "get-tuple-element", "tuple"}


@dataclass(frozen=True)
class CompiledGraph:
    """One graph as XLA compiled it."""

    seconds: float
    memory: xla.Memory
    cost: xla.Cost
    cache_bytes: tuple[int, ...]  # each in-place (aliased) input's size
    cache_buffers: tuple[str, ...]  # instructions of the optimised HLO that make a buffer of a cache's size
    minimum_bytes: int | None = None  # the call's physical minimum (minimum_bytes); None without a call

    @property
    def trn2_seconds(self) -> float:
        """Estimate of a call on one trn2 logical core: XLA's bytes over HBM bandwidth or its flops over the
        Tensor Engine's dense BF16 peak, whichever is longer."""
        return max(self.cost.bytes_accessed / trn2.RANK_HBM_BW, self.cost.flops / _CORE_FLOPS)

    @property
    def bound(self) -> str:
        memory = self.cost.bytes_accessed / trn2.RANK_HBM_BW >= self.cost.flops / _CORE_FLOPS
        return "memory" if memory else "compute"

    @property
    def problems(self) -> list[str]:
        """Why the caches are not written in place, if they are not; empty when they are."""
        found = [f"copies a cache: {line}" for line in self.cache_buffers if " copy" in line]
        found += [f"converts a cache: {line}" for line in self.cache_buffers if "convert" in line]
        if len(self.cache_buffers) > len(self.cache_bytes):
            found.append(
                f"makes {len(self.cache_buffers)} buffers of a cache's size for "
                f"{len(self.cache_bytes)} caches (one in-place write each)"
            )
        if self.memory.alias < sum(self.cache_bytes):
            found.append(f"aliases {self.memory.alias} bytes, fewer than its caches' {sum(self.cache_bytes)}")
        return found

    def summary(self) -> dict[str, object]:
        problems = self.problems
        return {
            "xla_compile_seconds": round(self.seconds, 3),
            "flops": self.cost.flops,
            "bytes_accessed": self.cost.bytes_accessed,
            "argument_bytes": self.memory.argument,
            "alias_bytes": self.memory.alias,
            "temp_bytes": self.memory.temp,
            "cache_bytes": sum(self.cache_bytes),
            "caches_in_place": not problems,
            "cache_problems": problems,
            "trn2_estimate_ms": round(self.trn2_seconds * 1e3, 4),
            "trn2_bound": self.bound,
            "minimum_bytes": self.minimum_bytes,
            "minimum_ms": None
            if self.minimum_bytes is None
            else round(self.minimum_bytes / trn2.RANK_HBM_BW * 1e3, 4),
            "bytes_over_minimum": None
            if not self.minimum_bytes
            else round(self.cost.bytes_accessed / self.minimum_bytes, 2),
        }


def minimum_bytes(call: Call, memory: xla.Memory, caches: list[torch.Tensor]) -> int:
    """What a call must move at least: every argument but the caches read once (weights and inputs), the KV
    its rows attend to read once, its new KV written, and its outputs written."""
    attended = {
        "prefill": call.chunk_context,
        "decode": call.batch * call.decode_context,
        "verify": call.batch * call.decode_context,
        "mixed": call.batch * call.decode_context + call.chunk_context,
    }[call.phase]
    written = {
        "prefill": call.token_bucket,
        "decode": call.batch,
        "verify": call.batch * call.queries,
        "mixed": call.batch + call.token_bucket,
    }[call.phase]
    # [2 * kv_heads, blocks, block_size, head_size]: K and V of each KV head per token.
    token_bytes = sum(
        cache.shape[0] * cache.shape[3] * cache.element_size()
        for cache in caches
        if hlo_text.is_kv_cache(tuple(cache.shape))
    )
    cache_total = sum(cache.numel() * cache.element_size() for cache in caches)
    outputs = memory.output - memory.alias
    return memory.argument - cache_total + (attended + written) * token_bytes + outputs


def cache_buffers(optimized_hlo: str, cache_elements: set[int]) -> list[str]:
    """The instructions of the optimised HLO's entry computation that make a buffer with a cache's number of
    elements, in any element type: one in-place write per cache when the caches stay in place; a copy, a
    select, a second write or a conversion of a whole cache besides (XLA's CPU compiler has no bfloat16
    scatter: it converts a bfloat16 cache to float32 around the write)."""
    entry = optimized_hlo[optimized_hlo.find("\nENTRY ") :]
    found = []
    for line in entry.splitlines()[1:]:
        match = _INSTRUCTION.match(line)
        if match is None or match.group(2) in _NO_BUFFER:
            continue
        if math.prod(int(size) for size in match.group(1).split(",") if size) in cache_elements:
            found.append(line.strip().split(", metadata=")[0])
        if line.startswith("}"):
            break
    return found


def compile_graph(
    stablehlo: str, aliases: dict[int, int], example_inputs: list[Any], call: Call | None = None
) -> tuple[xla.Program, CompiledGraph]:
    """XLA's program for a lowered graph and its report. aliases: parameter -> output updated in place;
    call: the call the graph was traced for (its physical minimum), where known."""
    start = time.perf_counter()
    program = xla.compile(stablehlo, aliases)
    seconds = time.perf_counter() - start
    caches = [
        example_inputs[parameter]
        for parameter in aliases
        if hlo_text.is_cache(tuple(example_inputs[parameter].shape))
    ]
    memory = program.memory
    report = CompiledGraph(
        seconds=seconds,
        memory=memory,
        cost=program.cost,
        cache_bytes=tuple(cache.numel() * cache.element_size() for cache in caches),
        cache_buffers=tuple(cache_buffers(program.optimized_hlo, {cache.numel() for cache in caches})),
        minimum_bytes=None if call is None else minimum_bytes(call, memory, caches),
    )
    return program, report
