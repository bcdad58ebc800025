"""torch-mlir's import of a graph that AOTAutograd made stateless, down to StableHLO, as TorchNeuron runs it
(torch_neuronx/neuron_dynamo_backend/fx/fx_transform.py `convert_fx_to_stablehlo`), with the public wheel:
and what a failure names (the op, the source line that produced it, the call).

Two differences from TorchNeuron's own import, both of what the public torch-mlir lacks: TorchNeuron runs its
own pass over the raw Torch dialect (`torch-raw-to-neuron-backend-pipeline`) and lowers `_c10d_functional`
collectives with it, after giving each its replica groups. Here each collective is a local op of the same
shape in the copy that is imported (`LoweredGraph.collectives` lists them); the graph that runs keeps them.
"""

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

aten = torch.ops.aten

if TYPE_CHECKING:
    from torch_mlir import ir


class LoweringError(RuntimeError):
    """A graph that TorchNeuron's route (torch-mlir to StableHLO) cannot lower. The message names the call,
    the op and the source line; so do the attributes, for `vllm-neuron check`'s report."""

    def __init__(self, message: str, *, call: str = "", op: str = "", source: str = "") -> None:
        super().__init__(message)
        self.call, self.op, self.source = call, op, source


class RuleError(LoweringError):
    """A graph that lowers but that neuronx-cc would refuse: the rules it breaks (neuronx_cc_rules.py)."""


def short_path(path: str) -> str:
    """A source file as found in any installation: from the package down (vllm/...) or from this
    repository's root."""
    return path.split("site-packages/", 1)[-1].removeprefix(f"{_REPOSITORY}/")


def source_line(node: torch.fx.Node) -> str:
    """The innermost frame of model or plugin code that produced `node` ("file:line in function"), its file as
    found in any installation: from the package down (vllm/...) or from this repository's root."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', node.meta.get("stack_trace") or "")
    if not frames:
        return "(no source line recorded)"
    path, line, function = frames[-1]
    return f"{short_path(path)}:{line} in {function}"


_REPOSITORY = str(Path(__file__).resolve().parents[2])


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


def explain(message: str, gm: torch.fx.GraphModule, label: str) -> LoweringError:
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
    where = source_line(node) if node is not None else "(op not found in the FX graph)"
    said = "\n".join(message.strip().splitlines()[:12])
    return LoweringError(
        f"{label}: does not lower to StableHLO: op {op or 'unknown'} from {where}. torch-mlir said:\n{said}",
        call=label,
        op=op or "unknown",
        source=where,
    )


_c10d = torch.ops._c10d_functional


def stand_in_collectives(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
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


def import_stablehlo(gm: torch.fx.GraphModule, label: str) -> tuple["ir.Module", list[str]]:
    """The StableHLO module of a stateless ATen graph, and the collectives stood in for. Raises
    LoweringError naming the op and its source line."""
    from torch_mlir import fx as mlir_fx
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_dialect
    from torch_mlir.extras.fx_importer import FxImporter

    lowered_gm, collectives = stand_in_collectives(gm)
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
        raise explain("\n".join([*diagnostics, str(error)]), gm, label) from error
    return module, collectives
