"""The graph reserve: device memory a rank's compiled graphs take beside the weights and the KV cache, derived
from the graphs' lowered StableHLO by the rule AWS documents ("Neuron Device Memory", neuron-runtime docs):

- one scratchpad shared by every loaded NEFF, the size of the largest one's, rounded up to scratchpad pages;
- per graph, for as long as it is loaded: its code, its constants and its DMA rings;
- per NeuronCore: the runtime's micro-code and bookkeeping;
and beside those, TorchNeuron's allocations for the calls: each call's outputs (logits among them), for
every call of the steps in flight, and the staging buffers the calls' inputs are packed into (a call reads
its inputs there: they are not allocated per call).

A graph's scratchpad is estimated as the peak of its live intermediates with the StableHLO's ops run in order
(`scratchpad_bytes`); inputs, outputs and constants are not in it. neuronx-cc fuses, tiles and reorders, so
this is an estimate of the right order and growth (it grows with the buckets), not neuronx-cc's figure. A
graph's own size is what the compiler wrote once it has compiled (the NEFFs on Trainium), PER_GRAPH_BYTES
before. The fixed figures below are not derivable on a CPU; each says where it comes from.
docs/check.md#graph-reserve says all this for users.

The KV cache is sized before warm-up compiles anything, so start-up uses a figure derived earlier for the same
configuration: `record` keeps one in the compile cache root whenever every graph was lowered (`vllm-neuron
check`, or a start-up whose backend lowers) or compiled on Trainium (the NEFFs' size in place of the
estimate), and `planned` reads it back. VLLM_NEURON_GRAPH_RESERVE_BYTES, where set, wins; with neither, the
cold default.
"""

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_neuron import envs, trn2
from vllm_neuron.calls import most_calls_per_step
from vllm_neuron.compiler import compile_cache, hlo_text
from vllm_neuron.config import NeuronConfig
from vllm_neuron.graph_plan import staging_refused
from vllm_neuron.refusals import speculative_method

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.vllm_neuron.compiler.graph_memory")

MIB = 2**20
# Shared scratchpad page where NEURON_SCRATCHPAD_PAGE_SIZE (MB) is unset: AWS's documented 512 MB. A fork of
# AWS's plugin inferred 64 MiB pages on runtime 2.34 (docs/research/issue-37-trn2-claims.md, section 6), so
# this may over-round by up to 448 MiB.
DEFAULT_PAGE_BYTES = 512 * MIB
# Code, constants and DMA rings of one loaded graph, plus the runtime's 4 MiB per graph. From the fork's
# measurement: 15 graphs held 1305.8 MiB per rank; less its 72 MiB fixed, 15 x 4 MiB per graph and a
# 576-768 MiB scratchpad, 27-40 MiB per graph remain. The upper reading, rounded up. Not measured here.
PER_GRAPH_BYTES = 44 * MIB
# Per rank: the runtime's fixed 72 MiB (the fork's measurement) and AWS's documented 96 MB of micro-code per
# physical NeuronCore, LNC of them per rank (whether the fork's 72 MiB already held it is not known).
RUNTIME_BYTES = 72 * MIB + trn2.LNC * 96 * 10**6
# The runtime's own per loaded graph (the fork's reading), beside what the compiler wrote for it.
PER_GRAPH_RUNTIME_BYTES = 4 * MIB
# Async scheduling (vLLM's default) keeps two steps' calls on the device: the one running and the one before,
# whose outputs the engine has not taken yet. Without it (a draft model turns it off) one.
STEPS_IN_FLIGHT = 2
# Threads that send calls, each with a staging buffer per input layout: the engine thread and the device
# thread, beside the background compile workers.
CALLING_THREADS = 2
# Background compile workers where the host's are not known (`vllm-neuron check` on a CPU for a trn2): the
# most worker/background.compile_workers starts by default on Trainium.
DEFAULT_COMPILE_WORKERS = 8
# What the compiler wrote, by backend; a trn2 start-up takes only a NEFF's size (planned).
NEFF, XLA_EXECUTABLE = "NEFF", "XLA executable"

# Values that name an operand's buffer rather than make one (hlo_text's views), and constants (the NEFF's).
_NO_BUFFER = {"stablehlo.reshape", "stablehlo.bitcast_convert", "stablehlo.constant"}
_ELEMENT_BYTES = {"i1": 1, "i8": 1, "ui8": 1, "i16": 2, "ui16": 2, "f16": 2, "bf16": 2, "f64": 8, "i64": 8}


def element_bytes(dtype: str) -> int:
    """Bytes of one element of a StableHLO element type (4 for f32, i32 and anything not listed)."""
    return _ELEMENT_BYTES.get(dtype, 4)


def scratchpad_bytes(stablehlo: str) -> int:
    """The peak bytes of intermediates live at once when the entry function's ops run in order: each op's
    result from its op to its last use (a view keeps its operand alive). Not counted: the inputs, the
    aliased inputs' in-place writes, the returned values and constants."""
    module = hlo_text.parse(stablehlo)
    outside = hlo_text.aliased_buffers(module) | set(module.arguments) | set(module.returned)
    root: dict[str, str] = {}  # a view -> the value whose buffer it names
    for op in module.ops:
        if op.name in _NO_BUFFER and op.operands:
            root[op.result] = root.get(op.operands[0], op.operands[0])
    outside |= {view for view, base in root.items() if base in outside}
    last_use: dict[str, int] = {}
    for op in module.ops:
        for operand in op.operands:
            last_use[root.get(operand, operand)] = op.index
    freed_at: dict[int, list[int]] = {}
    live = peak = 0
    for op in module.ops:
        if op.name not in _NO_BUFFER and op.result not in outside:
            size = op.numel * element_bytes(op.dtype)
            live += size
            freed_at.setdefault(max(last_use.get(op.result, op.index), op.index), []).append(size)
        peak = max(peak, live)
        live -= sum(freed_at.pop(op.index, []))
    return peak


def page_bytes() -> int:
    """The shared scratchpad's page: NEURON_SCRATCHPAD_PAGE_SIZE (MB, as the runtime reads it), else 512."""
    value = os.environ.get("NEURON_SCRATCHPAD_PAGE_SIZE", "").strip()
    return int(value) * MIB if value else DEFAULT_PAGE_BYTES


@dataclass(frozen=True)
class GraphReserve:
    """The reserve a set of lowered graphs needs on one rank, and what it is made of. The fields after `page`
    default for records written before them: such a record reads with no call IO or staging (its other terms
    still hold, and are nearer the need than the cold default) until the graphs are lowered again."""

    graphs: int
    largest_scratchpad: int  # the largest graph's scratchpad estimate
    largest_call: str  # the call whose graph that is
    page: int
    largest_outputs: int = 0  # the largest call's outputs (output_bytes)
    largest_outputs_call: str = ""
    calls_per_step: int = 0  # calls.most_calls_per_step
    steps_in_flight: int = STEPS_IN_FLIGHT  # 1 without async scheduling
    inputs: int = 0  # every graph's input_bytes: one staging buffer each, per calling thread
    calling_threads: int = 0
    compiled: int = 0  # bytes the compiler wrote for the graphs; 0: not compiled yet, PER_GRAPH_BYTES each
    compiled_by: str = ""  # NEFF or XLA_EXECUTABLE

    @property
    def scratchpad(self) -> int:
        return math.ceil(self.largest_scratchpad / self.page) * self.page

    @property
    def resident(self) -> int:
        if self.compiled:
            return self.compiled + self.graphs * PER_GRAPH_RUNTIME_BYTES
        return self.graphs * PER_GRAPH_BYTES

    @property
    def in_flight(self) -> int:
        """The calls' outputs on the device at once: each call of the steps in flight counted at the largest
        call's."""
        return self.largest_outputs * self.steps_in_flight * self.calls_per_step

    @property
    def staging(self) -> int:
        return self.inputs * self.calling_threads

    @property
    def total(self) -> int:
        return self.scratchpad + self.resident + self.in_flight + self.staging + RUNTIME_BYTES

    def _describe_resident(self) -> str:
        if self.compiled:
            return (
                f"{self.graphs} graphs' {self.compiled_by}s {self.compiled / MIB:.1f} MiB + {self.graphs} x "
                f"{PER_GRAPH_RUNTIME_BYTES / MIB:.0f} MiB"
            )
        return f"{self.graphs} graphs x {PER_GRAPH_BYTES / MIB:.0f} MiB (not compiled yet: an estimate)"

    def describe(self) -> str:
        return (
            f"{self.total / trn2.GIB:.2f} GiB = shared scratchpad {self.scratchpad / MIB:.0f} MiB (largest "
            f"graph's live intermediates {self.largest_scratchpad / MIB:.1f} MiB, {self.largest_call}, in "
            f"{self.page / MIB:.0f} MiB pages) + {self._describe_resident()} + calls' outputs "
            f"{self.in_flight / MIB:.1f} MiB (largest {self.largest_outputs / MIB:.2f} MiB, "
            f"{self.largest_outputs_call}, x {self.steps_in_flight} steps x {self.calls_per_step} calls) + "
            f"staging {self.staging / MIB:.1f} MiB (inputs {self.inputs / MIB:.2f} MiB x "
            f"{self.calling_threads} calling threads) + runtime {RUNTIME_BYTES / MIB:.0f} MiB"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "scratchpad": self.scratchpad,
            "per_graph": PER_GRAPH_BYTES,
            "resident": self.resident,
            "in_flight": self.in_flight,
            "staging": self.staging,
            "runtime": RUNTIME_BYTES,
            "total": self.total,
        }

    def with_compiled(self, compiled: int, compiled_by: str) -> "GraphReserve":
        """This reserve with the graphs' size as the compiler wrote them in place of the estimate."""
        return replace(self, compiled=compiled, compiled_by=compiled_by)


def derive_for(
    vllm_config: "VllmConfig", graphs: Sequence[dict[str, object]], compile_workers: int
) -> GraphReserve:
    """`derive` for a configuration: the most calls of a step (calls.most_calls_per_step, under staged
    readiness where the configuration allows it, whatever VLLM_NEURON_READINESS says now: the record serves
    every start of it), the steps in flight (async scheduling), and compile_workers, which send calls only
    where graphs compile in background threads (one rank)."""
    scheduler = vllm_config.scheduler_config
    neuron_config = NeuronConfig.of(vllm_config)
    one_rank = vllm_config.parallel_config.tensor_parallel_size == 1
    calls = most_calls_per_step(
        neuron_config.buckets,
        neuron_config.max_num_seqs,
        scheduler.max_num_batched_tokens,
        staged=staging_refused(one_rank, vllm_config.kv_transfer_config is not None) is None,
        draft_model=speculative_method(vllm_config) == "draft_model",
        head=speculative_method(vllm_config) == "eagle3",
    )
    steps = STEPS_IN_FLIGHT if scheduler.async_scheduling else 1
    return derive(graphs, calls, compile_workers if one_rank else 0, steps)


def derive(
    graphs: Sequence[dict[str, object]],
    calls_per_step: int,
    compile_workers: int = DEFAULT_COMPILE_WORKERS,
    steps_in_flight: int = STEPS_IN_FLIGHT,
) -> GraphReserve:
    """The reserve of every graph a rank loads, from their summaries (LoweredGraph.summary); calls_per_step:
    calls.most_calls_per_step of the configuration; compile_workers: the background compiles that send calls
    beside the engine and device threads."""
    largest = max(graphs, key=lambda graph: graph["scratchpad_bytes"])
    outputs = max(graphs, key=lambda graph: graph["output_bytes"])
    return GraphReserve(
        len(graphs),
        int(largest["scratchpad_bytes"]),
        str(largest["call"]),
        page_bytes(),
        largest_outputs=int(outputs["output_bytes"]),
        largest_outputs_call=str(outputs["call"]),
        calls_per_step=calls_per_step,
        steps_in_flight=steps_in_flight,
        inputs=sum(int(graph["input_bytes"]) for graph in graphs),
        calling_threads=CALLING_THREADS + compile_workers,
    )


_FIELDS = [field.name for field in dataclass_fields(GraphReserve)]


EXPLICIT = "VLLM_NEURON_GRAPH_RESERVE_BYTES"


@dataclass(frozen=True)
class Reserve:
    """What start-up keeps free for the graphs, and why that much."""

    bytes: int
    source: str  # EXPLICIT, "derived" or "cold default"
    derived: GraphReserve | None = None

    def describe(self) -> str:
        figure = f"{self.bytes / trn2.GIB:.2f} GiB"
        if self.source == "derived":
            return f"{figure}, derived from this configuration's lowered graphs: {self.derived.describe()}"
        if self.source == "cold default":
            return (
                f"{figure}, the cold default: no graphs of this configuration lowered yet (`vllm-neuron "
                "check` with the same options and VLLM_NEURON_CACHE_ROOT derives it)"
            )
        derived = f" (the lowered graphs need {self.derived.describe()})" if self.derived else ""
        return f"{figure}, set by VLLM_NEURON_GRAPH_RESERVE_BYTES{derived}"

    def as_dict(self) -> dict[str, object]:
        derived = self.derived.as_dict() if self.derived is not None else None
        return {"bytes": self.bytes, "source": self.source, "derived": derived}


def _record_path(root: Path, fields: dict[str, object]) -> Path:
    return root / "graph-reserve" / f"{compile_cache.configuration_key(fields)}.json"


def record(fields: dict[str, object], reserve: GraphReserve) -> GraphReserve:
    """Keep a derived reserve under the compile cache root for the configuration `fields` describes
    (compile_cache.key_fields), whatever host lowered it, and return what was kept: where a trn2 start
    recorded its NEFFs' size and `reserve` has none, `reserve` with that measurement in place of its estimate
    (the same configuration compiles the same graphs). Written atomically: pods may share the root."""
    previous = recorded(fields)
    if previous is not None and previous.compiled_by == NEFF and reserve.compiled_by != NEFF:
        reserve = reserve.with_compiled(previous.compiled, NEFF)
    path = _record_path(compile_cache.cache_root(), fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(asdict(reserve)))
    partial.replace(path)
    return reserve


def recorded(fields: dict[str, object]) -> GraphReserve | None:
    path = _record_path(compile_cache.cache_root(), fields)
    try:
        values = json.loads(path.read_text())
        return GraphReserve(**{name: values[name] for name in _FIELDS if name in values})
    except (OSError, ValueError, TypeError):
        return None


def planned(fields: dict[str, object]) -> Reserve:
    """The reserve start-up sizes the KV cache with: VLLM_NEURON_GRAPH_RESERVE_BYTES where set, else the one
    derived for this configuration, else the cold default."""
    explicit = envs.VLLM_NEURON_GRAPH_RESERVE_BYTES
    if explicit is not None:
        return Reserve(explicit, EXPLICIT)
    derived = recorded(fields)
    if derived is not None and derived.compiled_by not in ("", NEFF):
        derived = derived.with_compiled(0, "")  # an executable XLA compiled for a CPU says nothing of a NEFF
    if derived is not None:
        return Reserve(derived.total, "derived", derived)
    return Reserve(trn2.COLD_GRAPH_RESERVE_BYTES, "cold default")


def shortfall(reserve: Reserve, derived: GraphReserve) -> str | None:
    """Why the reserve start-up kept is below what the lowered graphs need, or None if it is not."""
    if derived.total <= reserve.bytes:
        return None
    return (
        f"the compiled graphs need about {derived.describe()}, more than the {reserve.bytes / trn2.GIB:.2f} "
        f"GiB reserved ({reserve.source}) when the KV cache was sized. If graph loads fail out of memory, "
        "restart: the derived figure is recorded and used next time"
        + (", once VLLM_NEURON_GRAPH_RESERVE_BYTES is unset or raised" if reserve.source == EXPLICIT else "")
        + "; or lower VLLM_NEURON_KV_CACHE_FRACTION"
    )
