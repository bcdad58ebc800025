"""The `stablehlo` compile backend: TorchNeuron's route up to StableHLO, on a CPU, then the graph runs here.

TorchNeuron's `neuron` backend (torch_neuronx/neuron_dynamo_backend/backend.py) runs, for each dynamo graph:
its aliasing analysis of that graph (vllm_neuron/compiler/aliasing.py); AOTAutograd with input mutations kept
and its decomposition table (vllm_neuron/compiler/decompositions.py); its post-AOTAutograd pass that turns
each trailing `copy_` into a mutated input into an output placed first; torch-mlir's FX importer down to
StableHLO; and the module attribute `mhlo.input_output_alias` from the analysis alone. The model of the
module it then hands neuronx-cc is `LoweredGraph.stablehlo` here (TorchNeuron's raw-dialect pass and its
other post-AOTAutograd passes aside: docs/lowering.md), checked against neuronx-cc's written rules
(vllm_neuron/compiler/neuronx_cc_rules.py). The plugin makes no rewrite of that module.

Then, by backend: `stablehlo` runs the functional FX graph that was lowered on the CPU, each mutated input
stored back as TorchNeuron's executor binds it; `xla` has XLA's CPU compiler compile and run the module, after
XLA's own preparation (`LoweredGraph.xla_stablehlo`: plain StableHLO, vllm_neuron/compiler/plain_stablehlo.py,
and neuronx-cc's own sort-to-top-k rewrite, vllm_neuron/compiler/top_k.py), the caches updated in place
(vllm_neuron/compiler/xla_graph.py); `lower-only` runs nothing (calls return zeros) and, where jaxlib is
installed, has XLA compile each graph for its report.

A graph that does not lower, or that breaks a rule of neuronx-cc's, raises LoweringError naming the op and the
source line that produced it.
"""

import collections
import functools
import importlib.util
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from vllm_neuron.calls import Call
from vllm_neuron.compiler import aliasing, graph_memory, neuronx_cc_rules
from vllm_neuron.compiler.aliasing import Alias
from vllm_neuron.compiler.decompositions import FLASH_CALLS, decomposition_table
from vllm_neuron.compiler.neuronx_cc_rules import Violation
from vllm_neuron.compiler.plain_stablehlo import NotStableHLOError, make_plain
from vllm_neuron.compiler.top_k import restore_top_k
from vllm_neuron.compiler.torch_mlir_import import LoweringError, RuleError, import_stablehlo
from vllm_neuron.compiler.xla_graph import CompiledGraph, compile_graph
from vllm_neuron.upstream import torch_compile

if TYPE_CHECKING:
    from vllm_neuron.compiler import xla

aten = torch.ops.aten
# Ops whose result is the same buffer as their first argument, reshaped.
_VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclass
class LoweredGraph:
    """What a Neuron engineer asks of a graph: how long it took to lower, its size, its largest tensor, what
    it updates in place, and which of neuronx-cc's rules it breaks."""

    label: str
    seconds: float
    stablehlo: str  # the module TorchNeuron hands neuronx-cc
    aliases: list[Alias]  # its mhlo.input_output_alias (from TorchNeuron's analysis of the dynamo graph)
    written: list[Alias]  # every input the graph writes, as TorchNeuron's executor binds it
    largest_tensor: tuple[tuple[int, ...], str]  # shape and dtype of the largest intermediate
    scratchpad_bytes: int  # peak of live intermediates (graph_memory.scratchpad_bytes)
    input_bytes: int = 0  # the call's own inputs (call_io_bytes)
    output_bytes: int = 0  # the values it returns beside its in-place writes (call_io_bytes)
    xla_stablehlo: str = ""  # the module after XLA's preparation (what the `xla` backend compiles)
    broken_rules: list[Violation] = field(default_factory=list)  # neuronx-cc's rules it breaks
    flash_attention: int = 0  # attentions TorchNeuron hands its flash kernel (decompositions.FLASH_CALLS)
    op_histogram: dict[str, int] = field(default_factory=dict)
    collectives: list[str] = field(default_factory=list)  # lowered by TorchNeuron's own pipeline
    compiled: "CompiledGraph | None" = None  # what XLA made of it (the `xla` backend)
    program: "xla.Program | None" = None  # what runs it (the `xla` backend)

    @property
    def op_count(self) -> int:
        return sum(self.op_histogram.values())

    @property
    def largest_tensor_bytes(self) -> int:
        shape, dtype = self.largest_tensor
        return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()

    def summary(self) -> dict[str, object]:
        shape, dtype = self.largest_tensor
        return {
            "call": self.label,
            "lowering_seconds": round(self.seconds, 3),
            "stablehlo_ops": self.op_count,
            "largest_tensor": {"shape": list(shape), "dtype": dtype, "bytes": self.largest_tensor_bytes},
            "scratchpad_bytes": self.scratchpad_bytes,
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "flash_attention": self.flash_attention,
            "aliased_inputs": [alias.parameter for alias in self.aliases],
            "written_inputs": [alias.parameter for alias in self.written],
            "neuronx_cc_rules": {
                "checked": len(neuronx_cc_rules.RULES),
                "broken": [str(violation) for violation in self.broken_rules],
            },
            "collectives": len(self.collectives),
            **(self.compiled.summary() if self.compiled is not None else {}),
        }


_CPU_ATTENTION = str(aten._scaled_dot_product_flash_attention_for_cpu.default)


def _largest_tensor(
    gm: torch.fx.GraphModule, aliases: list[Alias], flash: set[tuple[int, int]]
) -> tuple[tuple[int, ...], str]:
    """Shape and dtype of the largest tensor the graph computes, leaving out the aliased inputs' own buffers
    (their views and their in-place writes), and the scores of attentions TorchNeuron's flash kernel
    computes in its tiles (`flash`: their query and key lengths): what a compile must find room for beside
    the inputs."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    buffers = {placeholders[alias.parameter] for alias in aliases}
    best: tuple[int, tuple[int, ...], str] = (0, (), "float32")
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" or not isinstance(value, torch.Tensor):
            continue
        # Not identity: the OpOverload that tracing records is not always the object aten.<op> gives.
        in_kernel = str(node.meta.get("original_aten")) == _CPU_ATTENTION
        if in_kernel and tuple(value.shape[-2:]) in flash:
            continue
        if node.target in (*_VIEW_OPS, aten.scatter.src) and node.args[0] in buffers:
            buffers.add(node)
            continue
        size = value.numel() * value.element_size()
        if size > best[0]:
            best = (size, tuple(value.shape), str(value.dtype).removeprefix("torch."))
    return best[1], best[2]


_OP = re.compile(r"=\s+(?:\"?)((?:stablehlo|chlo|func|tensor|arith)\.[\w.]+)")


# Dynamo's names of what the model holds rather than what a call passes: parameters, buffers, and the tensors
# its modules keep as attributes (KV caches, LoRA slots), all reached through `self`; and the KV caches NIXL's
# block copies are handed as `kv_caches` (worker/kv/nixl_blocks.py).
_MODEL_STATE = re.compile(r"^l_self_|_parameters_|_buffers_|^l_kv_caches_")


def model_state(gm: torch.fx.GraphModule) -> set[int]:
    """Positions of the dynamo graph's inputs that the model holds (_MODEL_STATE); AOTAutograd keeps the
    order."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    return {index for index, node in enumerate(placeholders) if _MODEL_STATE.search(node.name)}


def call_io_bytes(gm: torch.fx.GraphModule, written: list[Alias], state: set[int]) -> tuple[int, int]:
    """Bytes of a call's own inputs (not the model's state, not the inputs it writes) and of the values it
    returns beside those writes: the device tensors TorchNeuron takes and allocates for each call."""

    def size(node: object) -> int:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0

    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    skipped = state | {alias.parameter for alias in written}
    inputs = sum(size(node) for index, node in enumerate(placeholders) if index not in skipped)
    output = next(node for node in gm.graph.nodes if node.op == "output")
    writes = {alias.output for alias in written}
    outputs = sum(size(node) for index, node in enumerate(output.args[0]) if index not in writes)
    return inputs, outputs


def op_histogram(stablehlo: str) -> dict[str, int]:
    counts = collections.Counter(_OP.findall(stablehlo))
    return dict(counts.most_common())


def _flash_shapes(calls: list[tuple[int, int, bool]]) -> set[tuple[int, int]]:
    """(query length, key length) of the attentions the flash kernel takes, where no attention of the same
    lengths is left to the math."""
    return {(q, k) for q, k, takes in calls if takes} - {(q, k) for q, k, takes in calls if not takes}


def lower(
    gm: torch.fx.GraphModule,
    label: str,
    analysed: list[Alias],
    flash_calls: list[tuple[int, int, bool]] | None = None,
    state: set[int] | None = None,
) -> LoweredGraph:
    """TorchNeuron's stages after AOTAutograd: its copy_ pass, torch-mlir's import, the alias attribute from
    its analysis of the dynamo graph (`analysed`, aliasing.analyse); then neuronx-cc's rules, and XLA's
    preparation of a copy. flash_calls: the graph's attentions as its decompositions recorded them
    (decompositions.FLASH_CALLS); state: the inputs the model holds (model_state of the dynamo graph)."""
    from torch_mlir import ir

    flash_calls = flash_calls or []
    start = time.perf_counter()
    written = aliasing.functionalize_copies(gm)
    module, collectives = import_stablehlo(gm, label)
    main = ir.FunctionType(module.body.operations[0].type)
    aliases = aliasing.kept(analysed, _types(main.inputs), _types(main.results))
    with module.context:  # written even when empty, as TorchNeuron writes it
        module.operation.attributes["mhlo.input_output_alias"] = ir.Attribute.parse(
            aliasing.alias_attribute(aliases, len(main.results))
        )
    text = str(module)
    broken = neuronx_cc_rules.check(
        module.operation.get_asm(enable_debug_info=True), [alias.parameter for alias in written]
    )
    try:
        make_plain(module)
    except NotStableHLOError as error:
        raise LoweringError(f"{label}: {error}", call=label, op=str(error).split(": ", 1)[-1]) from error
    restore_top_k(module)
    input_bytes, output_bytes = call_io_bytes(gm, written, state or set())
    return LoweredGraph(
        label=label,
        seconds=time.perf_counter() - start,
        stablehlo=text,
        aliases=aliases,
        written=written,
        largest_tensor=_largest_tensor(gm, written, _flash_shapes(flash_calls)),
        scratchpad_bytes=graph_memory.scratchpad_bytes(text),
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        xla_stablehlo=str(module),
        broken_rules=broken,
        flash_attention=sum(takes for *_, takes in flash_calls),
        op_histogram=op_histogram(text),
        collectives=collectives,
    )


def _types(types: list) -> list[aliasing.TensorType]:
    """Shapes and element types of a function's arguments or results (MLIR types)."""
    from torch_mlir import ir

    return [(tuple(ir.RankedTensorType(t).shape), str(ir.RankedTensorType(t).element_type)) for t in types]


def _write_in_place(gm: torch.fx.GraphModule, alias: Alias) -> bool:
    """Make the one scatter that writes an aliased input write into the input's own buffer, as a must_alias
    output does on the device: without it, CPU runs copy the whole cache twice per layer. Only where the
    graph reads nothing of the input after the scatter (what the aliasing check demands anyway)."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    output = next(node for node in gm.graph.nodes if node.op == "output")
    node = output.args[0][alias.output]
    while node.op == "call_function" and node.target in _VIEW_OPS:
        node = node.args[0]
    if node.op != "call_function" or node.target is not aten.scatter.src:
        return False
    scatter, before = node, []
    node = scatter.args[0]
    while node.op == "call_function" and node.target in _VIEW_OPS:
        before.append(node)
        node = node.args[0]
    if node is not placeholders[alias.parameter]:
        return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    later_reads = [
        user
        for n in [node, *before]
        for user in n.users
        if user is not scatter and order[user] > order[scatter]
    ]
    if later_reads:
        return False
    scatter.target = aten.scatter_.src
    gm.recompile()
    return True


def _run_with_aliases(gm: torch.fx.GraphModule, written: list[Alias]) -> Callable:
    """The lowered graph's semantics on the CPU: the functional graph (its cache writes made in place where
    that is safe), then each written input's new value stored into its buffer, as TorchNeuron's executor
    binds it (a no-op where the write already went there); the other outputs returned."""
    for alias in written:
        _write_in_place(gm, alias)

    def run(args: list[Any]) -> list[Any]:
        outputs = gm(*args)
        for alias in written:
            args[alias.parameter].copy_(outputs[alias.output])
        return list(outputs[len(written) :])

    return torch_compile.boxed(run)


def _run_program(program: "xla.Program", lowered: LoweredGraph) -> Callable:
    """XLA's program of the graph: the aliased inputs donated and updated in place; an input the graph
    writes without an alias comes back as an output of its own, stored into its buffer (TorchNeuron's
    executor binds it as the output's buffer, which the NEFF was not compiled to share)."""
    aliased = {alias.output for alias in lowered.aliases}
    copies = tuple((a.parameter, a.output) for a in lowered.written if a.output not in aliased)
    return torch_compile.boxed(functools.partial(program.run_graph, len(lowered.written), copies))


def _zeros_instead(gm: torch.fx.GraphModule, written: list[Alias]) -> Callable:
    """The call's outputs as zeros of their shapes and dtypes, the graph not run, the caches untouched: only
    the lowering is wanted (`vllm-neuron check`; a large model's buckets would take minutes each to compute
    on a CPU)."""
    output = next(node for node in gm.graph.nodes if node.op == "output")
    values = [node.meta["val"] for node in list(output.args[0])[len(written) :]]

    def run(args: list[Any]) -> list[Any]:
        return [torch.zeros(value.shape, dtype=value.dtype, device=value.device) for value in values]

    return torch_compile.boxed(run)


# How a lowered graph runs: its functional FX graph on the CPU (`stablehlo`), XLA's program compiled from the
# StableHLO itself (`xla`), or not at all (`lower-only`).
Execution = Literal["fx", "xla", "none"]


class StableHLOBackend:
    """torch.compile backend: AOTAutograd (mutations kept, TorchNeuron's decompositions), then `lower`.

    `label` names the next graph (the call being compiled); every lowered graph is kept in `graphs`, and
    written to `dump_dir` (FX graph, StableHLO, and XLA's optimised HLO) when one is given. `execute`: how
    each graph runs (Execution); with "none" (the `lower-only` backend) calls return zeros, and XLA compiles
    each graph for its report (`LoweredGraph.compiled`) where jaxlib is installed."""

    def __init__(self, dump_dir: Path | None = None, *, execute: Execution = "fx") -> None:
        self.dump_dir = dump_dir
        self.execute = execute
        self.label = ""
        self.call: Call | None = None  # the call the next graph is traced for, where known
        self.graphs: list[LoweredGraph] = []
        self._decompositions = decomposition_table()
        # `lower-only` (`vllm-neuron check`) reports what XLA makes of each graph where XLA is installed.
        self._xla_reports = execute == "none" and importlib.util.find_spec("jaxlib") is not None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        label, call = self.label or f"graph {len(self.graphs)}", self.call
        analysed = aliasing.analyse(gm)  # before AOTAutograd, on dynamo's graph, as TorchNeuron does
        state = model_state(gm)  # dynamo's names say which inputs the model holds

        def fw_compiler(aot_gm: torch.fx.GraphModule, aot_inputs: list[Any]) -> Callable:
            fx_text = aot_gm.print_readable(print_output=False)
            lowered = lower(aot_gm, label, analysed, list(FLASH_CALLS.calls), state)
            self.graphs.append(lowered)
            if self.dump_dir is not None:
                self._dump(len(self.graphs) - 1, lowered, fx_text)
            refused = neuronx_cc_rules.blocking(lowered.broken_rules)
            if refused:
                raise RuleError(
                    f"{label}: a trn2 would refuse this graph or run it wrong:\n"
                    + "\n".join(f"  {violation.rule.severity}: {violation}" for violation in refused),
                    call=label,
                    op=refused[0].op,
                    source=refused[0].source,
                )
            if self.execute == "xla" and lowered.collectives:
                raise LoweringError(
                    f"{label}: the xla backend runs one rank; a graph with collectives "
                    f"({', '.join(sorted(set(lowered.collectives)))}) runs under the stablehlo backend "
                    "(VLLM_NEURON_COMPILE_BACKEND=stablehlo)",
                    call=label,
                )
            if self.execute == "xla" or self._xla_reports:
                aliases = {alias.parameter: alias.output for alias in lowered.aliases}
                lowered.program, lowered.compiled = compile_graph(
                    lowered.xla_stablehlo, aliases, aot_inputs, call
                )
                if self.dump_dir is not None:
                    self._dump_xla(len(self.graphs) - 1, lowered)
            if self.execute == "xla":
                return _run_program(lowered.program, lowered)
            if self.execute == "none":
                return _zeros_instead(aot_gm, lowered.written)
            return _run_with_aliases(aot_gm, lowered.written)

        FLASH_CALLS.calls.clear()
        return torch_compile.aot_autograd(
            fw_compiler=fw_compiler,
            keep_inference_input_mutations=True,
            decompositions=self._decompositions,
        )(gm, example_inputs)

    def _stem(self, index: int, lowered: LoweredGraph) -> Path:
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        return self.dump_dir / (f"{index:03d}-" + re.sub(r"[^A-Za-z0-9]+", "-", lowered.label).strip("-"))

    def _dump(self, index: int, lowered: LoweredGraph, fx_text: str) -> None:
        """The graph AOTAutograd made, the module neuronx-cc would get, and the rules it breaks."""
        stem = self._stem(index, lowered)
        stem.with_suffix(".fx.txt").write_text(fx_text)
        stem.with_suffix(".stablehlo.mlir").write_text(lowered.stablehlo)
        stem.with_suffix(".rules.txt").write_text(neuronx_cc_rules.report(lowered.broken_rules))

    def _dump_xla(self, index: int, lowered: LoweredGraph) -> None:
        """XLA's optimised HLO of the graph."""
        self._stem(index, lowered).with_suffix(".xla.hlo.txt").write_text(lowered.program.optimized_hlo)
