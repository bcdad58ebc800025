"""The clean-up between torch-mlir's import and a StableHLO compiler: torch-mlir's ops of other dialects.

torch-mlir's TorchToStablehlo conversion materialises the graph's scalar literals (an epsilon, a scale, a
dtype's limit) as `arith.constant` tensors, which no StableHLO consumer other than an MLIR pipeline takes:
XLA refuses the module. They become `stablehlo.constant`s of the same value and type (the same op in
StableHLO's own dialect). Anything else left outside StableHLO (`tensor.empty` for an uninitialised buffer,
say) is not rewritten here: it is an error naming the op, so the traced code is fixed instead (a program
for neuronx-cc should not depend on a rewrite the real pipeline may not make).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_mlir import ir

# Module structure around the StableHLO ops.
_STRUCTURE = {"builtin.module", "func.func", "func.return"}


class NotStableHLOError(RuntimeError):
    """A lowered module with ops of other dialects than StableHLO."""


def make_plain(module: "ir.Module") -> int:
    """Rewrite `module` in place to plain StableHLO; returns how many constants were rewritten. Raises
    NotStableHLOError naming any other op that is not StableHLO."""
    from torch_mlir import ir

    constants: list[ir.Operation] = []
    foreign: dict[str, int] = {}

    def visit(op: ir.Operation) -> ir.WalkResult:
        name = op.name
        if name == "arith.constant":
            constants.append(op)
        elif not name.startswith("stablehlo.") and name not in _STRUCTURE:
            foreign[name] = foreign.get(name, 0) + 1
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    if foreign:
        listed = ", ".join(f"{name} x{count}" for name, count in sorted(foreign.items()))
        raise NotStableHLOError(f"ops outside StableHLO after lowering: {listed}")
    with module.context:
        for op in constants:
            value = op.attributes["value"]
            with ir.InsertionPoint(op), op.location:
                replacement = ir.Operation.create(
                    "stablehlo.constant", results=[op.result.type], attributes={"value": value}
                )
            op.result.replace_all_uses_with(replacement.result)
            op.erase()
    return len(constants)
