"""The `xla` backend after lowering: XLA compiles each graph's plain StableHLO, the compiled program is what
runs each call (the KV caches donated and updated in place), and what XLA made of the program is checked and
reported: its buffer assignment (caches aliased, no cache-sized temporary, no copy of a cache in the
optimised HLO) and its cost (flops and bytes accessed).
"""

import re
import time
from dataclasses import dataclass
from typing import Any

from vllm_neuron import xla

# An instruction of XLA's optimised HLO that copies a buffer: `%copy.3 = f32[2,4,64]{2,1,0} copy(%p)`.
_COPY = re.compile(r"=\s*\w+\[([\d,]*)\][^=]*?\s(?:copy|copy-start)\(")


@dataclass(frozen=True)
class CompiledGraph:
    """One graph as XLA compiled it."""

    seconds: float
    memory: xla.Memory
    cost: xla.Cost
    cache_bytes: tuple[int, ...]  # each in-place (aliased) input's size
    cache_copies: tuple[str, ...]  # instructions of the optimised HLO that copy a cache-sized buffer

    @property
    def problems(self) -> list[str]:
        """Why the caches are not written in place, if they are not; empty when they are."""
        found = [f"copies a cache: {copy}" for copy in self.cache_copies]
        if self.memory.alias < sum(self.cache_bytes):
            found.append(f"aliases {self.memory.alias} bytes, fewer than its caches' {sum(self.cache_bytes)}")
        if self.cache_bytes and self.memory.temp >= min(self.cache_bytes):
            found.append(f"needs {self.memory.temp} bytes of temporaries, as much as a cache")
        return found

    def summary(self) -> dict[str, object]:
        return {
            "xla_compile_seconds": round(self.seconds, 3),
            "flops": self.cost.flops,
            "bytes_accessed": self.cost.bytes_accessed,
            "argument_bytes": self.memory.argument,
            "alias_bytes": self.memory.alias,
            "temp_bytes": self.memory.temp,
            "cache_bytes": sum(self.cache_bytes),
            "caches_in_place": not self.problems,
        }


def cache_copies(optimized_hlo: str, cache_elements: set[int]) -> list[str]:
    """The copies in XLA's optimised HLO of a buffer with as many elements as a cache."""
    found = []
    for line in optimized_hlo.splitlines():
        match = _COPY.search(line)
        if match is None:
            continue
        elements = 1
        for size in filter(None, match.group(1).split(",")):
            elements *= int(size)
        if elements in cache_elements:
            found.append(line.strip().split(", metadata=")[0])
    return found


def compile_graph(
    stablehlo: str, aliases: dict[int, int], example_inputs: list[Any]
) -> tuple[xla.Program, CompiledGraph]:
    """XLA's program for a lowered graph and its report. aliases: parameter -> output updated in place."""
    start = time.perf_counter()
    program = xla.compile(stablehlo, aliases)
    seconds = time.perf_counter() - start
    caches = [example_inputs[parameter] for parameter in aliases]
    report = CompiledGraph(
        seconds=seconds,
        memory=program.memory,
        cost=program.cost,
        cache_bytes=tuple(cache.numel() * cache.element_size() for cache in caches),
        cache_copies=tuple(cache_copies(program.optimized_hlo, {cache.numel() for cache in caches})),
    )
    return program, report
