"""Which inputs a graph updates in place, found as TorchNeuron finds them: the two passes of its `neuron`
backend that decide a NEFF's `mhlo.input_output_alias` and what its executor binds in place.

TorchNeuron (torch_neuronx/neuron_dynamo_backend; the snapshot docs/research/issue-52-neuronx-cc-rules.md
cites):
- Before AOTAutograd (`fx/passes/aliasing_analysis.py`, run by `preprocessing_pipeline.preprocess_graph` in
  `backend.py`), on the graph dynamo hands the backend: an input is mutated where an `operator.setitem`, an
  in-place method call (`call_method` whose name ends in `_`) or an op whose schema writes an argument
  (`Tensor(a!)`) reaches it through views (slicing `getitem`s, view methods, view functions). Mutated inputs
  become outputs 0..n-1, in input order; the other outputs follow. That list, and nothing else, becomes the
  module's `mhlo.input_output_alias` (`fx/fx_transform.py _set_module_alias`; an entry whose input and output
  differ in shape or element type is dropped, one whose index is out of range raises). What the analysis
  does not see is compiled without an alias.
- After AOTAutograd (`fx/passes/functionalize_copy_inplace_result.py`): each copy into an input (a call whose
  name holds `copy_`) that AOTAutograd left for a mutated input (`keep_inference_input_mutations=True`) is
  removed and its value put first among the outputs. The executor binds each such output to its input's buffer
  (`executor.py`, `mutation_info`), alias or not.

The rules here are those passes' rules, written for this plugin, not copied: a graph whose cache write the
analysis cannot see (a plain function in place of the in-place calls) gets no alias here, as on a trn2.
"""

import operator
from dataclasses import dataclass

import torch

from vllm_neuron.compiler.torch_mlir_import import LoweringError

aten = torch.ops.aten

# Views the analysis follows back to their source, as method calls and as functions (torch.* or aten.*).
_VIEW_METHODS = frozenset((
    "t", "transpose", "view", "slice", "reshape", "permute", "expand", "expand_as", "squeeze", "unsqueeze",
    "mH", "mT", "as_strided", "chunk", "unfold", "narrow", "split", "unbind", "select", "unflatten",
    "flatten",
))  # fmt: skip
_VIEW_FUNCTIONS = frozenset((
    "view", "reshape", "transpose", "permute", "t", "squeeze", "unsqueeze", "expand", "slice", "select",
    "narrow", "chunk", "split", "unbind", "as_strided", "unfold", "flatten", "unflatten", "_unsafe_view",
    "view_as", "reshape_as", "expand_as",
))  # fmt: skip


class AliasingError(LoweringError):
    """A graph the analysis cannot number as TorchNeuron would (two inputs with one name)."""


@dataclass(frozen=True)
class Alias:
    """Output `output` of the lowered function is input `parameter`'s buffer, updated in place."""

    parameter: int
    output: int


def _input_name(node: torch.fx.Node) -> str:
    """A dynamo placeholder's name as the analysis keys its inputs (`L_self_modules_a_parameters_w_` is
    `a.w`, `L_self_buffers_b_` is `b`, `L_x_` is `x`)."""
    target = node.target if isinstance(node.target, str) else node.name
    if "parameters" in target:
        return target.replace("L_self_modules_", "").replace("_parameters_", ".").rstrip("_")
    if "buffers" in target:
        return target.replace("L_self_buffers_", "").rstrip("_")
    if target.startswith("L_") and "self" not in target:
        return target[2:].rstrip("_")
    return target.rstrip("_")


def _is_view(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return any(
            isinstance(a, slice) or (isinstance(a, tuple | list) and any(isinstance(b, slice) for b in a))
            for a in node.args
        )
    name = getattr(node.target, "__name__", str(node.target))
    if "aten" in str(getattr(node.target, "__module__", "")):
        name = name.split(".")[0]
    return name in _VIEW_FUNCTIONS


def _is_in_place(node: torch.fx.Node) -> bool:
    if node.op == "call_function":
        return node.target is operator.setitem
    return node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_")


def _written_arguments(node: torch.fx.Node) -> list[object]:
    """The arguments an op's schema declares it writes (`Tensor(a!)`), as the node passes them."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(
                node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
            )
    return written


def _root(node: object, inputs: dict[torch.fx.Node, int]) -> int | None:
    """The input a value is a view of (itself included), by the analysis's rule; None otherwise."""
    seen: set[torch.fx.Node] = set()
    while isinstance(node, torch.fx.Node) and node not in seen:
        if node in inputs:
            return inputs[node]
        seen.add(node)
        if not _is_view(node) or not node.args:
            return None
        node = node.args[0]
    return None


def analyse(gm: torch.fx.GraphModule) -> list[Alias]:
    """TorchNeuron's aliasing analysis of a dynamo graph, numbered as AOTAutograd numbers the outputs after
    it (mutated inputs first, in input order): the module's `mhlo.input_output_alias` entries."""
    # Keyed by name, as TorchNeuron keys them: one whose name cleans to nothing is no input to it.
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder" and _input_name(node)]
    names = [_input_name(node) for node in placeholders]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise AliasingError(
            f"inputs {twice} share a name: TorchNeuron's analysis would misnumber its aliases"
        )
    inputs = {node: index for index, node in enumerate(placeholders)}
    mutated: set[int] = set()
    for node in gm.graph.nodes:
        if _is_in_place(node):
            targets = node.args[:1]
        elif _is_view(node):
            continue
        else:
            targets = _written_arguments(node)
        mutated.update(root for target in targets if (root := _root(target, inputs)) is not None)
    output = next(node for node in gm.graph.nodes if node.op == "output")
    results = output.args[0] if isinstance(output.args[0], tuple | list) else [output.args[0]]
    aliases = [Alias(parameter, index) for index, parameter in enumerate(sorted(mutated))]
    position = len(aliases)
    for result in results:
        root = _root(result, inputs)
        if root is not None and root in mutated:
            continue  # AOTAutograd returns it once, as the mutated input
        if root is not None:
            aliases.append(Alias(root, position))
        position += 1
    return aliases


def functionalize_copies(gm: torch.fx.GraphModule) -> list[Alias]:
    """TorchNeuron's post-AOTAutograd pass: each `aten.copy_(input, value)` is removed, its uses take
    `value`, and the values go first among the outputs, in graph order. Returns input -> output for each:
    what the executor binds in place. The graph is then stateless (what torch-mlir's importer needs)."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    output = next(node for node in gm.graph.nodes if node.op == "output")
    written: list[tuple[int, torch.fx.Node]] = []
    for node in list(gm.graph.nodes):
        if _is_copy(node) and node.args[0] in placeholders:
            written.append((placeholders.index(node.args[0]), node.args[1]))
            node.replace_all_uses_with(node.args[1])
            gm.graph.erase_node(node)
    if not written:
        return []
    results = output.args[0] if isinstance(output.args[0], tuple | list) else [output.args[0]]
    output.args = (tuple([value for _, value in written] + list(results)),)
    gm.graph.lint()
    gm.recompile()
    return [Alias(parameter, index) for index, (parameter, _) in enumerate(written)]


def _is_copy(node: torch.fx.Node) -> bool:
    """An in-place copy as TorchNeuron's pass knows one: `aten.copy_`, or a call whose name holds `copy_`."""
    if node.op != "call_function":
        return False
    names = (getattr(node.target, "__name__", ""), getattr(node.target, "_name", ""))
    return node.target is aten.copy_.default or any("copy_" in str(name) for name in names)


_ENTRY = (
    '{{alias = {{kind = "must_alias", parameter_index = array<i64>, parameter_number = {parameter} : si64}}, '
    "output_index = array<i64{output}>}}"
)


TensorType = tuple[tuple[int, ...], str]  # shape and element type


def kept(aliases: list[Alias], inputs: list[TensorType], outputs: list[TensorType]) -> list[Alias]:
    """The entries TorchNeuron writes into the module: those whose input and output agree in shape and element
    type. An index out of range raises, as TorchNeuron's does."""
    for alias in aliases:
        if not (0 <= alias.parameter < len(inputs) and 0 <= alias.output < len(outputs)):
            raise AliasingError(
                f"alias {alias} is out of range of {len(inputs)} inputs and {len(outputs)} outputs"
            )
    return [alias for alias in aliases if inputs[alias.parameter] == outputs[alias.output]]


def alias_attribute(aliases: list[Alias], outputs: int) -> str:
    """`mhlo.input_output_alias` as TorchNeuron writes it: its parameter number a signed 64-bit integer, the
    output's index empty where the function returns one value."""
    entries = [
        _ENTRY.format(parameter=alias.parameter, output=f": {alias.output}" if outputs > 1 else "")
        for alias in aliases
    ]
    return "[" + ", ".join(entries) + "]"
