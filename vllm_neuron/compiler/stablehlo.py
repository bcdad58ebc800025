"""The `stablehlo` compile backend: TorchNeuron's route up to StableHLO, on a CPU, then the graph runs here.

TorchNeuron's `neuron` backend (torch_neuronx.neuron_dynamo_backend) takes a dynamo graph through AOTAutograd
with input mutations kept and its own decomposition table, turns the trailing `copy_` of each mutated input
into an extra output aliased to that input (`mhlo.input_output_alias`, must_alias: the runtime passes the
input's buffer as the output, no copy-back), imports the graph with torch-mlir's FX importer down to StableHLO
and hands that to neuronx-cc. This backend walks the same route with the public torch-mlir wheel (and a
clean-up to plain StableHLO, vllm_neuron/compiler/plain_stablehlo.py), so "every graph lowers" is a fact CPU
mode can check. Then, by backend: `stablehlo` runs the functional FX graph that was lowered on the CPU, each
aliased output stored back into its input as the runtime's aliasing would leave it; `xla` has XLA's CPU
compiler compile the StableHLO itself and runs that program, the caches updated in place
(vllm_neuron/compiler/xla_graph.py); `lower-only` runs nothing (calls return zeros) and, where jaxlib is
installed, has XLA compile each graph for its report.

A graph that does not lower raises LoweringError naming the op and the source line that produced it.
"""

import collections
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
from vllm_neuron.compiler import graph_memory
from vllm_neuron.compiler.decompositions import FLASH_CALLS, decomposition_table
from vllm_neuron.compiler.plain_stablehlo import NotStableHLOError, make_plain
from vllm_neuron.compiler.top_k import restore_top_k
from vllm_neuron.compiler.xla_graph import CompiledGraph, compile_graph
from vllm_neuron.upstream import torch_compile

if TYPE_CHECKING:
    from vllm_neuron.compiler import xla

aten = torch.ops.aten
# Ops whose result is the same buffer as their first argument, reshaped.
_VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class LoweringError(RuntimeError):
    """A graph that TorchNeuron's route (torch-mlir to StableHLO) cannot lower. The message names the call,
    the op and the source line; so do the attributes, for `vllm-neuron check`'s report."""

    def __init__(self, message: str, *, call: str = "", op: str = "", source: str = "") -> None:
        super().__init__(message)
        self.call, self.op, self.source = call, op, source


@dataclass(frozen=True)
class Alias:
    """Output `output` of the lowered function is input `parameter`'s buffer, updated in place."""

    parameter: int
    output: int


@dataclass
class LoweredGraph:
    """What a Neuron engineer asks of a graph: how long it took to lower, its size, its largest tensor."""

    label: str
    seconds: float
    stablehlo: str
    aliases: list[Alias]
    largest_tensor: tuple[tuple[int, ...], str]  # shape and dtype of the largest intermediate
    scratchpad_bytes: int  # peak of live intermediates (graph_memory.scratchpad_bytes)
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
            "flash_attention": self.flash_attention,
            "aliased_inputs": [alias.parameter for alias in self.aliases],
            "collectives": len(self.collectives),
            **(self.compiled.summary() if self.compiled is not None else {}),
        }


def alias_mutated_inputs(gm: torch.fx.GraphModule) -> list[Alias]:
    """TorchNeuron's functionalize-copy pass: each trailing `aten.copy_(input, value)` that AOTAutograd left
    for a mutated input is removed and `value` becomes an extra output aliased to that input. Returns the
    aliases; the graph is then stateless (what torch-mlir's stateless importer requires)."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    output = next(node for node in gm.graph.nodes if node.op == "output")
    results = list(output.args[0])
    aliases: list[Alias] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy_.default:
            continue
        target, value = node.args[0], node.args[1]
        if target.op != "placeholder":
            raise LoweringError(f"in-place copy into {target} (not a graph input): {_source_line(node)}")
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
        aliases.append(Alias(placeholders.index(target), len(results)))
        results.append(value)
    output.args = (tuple(results),)
    gm.graph.lint()
    gm.recompile()
    return aliases


_ALIAS_ENTRY = (
    '{{alias = {{kind = "must_alias", parameter_index = array<i64>, parameter_number = {parameter} : i64}}, '
    "output_index = array<i64: {output}>}}"
)


def alias_attribute(aliases: list[Alias]) -> str:
    """The module attribute `mhlo.input_output_alias` as TorchNeuron writes it."""
    entries = ", ".join(_ALIAS_ENTRY.format(parameter=a.parameter, output=a.output) for a in aliases)
    return f"[{entries}]"


def _source_line(node: torch.fx.Node) -> str:
    """The innermost frame of model or plugin code that produced `node` ("file:line in function"), its file as
    found in any installation: from the package down (vllm/...) or from this repository's root."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', node.meta.get("stack_trace") or "")
    if not frames:
        return "(no source line recorded)"
    path, line, function = frames[-1]
    path = path.split("site-packages/", 1)[-1].removeprefix(f"{_REPOSITORY}/")
    return f"{path}:{line} in {function}"


_REPOSITORY = str(Path(__file__).resolve().parents[1])


_FAILED_OP = re.compile(r"(?:failed to legalize operation|unsupported.*?op(?:eration)?) '?([\w.]+)'?")


def _failed_op(message: str) -> str | None:
    found = _FAILED_OP.search(message)
    return found.group(1) if found else None


def _untyped_input_user(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The first op that takes a graph input torch-mlir cannot give a type (not a tensor or a number: an
    opaque object such as a custom op's handle)."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and not isinstance(value, torch.Tensor | int | float | bool):
            return next(iter(node.users), None)
    return None


def _op_name(node: torch.fx.Node) -> str:
    """The op a node runs; for a custom op that mutates its inputs, the op auto_functionalized wraps."""
    if "auto_functionalized" in str(node.target) and node.args:
        return str(node.args[0])
    return str(node.target)


def _explain(message: str, gm: torch.fx.GraphModule, label: str) -> LoweringError:
    """A lowering failure, with the op and the source line of the FX node that produced it."""
    op = _failed_op(message)
    node = None
    if op is not None:
        # torch-mlir names ops torch.aten.<name>[.<overload>]; FX names them aten.<name>.<overload>.
        wanted = op.removeprefix("torch.")
        node = next(
            (n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith(wanted)), None
        )
    elif "Could not deduce type" in message:
        node = _untyped_input_user(gm)
        op = _op_name(node) if node is not None else None
    where = _source_line(node) if node is not None else "(op not found in the FX graph)"
    said = "\n".join(message.strip().splitlines()[:12])
    return LoweringError(
        f"{label}: does not lower to StableHLO: op {op or 'unknown'} from {where}. torch-mlir said:\n{said}",
        call=label,
        op=op or "unknown",
        source=where,
    )


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


def op_histogram(stablehlo: str) -> dict[str, int]:
    counts = collections.Counter(_OP.findall(stablehlo))
    return dict(counts.most_common())


_c10d = torch.ops._c10d_functional


def _stand_in_collectives(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
    """The graph to lower, with tensor-parallel collectives replaced by local ops of the same shape.

    TorchNeuron lowers `_c10d_functional` collectives with its own MLIR pipeline (after giving each its
    replica groups), which the public torch-mlir lacks; torch-mlir alone refuses them. So the rest of the
    graph is proven here, and the collectives are listed by kind (LoweredGraph.collectives). `gm` itself,
    which runs, keeps them."""
    kinds = [
        str(node.target)
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target in _STAND_INS
    ]
    if not kinds:
        return gm, []
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        stand_in = _STAND_INS.get(node.target) if node.op == "call_function" else None
        if stand_in is None:
            continue
        with graph.inserting_before(node):
            replacement = stand_in(graph, node)
        if replacement is not node.args[0]:
            replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph), [kind for kind in kinds if "wait_tensor" not in kind]


def _gathered(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    return graph.call_function(aten.cat.default, ([node.args[0]] * node.args[1], 0))


def _scattered(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    value = node.meta["val"]
    return graph.call_function(aten.slice.Tensor, (node.args[0], 0, 0, value.shape[0]))


_STAND_INS = {
    _c10d.all_reduce.default: lambda graph, node: node.args[0],
    _c10d.wait_tensor.default: lambda graph, node: node.args[0],
    _c10d.all_gather_into_tensor.default: _gathered,
    _c10d.reduce_scatter_tensor.default: _scattered,
}


def _flash_shapes(calls: list[tuple[int, int, bool]]) -> set[tuple[int, int]]:
    """(query length, key length) of the attentions the flash kernel takes, where no attention of the same
    lengths is left to the math."""
    return {(q, k) for q, k, takes in calls if takes} - {(q, k) for q, k, takes in calls if not takes}


def lower(
    gm: torch.fx.GraphModule, label: str, flash_calls: list[tuple[int, int, bool]] | None = None
) -> LoweredGraph:
    """Strip the mutations into aliased outputs and import the graph to StableHLO with torch-mlir.
    flash_calls: the graph's attentions as its decompositions recorded them (decompositions.FLASH_CALLS)."""
    flash_calls = flash_calls or []
    from torch_mlir import fx as mlir_fx
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_dialect
    from torch_mlir.extras.fx_importer import FxImporter

    start = time.perf_counter()
    aliases = alias_mutated_inputs(gm)
    lowered_gm, collectives = _stand_in_collectives(gm)
    context = ir.Context()
    torch_dialect.register_dialect(context)
    diagnostics: list[str] = []

    def keep(diagnostic) -> bool:  # collected for the error, instead of printed to stderr
        diagnostics.append(diagnostic.message)
        return True

    context.attach_diagnostic_handler(keep)
    try:
        module = mlir_fx.stateless_fx_import(
            lowered_gm, output_type="stablehlo", fx_importer=FxImporter(context=context), model_name="main"
        )
    except Exception as error:  # torch-mlir raises plain RuntimeError / MLIRError subclasses
        raise _explain("\n".join([*diagnostics, str(error)]), gm, label) from error
    try:
        make_plain(module)
    except NotStableHLOError as error:
        raise LoweringError(f"{label}: {error}", call=label, op=str(error).split(": ", 1)[-1]) from error
    restore_top_k(module)
    if aliases:
        with module.context:
            module.operation.attributes["mhlo.input_output_alias"] = ir.Attribute.parse(
                alias_attribute(aliases)
            )
    text = str(module)
    return LoweredGraph(
        label=label,
        seconds=time.perf_counter() - start,
        stablehlo=text,
        aliases=aliases,
        largest_tensor=_largest_tensor(gm, aliases, _flash_shapes(flash_calls)),
        scratchpad_bytes=graph_memory.scratchpad_bytes(text),
        flash_attention=sum(takes for *_, takes in flash_calls),
        op_histogram=op_histogram(text),
        collectives=collectives,
    )


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


def _run_with_aliases(gm: torch.fx.GraphModule, aliases: list[Alias]) -> Callable:
    """The lowered graph's semantics on the CPU: the functional graph (its cache writes made in place where
    that is safe), then each aliased output stored into its input's buffer (what must_alias means at run
    time; a no-op where the write already went there)."""
    for alias in aliases:
        _write_in_place(gm, alias)
    extra = len(aliases)

    def run(args: list[Any]) -> list[Any]:
        outputs = gm(*args)
        for alias in aliases:
            args[alias.parameter].copy_(outputs[alias.output])
        return list(outputs[: len(outputs) - extra])

    return torch_compile.boxed(run)


def _zeros_instead(gm: torch.fx.GraphModule, aliases: list[Alias]) -> Callable:
    """The call's outputs as zeros of their shapes and dtypes, the graph not run, the caches untouched: only
    the lowering is wanted (`vllm-neuron check`; a large model's buckets would take minutes each to compute
    on a CPU)."""
    output = next(node for node in gm.graph.nodes if node.op == "output")
    results = list(output.args[0])
    values = [node.meta["val"] for node in results[: len(results) - len(aliases)]]

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

        def fw_compiler(aot_gm: torch.fx.GraphModule, aot_inputs: list[Any]) -> Callable:
            fx_text = aot_gm.print_readable(print_output=False)
            lowered = lower(aot_gm, label, list(FLASH_CALLS.calls))
            if self.execute == "xla" and lowered.collectives:
                raise LoweringError(
                    f"{label}: the xla backend runs one rank; a graph with collectives "
                    f"({', '.join(sorted(set(lowered.collectives)))}) runs under the stablehlo backend "
                    "(VLLM_NEURON_COMPILE_BACKEND=stablehlo)",
                    call=label,
                )
            program = None
            if self.execute == "xla" or self._xla_reports:
                aliases = {alias.parameter: alias.output for alias in lowered.aliases}
                program, lowered.compiled = compile_graph(lowered.stablehlo, aliases, aot_inputs, call)
            self.graphs.append(lowered)
            if self.dump_dir is not None:
                self._dump(len(self.graphs) - 1, lowered, fx_text, program)
            if self.execute == "xla":
                lowered.program = program
                return torch_compile.boxed(lambda args: program.run(args))
            if self.execute == "none":
                return _zeros_instead(aot_gm, lowered.aliases)
            return _run_with_aliases(aot_gm, lowered.aliases)

        FLASH_CALLS.calls.clear()
        return torch_compile.aot_autograd(
            fw_compiler=fw_compiler,
            keep_inference_input_mutations=True,
            decompositions=self._decompositions,
        )(gm, example_inputs)

    def _dump(self, index: int, lowered: LoweredGraph, fx_text: str, program: "xla.Program | None") -> None:
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{index:03d}-" + re.sub(r"[^A-Za-z0-9]+", "-", lowered.label).strip("-")
        (self.dump_dir / f"{stem}.fx.txt").write_text(fx_text)
        (self.dump_dir / f"{stem}.stablehlo.mlir").write_text(lowered.stablehlo)
        if program is not None:
            (self.dump_dir / f"{stem}.xla.hlo.txt").write_text(program.optimized_hlo)
