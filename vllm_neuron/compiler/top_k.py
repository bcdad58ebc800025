"""The sampler's top-k as a top-k: torch-mlir's form of `aten.topk` turned back into `chlo.top_k`.

torch-mlir has no StableHLO conversion for `aten.topk`: its DecomposeAtenTopkOp makes it a `stablehlo.sort`
of the whole row (values with an iota of their indices, descending, unstable) and a slice of the first k.
For the sampler's [rows, vocab] logits that is a sort of the vocabulary per row, in every graph. This pass
finds exactly that shape and puts back `chlo.top_k` (StableHLO's top-k; XLA legalises it to its TopK
instruction), which is also stable: on equal values the lower index comes first.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_mlir import ir


def restore_top_k(module: "ir.Module") -> int:
    """Rewrite each sort-then-slice top-k in `module` in place as a `chlo.top_k`; returns how many."""
    from torch_mlir import ir

    sorts: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "stablehlo.sort":
            sorts.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    rewritten = 0
    with module.context:
        for sort in sorts:
            k = _top_k_of(sort)
            if k is not None:
                _replace(sort, k)
                rewritten += 1
    return rewritten


def _top_k_of(sort: "ir.Operation") -> int | None:
    """k, when `sort` is a top-k as torch-mlir decomposes one: two operands (values, then an iota of the
    sorted dimension), the last dimension, a greater-than comparator on the values, and each result used
    only by slices of the first k along that dimension (the whole of every other one)."""
    from torch_mlir import ir

    if len(sort.operands) != 2 or len(sort.results) != 2:
        return None
    values, indices = sort.operands
    rank = ir.RankedTensorType(values.type).rank
    dimension = ir.IntegerAttr(sort.attributes["dimension"]).value
    source = indices.owner
    if (
        dimension != rank - 1
        or not isinstance(source, ir.OpView | ir.Operation)
        or source.name != "stablehlo.iota"
        or ir.IntegerAttr(source.attributes["iota_dimension"]).value != dimension
        or not _descending(sort)
    ):
        return None
    limits = set()
    shape = list(ir.RankedTensorType(values.type).shape)
    for result in sort.results:
        for use in result.uses:
            user = use.owner
            if user.name != "stablehlo.slice":
                return None
            starts = list(_ints(user.attributes["start_indices"]))
            ends = list(_ints(user.attributes["limit_indices"]))
            strides = list(_ints(user.attributes["strides"]))
            if any(starts) or any(s != 1 for s in strides) or ends[:-1] != shape[:-1]:
                return None
            limits.add(ends[-1])
    return limits.pop() if len(limits) == 1 else None


def _descending(sort: "ir.Operation") -> bool:
    """The comparator is `compare GT` of the two values (the first block arguments), and nothing else."""
    from torch_mlir import ir

    block = sort.regions[0].blocks[0]
    ops = list(block.operations)
    if len(ops) != 2 or ops[0].name != "stablehlo.compare" or ops[1].name != "stablehlo.return":
        return False
    compare = ops[0]
    direction = str(compare.attributes["comparison_direction"])
    operands = list(compare.operands)
    return (
        "GT" in direction
        and ir.BlockArgument(operands[0]).arg_number == 0
        and ir.BlockArgument(operands[1]).arg_number == 1
    )


def _ints(attribute: "ir.Attribute") -> list[int]:
    from torch_mlir import ir

    return list(ir.DenseI64ArrayAttr(attribute))


def _replace(sort: "ir.Operation", k: int) -> None:
    """`chlo.top_k` of the sort's values; its i32 indices converted to the iota's type; the slices, the
    sort and the iota removed."""
    from torch_mlir import ir

    values, indices = sort.operands[0], sort.operands[1]
    values_type = ir.RankedTensorType(values.type)
    shape = [*values_type.shape[:-1], k]
    index_type = ir.RankedTensorType(indices.type).element_type
    i32 = ir.IntegerType.get_signless(32)
    with ir.InsertionPoint(sort), sort.location:
        top_k = ir.Operation.create(
            "chlo.top_k",
            results=[
                ir.RankedTensorType.get(shape, values_type.element_type),
                ir.RankedTensorType.get(shape, i32),
            ],
            operands=[values],
            attributes={"k": ir.IntegerAttr.get(ir.IntegerType.get_signless(64), k)},
        )
        top_ids = top_k.results[1]
        if index_type != i32:
            top_ids = ir.Operation.create(
                "stablehlo.convert", results=[ir.RankedTensorType.get(shape, index_type)], operands=[top_ids]
            ).result
    for result, replacement in zip(sort.results, (top_k.results[0], top_ids), strict=True):
        for use in list(result.uses):
            user = use.owner
            user.results[0].replace_all_uses_with(replacement)
            user.erase()
    iota = indices.owner
    sort.erase()
    if not list(iota.results[0].uses):
        iota.erase()
