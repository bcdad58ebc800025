"""The clean-up between torch-mlir's import and a StableHLO compiler: torch-mlir's ops of other dialects.

torch-mlir's TorchToStablehlo conversion leaves two kinds of op outside StableHLO, and XLA (like any
StableHLO consumer but an MLIR pipeline) refuses the module with either:
- `arith.constant`: the graph's scalar literals (an epsilon, a scale, a dtype's limit). Each becomes a
  `stablehlo.constant` of the same value and type.
- `tensor.empty`: an uninitialised buffer the graph reads, such as vLLM model code that fills a
  `torch.empty_like` tensor slice by slice (MiniCPM3's keys). Any value is a valid reading of such a buffer;
  it becomes a `stablehlo.constant` of zeros. The plugin's own code reads none (the attention backend
  writes vLLM's output buffer in one copy), so its graphs need this only for such model code.
Anything else outside StableHLO is an error naming the op.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_mlir import ir

# Module structure around the StableHLO ops.
_STRUCTURE = {"builtin.module", "func.func", "func.return"}
_REWRITTEN = {"arith.constant", "tensor.empty"}


class NotStableHLOError(RuntimeError):
    """A lowered module with ops of other dialects than StableHLO."""


def make_plain(module: "ir.Module") -> dict[str, int]:
    """Rewrite `module` in place to plain StableHLO; returns how many ops of each kind were rewritten.
    Raises NotStableHLOError naming any other op that is not StableHLO."""
    from torch_mlir import ir

    rewritten: list[ir.Operation] = []
    foreign: dict[str, int] = {}

    def visit(op: ir.Operation) -> ir.WalkResult:
        name = op.name
        if name in _REWRITTEN:
            rewritten.append(op)
        elif not name.startswith("stablehlo.") and name not in _STRUCTURE:
            foreign[name] = foreign.get(name, 0) + 1
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    if foreign:
        listed = ", ".join(f"{name} x{count}" for name, count in sorted(foreign.items()))
        raise NotStableHLOError(f"ops outside StableHLO after lowering: {listed}")
    counts: dict[str, int] = {}
    with module.context:
        for op in rewritten:
            with ir.InsertionPoint(op), op.location:
                value = op.attributes["value"] if op.name == "arith.constant" else _zeros(op.result.type)
                replacement = ir.Operation.create(
                    "stablehlo.constant", results=[op.result.type], attributes={"value": value}
                )
            op.result.replace_all_uses_with(replacement.result)
            counts[op.name] = counts.get(op.name, 0) + 1
            op.erase()
    return counts


def _zeros(tensor_type: "ir.Type") -> "ir.Attribute":
    from torch_mlir import ir

    shaped = ir.RankedTensorType(tensor_type)
    element = shaped.element_type
    if element.typeid == ir.IntegerType.static_typeid:  # booleans (i1) and integers
        zero = ir.IntegerAttr.get(element, 0)
    else:
        zero = ir.FloatAttr.get(element, 0.0)
    return ir.DenseElementsAttr.get_splat(shaped, zero)
