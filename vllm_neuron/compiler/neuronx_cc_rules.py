"""neuronx-cc's written rules, checked on the StableHLO module TorchNeuron would hand it.

XLA's CPU compiler accepts programs neuronx-cc refuses, so a graph that runs in the rehearsal is not yet a
graph a trn2 compiles. Each rule is one a serving graph can break, with its public source: an AWS error-code
page (awsdocs-neuron.readthedocs-hosted.com, compiler/error-codes/<CODE>.html), an aws-neuron-sdk issue, an
AWS guide, or TorchNeuron's source. docs/research/issue-52-neuronx-cc-rules.md quotes each. Where a rule is
broken, a trn2 `refuses` the graph (neuronx-cc, or TorchNeuron before it), the graph `breaks` there (it
compiles, but computes wrong values or copies whole caches), or the rule `warns` (a risk the sources name
without a refusal). A graph that a trn2 refuses or breaks on fails warm-up; a warning is reported. A broken
rule names itself, the op and the source line of the model or plugin code that made it (where the text
carries locations: `get_asm(enable_debug_info=True)`).

`check` runs at every lowering (stablehlo, xla, lower-only: every engine of the test suite), under
`--dump-graphs` (`NNN-<call>.rules.txt`), in `vllm-neuron check` and in `/v1/neuron/info`
(`lowered_graphs[].neuronx_cc_rules`). Not checked (no static form): out-of-bounds gather and scatter
indices built from an iota (NCC_EVRF031, NCC_EVRF056), instruction counts and memory (NCC_EVRF007,
NCC_EVRF009), and the operator list of the installed compiler (`neuronx-cc list-operators --framework XLA`).
"""

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from kv_cache import fp8_format
from vllm_neuron import trn2
from vllm_neuron.compiler import hlo_text
from vllm_neuron.compiler.hlo_text import Module, Op

E4M3_TYPES = ("f8E4M3FN", "f8E4M3", "f8E4M3FNUZ", "f8E4M3B11FNUZ")
# The two e4m3 kinds neuronx-cc converts between, of which a module may hold one (NCC_EOCP001).
LEGACY_AND_OCP_E4M3 = {"f8E4M3", "f8E4M3FN"}
# Element types a graph's inputs and outputs may have: TorchNeuron's MLIR-to-torch table
# (neuron_dynamo_backend/utils/stablehlo_utils.py MLIR_TO_TORCH_DTYPE); any other raises at compile.
IO_TYPES = frozenset(
    ("f32", "f64", "f16", "bf16", "i64", "i32", "i16", "i8", "i1", "ui8", "ui16", "ui32", "ui64")
    + ("complex<f32>", "complex<f64>", "f8E5M2")
)
# Element types neuronx-cc refuses: the FNUZ kinds (NCC_EVRF005) and float4_e2m1fn (NCC_ESPP004's example).
# Complex is left out: the 2.32 notes add complex64 to about 30 ops, which NCC_EVRF004's page predates.
FOREIGN_TYPES = ("f8E5M2FNUZ", "f8E4M3FNUZ", "f8E4M3B11FNUZ", "f4E2M1FN")
# custom_call targets neuronx-cc recognises (NCC_EVRF015, NCC_EHCA005): a generic `TopK` is not one
# (aws-neuron-sdk#1025).
_NEURON_CALLS = (
    "Erf Gelu GeluApprxTanh GeluBackward Silu SiluBackward RmsNorm Softmax SoftmaxBackward "
    "CollectiveMatmul IntMatmult ArgMax ArgMin TopK DropoutMaskV1 CustomNativeKernel CustomOp DevicePrint "
    "LNCShardingConstraint TransferWithStaticRing"
)
CUSTOM_CALLS = frozenset(f"AwsNeuron{name}" for name in _NEURON_CALLS.split()) | {
    "ResizeNearest",
    "ResizeBilinear",
    "ResizeNearestGrad",
    *(f"AwsNeuronModuleMarker{edge}-{way}" for edge in ("Start", "End") for way in ("Forward", "Backward")),
    "NeuronBoundaryMarker-Start",
    "NeuronBoundaryMarker-End",
}
_INTEGER = re.compile(r"^u?i\d+$")
_WIDE_INTEGER = ("i32", "i64")  # what NCC_EVRF013 and NCC_EVRF035 name
_COMPARE = re.compile(r"stablehlo\.compare\s+(\w+)")


@dataclass(frozen=True)
class Rule:
    code: str  # neuronx-cc's error code, or what names the rule where it has none
    says: str  # what the rule allows
    source: str  # where it is written
    severity: Literal["refuses", "breaks", "warns"] = "refuses"


@dataclass(frozen=True)
class Violation:
    rule: Rule
    op: str
    source: str  # "file:line" of the code that made the op; "" where the text carries no location
    detail: str

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        return f"{self.rule.code} ({self.rule.says}; {self.rule.source}): {self.op}{where}: {self.detail}"


Found = Iterable[tuple[Op | None, str]]


def _top_ks(module: Module) -> Iterable[tuple[Op, int, str]]:
    """The top-ks neuronx-cc compiles, with their k and key type: an explicit one (a TopK custom call, whose
    backend_config is k; chlo.top_k), and a sort whose results only slices read, which neuronx-cc makes its
    own top-k with k the sorted width (aws-neuron-sdk#1339)."""
    for op in module.ops:
        if not op.operand_types:
            continue
        if op.name == "stablehlo.sort" and _only_sliced(module, op):
            dimension = int(re.search(r"dimension = (-?\d+)", op.attributes).group(1))
            shape = op.operand_types[0][0]
            yield op, shape[dimension % len(shape)], op.operand_types[0][1]
        elif op.name == "chlo.top_k":
            yield op, int(re.search(r"k = (\d+)", op.attributes).group(1)), op.operand_types[0][1]
        elif op.name == "stablehlo.custom_call" and "TopK" in op.attributes:
            k = re.search(r'backend_config = "(\d+)"', op.attributes)
            yield op, int(k.group(1)) if k else op.operand_types[0][0][-1], op.operand_types[0][1]


def _top_k_size(module: Module, written: set[int]) -> Found:
    for op, k, _ in _top_ks(module):
        if k > trn2.SORT_LIMIT:
            yield op, f"a top-k of k={k} (at most {trn2.SORT_LIMIT}; a sliced sort's k is its width)"


def _custom_calls(module: Module, written: set[int]) -> Found:
    for op in module.ops:
        if op.name == "stablehlo.custom_call":
            target = re.search(r"@([\w.$-]+)|call_target_name = \"([^\"]+)\"", op.attributes)
            name = next((group for group in target.groups() if group), "") if target else ""
            if name not in CUSTOM_CALLS:
                yield op, f"custom call target {name or '(none)'} is not one neuronx-cc recognises"


def _integer_top_k(module: Module, written: set[int]) -> Found:
    for op, _, key in _top_ks(module):
        if key in _WIDE_INTEGER:
            yield op, f"a top-k of {key} keys"


def _sort_comparator(module: Module, written: set[int]) -> Found:
    for op in module.ops:
        if op.name != "stablehlo.sort":
            continue
        directions = [found.group(1) for line in op.body if (found := _COMPARE.search(line)) is not None]
        if not directions or any(direction not in ("LT", "GT", "LE", "GE") for direction in directions):
            yield op, f"its comparator compares by {', '.join(directions) or 'nothing'}"


def _e4m3fn_flag(module: Module, written: set[int]) -> Found:
    flags = os.environ.get("NEURON_CC_FLAGS", "").split()
    if "f8E4M3FN" in _types(module) and trn2.FP8_COMPILER_OPTION not in flags:
        yield None, f"the module holds f8E4M3FN and NEURON_CC_FLAGS lacks {trn2.FP8_COMPILER_OPTION}"


def _e4m3_range(module: Module, written: set[int]) -> Found:
    for op in module.ops:
        if op.name != "stablehlo.convert" or op.dtype not in E4M3_TYPES or not op.operand_types:
            continue
        if op.operand_types[0][1] in E4M3_TYPES:
            continue
        bound = _bound(module, op.operands[0])
        if bound is None or bound > fp8_format.FP8_MAX:
            said = "unclamped" if bound is None else f"clamped at +-{bound:g}"
            yield op, f"a value {said} becomes {op.dtype} (trn2's e4m3 holds +-{fp8_format.FP8_MAX:g})"


def _one_e4m3_type(module: Module, written: set[int]) -> Found:
    present = sorted(_types(module) & LEGACY_AND_OCP_E4M3)
    if len(present) > 1:
        yield None, f"the module holds {', '.join(present)}"


def _foreign_types(module: Module, written: set[int]) -> Found:
    for op in module.ops:
        found = next((dtype for _, dtype in op.result_types if dtype.startswith(FOREIGN_TYPES)), None)
        if found is not None:
            yield op, f"computes in {found}"


def _static_shapes(module: Module, written: set[int]) -> Found:
    for op in module.ops:
        if any(-1 in shape for shape, _ in op.result_types):
            yield op, "has a dynamic dimension"


def _integer_scatter_compute(module: Module, written: set[int]) -> Found:
    for op in module.ops:
        if op.name == "stablehlo.scatter" and _INTEGER.match(op.dtype) and _computes(op):
            yield op, f"scatters {op.dtype} with a computation ({_computes(op)})"


def _integer_dot(module: Module, written: set[int]) -> Found:
    for op in module.ops:
        dot = op.name in ("stablehlo.dot_general", "stablehlo.dot")
        if dot and op.operand_types and op.operand_types[0][1] in _WIDE_INTEGER:
            yield op, f"multiplies {op.operand_types[0][1]} matrices"


def _variadic_windows(module: Module, written: set[int]) -> Found:
    for op in module.ops:
        if op.name == "stablehlo.reduce_window" and len(op.result_types) > 1:
            yield op, f"reduces {len(op.result_types)} operands at once"


def _variadic_reduce(module: Module, written: set[int]) -> Found:
    for op in module.ops:
        if op.name == "stablehlo.reduce" and len(op.result_types) > 1:
            yield op, f"reduces {len(op.result_types)} operands at once (an argmax or a max with its index)"


def _rng_algorithm(module: Module, written: set[int]) -> Found:
    for op in module.ops:
        if op.name == "stablehlo.rng_bit_generator" and "DEFAULT" not in op.attributes:
            yield op, "a random-number algorithm other than DEFAULT"


def _written_aliased(module: Module, written: set[int]) -> Found:
    for parameter in sorted(written - set(module.aliases)):
        shape, dtype = module.argument_types[parameter]
        size = "x".join(map(str, shape))
        yield None, f"input {parameter} ({size}x{dtype}) is written but not in mhlo.input_output_alias"


def _io_types(module: Module, written: set[int]) -> Found:
    for kind, types in (("input", module.argument_types), ("output", module.output_types)):
        for index, (_, dtype) in enumerate(types):
            if dtype not in IO_TYPES:
                yield None, f"{kind} {index} is {dtype}: TorchNeuron maps no torch dtype to it"


_ERROR_CODES = "AWS Neuron compiler error codes"
# neuronx-cc's integer defaults from the release after 2.32 (its compiler notes): the plugin's Neuron 2.33.
_INTEGER_DEFAULTS = "hard errors by default from Neuron 2.33 (2.32 compiler notes)"
RULES: dict[Rule, Callable[[Module, set[int]], Found]] = {
    Rule("NCC_EVRF014", f"a top-k of k at most {trn2.SORT_LIMIT}", "aws-neuron-sdk#1339"): _top_k_size,
    Rule("NCC_EVRF015", "custom calls neuronx-cc recognises", f"{_ERROR_CODES}; aws-neuron-sdk#1025"): (
        _custom_calls
    ),
    Rule("NCC_EVRF013", "a top-k of floats, not int32 or int64", _ERROR_CODES): _integer_top_k,
    Rule("sort comparator", "a sort compares by LT, GT, LE or GE", "AWS JAX NeuronX known issues"): (
        _sort_comparator
    ),
    Rule("NCC_EVRF051", "f8E4M3FN only with the FP8 option in NEURON_CC_FLAGS", _ERROR_CODES): _e4m3fn_flag,
    Rule(
        "trn2 e4m3 range",
        f"values become e4m3 within +-{fp8_format.FP8_MAX:g} (beyond it: NaN)",
        "AWS neuronx-distributed README_rescaling_fp8_for_neuron.md",
        "breaks",
    ): _e4m3_range,
    Rule("NCC_EOCP001", "one e4m3 kind per module", _ERROR_CODES): _one_e4m3_type,
    Rule("NCC_EVRF005", "element types neuronx-cc compiles", f"{_ERROR_CODES} EVRF005, ESPP004"): (
        _foreign_types
    ),
    Rule("NCC_EMOD025", "static shapes", _ERROR_CODES): _static_shapes,
    Rule("NCC_EVRF060", "no integer scatter with a computation", f"{_ERROR_CODES}; {_INTEGER_DEFAULTS}"): (
        _integer_scatter_compute
    ),
    Rule("NCC_EVRF035", "no int32 or int64 matmul", f"{_ERROR_CODES}; {_INTEGER_DEFAULTS}"): _integer_dot,
    Rule("NCC_EVRF019", "a reduce_window of one operand", _ERROR_CODES): _variadic_windows,
    Rule("NCC_EVRF006", "random numbers by the DEFAULT algorithm", _ERROR_CODES): _rng_algorithm,
    Rule(
        "variadic reduce",
        "a reduce of one operand",
        "AWS JAX NeuronX known issues (unsupported); aws-neuron-sdk#1210 (an argmax compiled for 21 minutes)",
        "warns",
    ): _variadic_reduce,
    Rule(
        "in-place inputs",
        "every input the graph writes is in mhlo.input_output_alias (else a copy of it per call)",
        "torch_neuronx fx/fx_transform.py _set_module_alias",
        "breaks",
    ): _written_aliased,
    Rule(
        "TorchNeuron IO types",
        "graph inputs and outputs of a type TorchNeuron maps to torch",
        "torch_neuronx neuron_dynamo_backend/utils/stablehlo_utils.py",
    ): _io_types,
}


def check(text: str, written: Iterable[int] = ()) -> list[Violation]:
    """The rules a module's text breaks; `written`: the parameter numbers of the inputs the graph writes
    (TorchNeuron's executor binds them in place: aliasing.functionalize_copies)."""
    module = hlo_text.parse(text)
    parameters = set(written)
    return [
        Violation(
            rule, op.name if op is not None else "module", op.location if op is not None else "", detail
        )
        for rule, find in RULES.items()
        for op, detail in find(module, parameters)
    ]


def blocking(violations: list[Violation]) -> list[Violation]:
    """The violations a trn2 refuses or breaks on: warm-up fails on them."""
    return [violation for violation in violations if violation.rule.severity != "warns"]


def report(violations: list[Violation]) -> str:
    """A graph's rule report, as a dumped graph's NNN-<call>.rules.txt holds it."""
    lines = [f"{violation.rule.severity}: {violation}" for violation in violations]
    held = len(RULES) - len({violation.rule for violation in violations})
    return "\n".join([*lines, f"{held} of neuronx-cc's {len(RULES)} rules checked hold."]) + "\n"


def _only_sliced(module: Module, sort: Op) -> bool:
    users = module.users(sort.result)
    return bool(users) and all(user.name == "stablehlo.slice" for user in users)


def _types(module: Module) -> set[str]:
    found = {dtype for _, dtype in (*module.argument_types, *module.output_types)}
    for op in module.ops:
        found.update(dtype for _, dtype in (*op.operand_types, *op.result_types))
    return found


def _computes(op: Op) -> str:
    """The ops of a scatter's update computation other than its return: none for a plain write."""
    return ", ".join(
        re.search(r"= (\S+)", line).group(1) for line in op.body if "=" in line and "return" not in line
    )


_SCALAR = re.compile(r"dense<\[?([-+.\deEinf]+)\]?>")
_PASS_THROUGH = ("stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.convert")


def _constant(module: Module, value: str) -> float | None:
    """A scalar constant's value, through broadcasts, reshapes and conversions; None for anything else."""
    op = module.by_result.get(value)
    while op is not None and op.name in _PASS_THROUGH:
        op = module.by_result.get(op.operands[0])
    if op is None or op.name not in ("stablehlo.constant", "arith.constant"):
        return None
    found = _SCALAR.search(op.attributes)
    return float(found.group(1)) if found else None


def _bound(module: Module, value: str) -> float | None:
    """The largest magnitude a value can have where a clamp by constants made it (torch's clamp lowers to
    stablehlo.clamp); None where nothing bounds it."""
    op = module.by_result.get(value)
    if op is None or op.name != "stablehlo.clamp" or len(op.operands) != 3:
        return None
    low, high = _constant(module, op.operands[0]), _constant(module, op.operands[2])
    return None if low is None or high is None else max(abs(low), abs(high))
