"""Reads a StableHLO module's text (as `str(module)` prints it, or with locations) into its entry function's
ops, their types and the source line of each, which neuronx-cc's rules read (neuronx_cc_rules.py); and checks
how the module updates its aliased inputs.

A Neuron compile can keep the KV cache in place only when the graph writes it the way TorchNeuron aliases it:
the cache parameter flows through reshapes into one `stablehlo.scatter` of the step's new rows, and the
result is the output aliased to the parameter, with no other op making a tensor the size of a cache or of
half of one (a select, concatenate, dynamic_update_slice or second scatter would be such a copy), and no read
of the old cache after the write (which forces the compiler to keep both). Necessary, not sufficient:
neuronx-cc may still copy, but this is what can be proven without it.
"""

import math
import re
from dataclasses import dataclass, field

from vllm_neuron.compiler.torch_mlir_import import short_path

_TENSOR = re.compile(r"tensor<((?:\d+x|\?x)*)(complex<\w+>|\w+)>")
_DEFINITION = re.compile(r'^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*"?([\w.]+)"?(.*)$')
_VALUE = re.compile(r"%[\w.$-]+")
_ARGUMENT = re.compile(r"(%arg\d+): tensor<((?:\d+x|\?x)*)(complex<\w+>|\w+)>")
_ALIAS = re.compile(r"parameter_number = (\d+) : s?i64\}, output_index = array<i64(?:: (\d+))?>")
# Locations, where the module was printed with them (`get_asm(enable_debug_info=True)`).
_LOC_USE = re.compile(r"\s*loc\((#loc\d*|\"[^\"]*\":\d+:\d+)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)$", re.M)
_FILE_LOC = re.compile(r"\"([^\"]+)\":(\d+):\d+")

Type = tuple[tuple[int, ...], str]  # shape (-1: a dynamic dimension) and element type


@dataclass
class Op:
    index: int
    result: str
    name: str
    operands: list[str]
    shape: tuple[int, ...]
    dtype: str = ""  # element type as StableHLO spells it (f32, bf16, i64, i1, ...)
    attributes: str = ""  # the text between the op's name and its types (operands and attributes)
    operand_types: list[Type] = field(default_factory=list)
    result_types: list[Type] = field(default_factory=list)
    body: list[str] = field(default_factory=list)  # the text of its region's ops (a sort's comparator)
    location: str = ""  # "file:line" of the code that made it, where the text has locations

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Module:
    """The entry function of a StableHLO module: its arguments, ops in order, returned values, aliases."""

    arguments: dict[str, tuple[int, ...]]
    ops: list[Op]
    returned: list[str]
    aliases: dict[int, int]  # parameter number -> output index
    argument_types: list[Type] = field(default_factory=list)
    output_types: list[Type] = field(default_factory=list)
    by_result: dict[str, Op] = field(init=False)

    def __post_init__(self) -> None:
        self.by_result = {op.result: op for op in self.ops}

    def users(self, value: str) -> list[Op]:
        return [op for op in self.ops if value in op.operands]


def _shape(dims: str) -> tuple[int, ...]:
    return tuple(-1 if d == "?" else int(d) for d in dims.split("x") if d)


def types(text: str) -> list[Type]:
    return [(_shape(dims), dtype) for dims, dtype in _TENSOR.findall(text)]


def parse(text: str) -> Module:
    lines = text.splitlines()
    locations = {
        name: f"{short_path(found.group(1))}:{found.group(2)}"
        for name, body in _LOC_DEF.findall(text)
        if (found := _FILE_LOC.search(body)) is not None
    }
    header = next(line for line in lines if "func.func @" in line)
    signature, _, results = header.partition(") -> ")
    arguments = {name: _shape(dims) for name, dims, _ in _ARGUMENT.findall(signature)}
    aliases = {int(p): int(o or 0) for p, o in _ALIAS.findall(text)}
    ops: list[Op] = []
    returned: list[str] = []
    # An op whose region is open: its types follow the region (`"stablehlo.sort"(...) ({ ... }) : types`), or
    # came before it (`stablehlo.reduce(...) : types` then `reducer(...) { ... }`).
    pending: Op | None = None
    types_after = False
    depth = 0
    for line in lines[lines.index(header) + 1 :]:
        opens = line.count("{") - line.count("}")
        if pending is not None:
            depth += opens
            if depth > 0:
                pending.body.append(line.strip())
            elif types_after:
                _finish(pending, line[line.rfind("})") + 2 :], locations)
            if depth <= 0:
                pending = None
            continue
        stripped = line.strip()
        if stripped.startswith(("return ", "func.return ")):
            returned = _VALUE.findall(stripped.split(":")[0])
            continue
        found = _DEFINITION.match(line)
        if found is None:
            if opens > 0 and ops:  # a region of the op before
                pending, types_after, depth = ops[-1], False, opens
            continue
        result, name, rest = found.groups()
        head = rest.split("({")[0]
        operands = _VALUE.findall(head.split(" : ")[0])
        op = Op(len(ops), result, name, operands, (), attributes=head)
        ops.append(op)
        if "({" in rest:  # the types follow the region
            pending, types_after, depth = op, True, opens
            continue
        op.attributes = head.rsplit(" : ", 1)[0]
        _finish(op, rest, locations)
    return Module(arguments, ops, returned, aliases, types(signature), types(results.split(" {")[0]))


def _finish(op: Op, text: str, locations: dict[str, str]) -> None:
    """An op's types and location, from the text after its operands (or after its region)."""
    location = _LOC_USE.search(text)
    if location is not None:
        key = location.group(1)
        inline = _FILE_LOC.search(key)  # a location printed where it is used, not by its #loc name
        op.location = f"{short_path(inline.group(1))}:{inline.group(2)}" if inline else locations.get(key, "")
        text = text[: location.start()]
    signature = text.rsplit(" : ", 1)[-1] if " : " in text else text
    before, arrow, after = signature.partition("->")
    op.operand_types = types(before) if arrow else []
    op.result_types = types(after) if arrow else types(before)
    if op.result_types:
        op.shape, op.dtype = op.result_types[-1]


_VIEWS = {"stablehlo.reshape", "stablehlo.bitcast_convert"}


@dataclass
class CacheWrite:
    """How one aliased parameter is updated: the scatters of its value chain and what else is wrong."""

    parameter: int
    shape: tuple[int, ...]
    scatters: list[tuple[int, ...]]  # the updates' shape of each scatter into the cache
    problems: list[str]


def is_cache(shape: tuple[int, ...]) -> bool:
    """Whether a buffer a graph updates in place is a cache, kept in place like the KV caches: every one is
    but the token slots (worker/step/step_state.py), a vector. An EAGLE3 head's hidden slots
    (worker/spec_decode/head_inputs.py) are one, a matrix."""
    return len(shape) > 1


def is_kv_cache(shape: tuple[int, ...]) -> bool:
    """Whether a cache is a KV cache: [2 x KV heads, blocks, block size, head size]."""
    return len(shape) == 4


def cache_writes(text: str) -> list[CacheWrite]:
    """For each aliased KV cache (and an EAGLE3 head's hidden slots, a matrix; not the token slots, a
    vector): follow it through reshapes and scatters to the aliased output, and name what else touches it
    or copies a tensor of a cache's size. A cache is written once a call, or once a pass where a call runs
    several passes over one layer (an EAGLE3 head's propose call): each scatter writes the newest value, and
    nothing reads an older one after it."""
    module = parse(text)
    chains = _chains(module)
    buffers = aliased_buffers(module, chains)
    writes = []
    for parameter, (versions, scatters) in chains.items():
        shape = module.arguments[f"%arg{parameter}"]
        if not is_cache(shape):
            continue
        numel = math.prod(shape)
        problems = [
            f"{op.name} ({op.result}) makes a tensor of {op.shape}: a copy of a whole cache or half of one"
            for op in module.ops
            if is_kv_cache(shape) and op.numel in (numel, numel // 2) and op.result not in buffers
        ]
        if not scatters:
            problems.append("no scatter into the cache")
        for version, write in zip(versions, scatters, strict=False):
            if write.operands[0] not in version:
                problems.append(f"{write.name} ({write.result}) writes an older value of the cache")
            problems += [
                f"{op.name} ({op.result}) reads the cache after its write"
                for op in module.ops
                if op.index > write.index and version.intersection(op.operands)
            ]
            updates = _updates_shape(module, write)
            if is_kv_cache(shape) and math.prod(updates) * 2 >= numel:
                problems.append(f"the scatter's updates {updates} are as large as the cache")
        output = module.aliases[parameter]
        if output >= len(module.returned) or module.returned[output] not in versions[-1]:
            problems.append(f"output {output} is not the written cache")
        writes.append(CacheWrite(parameter, shape, [_updates_shape(module, op) for op in scatters], problems))
    return writes


def _chains(module: Module) -> dict[int, tuple[list[set[str]], list[Op]]]:
    return {parameter: _chain(module, f"%arg{parameter}") for parameter in sorted(module.aliases)}


def aliased_buffers(module: Module, chains: dict | None = None) -> set[str]:
    """The values that are an aliased input's own buffer: its views and its in-place writes."""
    chains = _chains(module) if chains is None else chains
    return set().union(*(value for versions, _ in chains.values() for value in versions))


def _chain(module: Module, argument: str) -> tuple[list[set[str]], list[Op]]:
    """The parameter's values and their views, one set per write (the parameter's own first), and the
    scatters between them."""
    versions: list[set[str]] = [{argument}]
    scatters: list[Op] = []
    for op in module.ops:
        written = next((version for version in versions if op.operands and op.operands[0] in version), None)
        if written is None:
            continue
        if op.name in _VIEWS:
            written.add(op.result)
        elif op.name == "stablehlo.scatter":
            scatters.append(op)
            versions.append({op.result})
    return versions, scatters


def _updates_shape(module: Module, scatter: Op) -> tuple[int, ...]:
    updates = module.by_result.get(scatter.operands[2])
    return updates.shape if updates is not None else module.arguments.get(scatter.operands[2], ())
