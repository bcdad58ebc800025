"""The fake's `neuron` compile backend: TorchNeuron's stages as its source runs them
(torch_neuronx/neuron_dynamo_backend at parmoham-aws/test-repo-parmoham@98154b8), up to the StableHLO it hands
neuronx-cc, written here from that source, apart from the plugin's rehearsal (vllm_neuron/compiler), so that
a slip in either shows as a difference between the two modules (tests/engine/test_neuron_startup.py):
1. `backend.py` `neuron_backend_wrapper`: `preprocess_graph`, whose `AliasingAnalysis`
   (`fx/passes/aliasing_analysis.py`) reads the dynamo graph for inputs written in place;
2. AOTAutograd with `keep_inference_input_mutations=True` and TorchNeuron's decomposition table;
3. `post_aot_processing`'s `FunctionalizeCopyInplacePass`: each `copy_` into an input removed, its value put
   first among the outputs (`mutation_info`, what the executor binds in place);
4. `fx_transform.convert_fx_to_stablehlo`: torch-mlir's stateless import, and `_set_module_alias`, which
   writes `mhlo.input_output_alias` from step 1's analysis alone (an entry whose input and output differ in
   shape or element type is dropped, an index out of range raises IndexError).
The executor runs the functional graph on the host and stores each mutated input's new value in its buffer.

Not TorchNeuron's own here: its decomposition table imports NKI kernels, so the plugin's model of it is used
(vllm_neuron.compiler.decompositions); its raw-Torch-dialect pass and its lowering of collectives are not in
the public torch-mlir, so a tensor-parallel graph's collectives are stood in for as the plugin's rehearsal
does (vllm_neuron.compiler.torch_mlir_import).
"""

import operator
from dataclasses import dataclass, field
from typing import Any

import torch

aten = torch.ops.aten


@dataclass
class AliasingInfo:
    """`utils/alias_info.py`: (parameter_number, output_index) pairs."""

    aliases: list[tuple[int, int]] = field(default_factory=list)


class AliasingAnalysis:
    """`fx/passes/aliasing_analysis.py`."""

    ALIASING_METHODS = {
        "t", "transpose", "view", "slice", "reshape", "permute", "expand", "expand_as", "squeeze",
        "unsqueeze", "mH", "mT", "as_strided", "chunk", "unfold", "narrow", "split", "unbind", "select",
        "unflatten", "flatten",
    }  # fmt: skip
    ALIASING_ATEN_OPS = {
        "view", "reshape", "transpose", "permute", "t", "squeeze", "unsqueeze", "expand", "slice", "select",
        "narrow", "chunk", "split", "unbind", "as_strided", "unfold", "flatten", "unflatten", "_unsafe_view",
        "view_as", "reshape_as", "expand_as",
    }  # fmt: skip

    def is_aliasing_op(self, node: torch.fx.Node) -> bool:
        if node.op == "call_function" and node.target == operator.getitem:
            return any(
                isinstance(arg, slice)
                or (isinstance(arg, tuple | list) and any(isinstance(a, slice) for a in arg))
                for arg in node.args
            )
        if node.op == "call_method":
            return node.target in self.ALIASING_METHODS
        if node.op != "call_function":
            return False
        target = node.target
        if hasattr(target, "__module__") and "aten" in str(target.__module__):
            return getattr(target, "__name__", str(target)).split(".")[0] in self.ALIASING_ATEN_OPS
        return getattr(target, "__name__", str(target)) in self.ALIASING_ATEN_OPS

    def is_mutating_op(self, node: torch.fx.Node) -> bool:
        if node.op == "call_function" and node.target == operator.setitem:
            return True
        return node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_")

    def schema_writes(self, node: torch.fx.Node) -> list[Any]:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            return []
        return [
            node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for i, arg in enumerate(schema.arguments)
            if arg.alias_info and arg.alias_info.is_write
        ]

    def root_input(self, node: Any, chain: dict, inputs: set) -> torch.fx.Node | None:
        seen = set()
        while isinstance(node, torch.fx.Node) and node not in seen:
            seen.add(node)
            if node in inputs:
                return node
            if node in chain:
                node = chain[node]
            elif self.is_aliasing_op(node):
                node = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
            else:
                return None
        return None

    def __call__(self, gm: torch.fx.GraphModule) -> AliasingInfo:
        placeholders = {}  # keyed by the cleaned name, as TorchNeuron keys them (an empty one skipped)
        for node in gm.graph.nodes:
            if node.op == "placeholder" and self.clean_name(node):
                placeholders[self.clean_name(node)] = node
        ordered = list(placeholders.values())
        inputs, chain, mutated = set(ordered), {}, []
        for node in gm.graph.nodes:
            if self.is_mutating_op(node):
                tensors = [node.args[0]] if node.args and isinstance(node.args[0], torch.fx.Node) else []
            elif self.is_aliasing_op(node):
                if node.args and isinstance(node.args[0], torch.fx.Node):
                    chain[node] = node.args[0]
                continue
            else:
                tensors = self.schema_writes(node)
            for tensor in tensors:
                root = self.root_input(tensor, chain, inputs)
                if root is not None and ordered.index(root) not in mutated:
                    mutated.append(ordered.index(root))
        output = next(node for node in gm.graph.nodes if node.op == "output")
        outputs = list(output.args[0]) if isinstance(output.args[0], tuple | list) else [output.args[0]]
        explicit = {}
        for index, item in enumerate(outputs):
            root = self.root_input(item, chain, inputs) if isinstance(item, torch.fx.Node) else None
            if root is not None:
                explicit[index] = ordered.index(root)
        info = AliasingInfo([(parameter, index) for index, parameter in enumerate(sorted(mutated))])
        position = len(info.aliases)
        for index in range(len(outputs)):
            if index in explicit and explicit[index] in mutated:
                continue
            if index in explicit:
                info.aliases.append((explicit[index], position))
            position += 1
        return info

    @staticmethod
    def clean_name(node: torch.fx.Node) -> str:
        target = node.target
        if not isinstance(target, str):
            return node.name
        if "parameters" in target:
            return target.replace("L_self_modules_", "").replace("_parameters_", ".").rstrip("_")
        if "buffers" in target:
            return target.replace("L_self_buffers_", "").rstrip("_")
        if target.startswith("L_") and "self" not in target:
            return target[2:].rstrip("_")
        return target.rstrip("_") if target else node.name


def is_copy_inplace(node: torch.fx.Node) -> bool:
    """`_is_copy_inplace`: aten.copy_, or a call_function whose `__name__` or `_name` holds "copy_"."""
    if node.op != "call_function":
        return False
    target = node.target
    if target == aten.copy_.default:
        return True
    return "copy_" in str(getattr(target, "__name__", "")) or "copy_" in str(getattr(target, "_name", ""))


def functionalize_copy_inplace(gm: torch.fx.GraphModule) -> AliasingInfo:
    """`fx/passes/functionalize_copy_inplace_result.py`: each copy_ into a placeholder removed, its value
    put first among the outputs."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    output = next(node for node in gm.graph.nodes if node.op == "output")
    mutations = []
    for node in list(gm.graph.nodes):
        if is_copy_inplace(node) and node.args[0] in placeholders:
            mutations.append((placeholders.index(node.args[0]), node.args[1]))
            node.replace_all_uses_with(node.args[1])
            gm.graph.erase_node(node)
    if mutations:
        outputs = list(output.args[0]) if isinstance(output.args[0], tuple | list) else [output.args[0]]
        output.args = (tuple([value for _, value in mutations] + outputs),)
        gm.graph.lint()
        gm.recompile()
    return AliasingInfo([(parameter, index) for index, (parameter, _) in enumerate(mutations)])


def set_module_alias(module: Any, info: AliasingInfo) -> None:
    """`fx/fx_transform.py _set_module_alias`, built with MLIR's attribute API as TorchNeuron builds it."""
    from torch_mlir import ir

    with module.context:
        main = ir.FunctionType(module.body.operations[0].type)
        inputs, outputs = list(main.inputs), list(main.results)
        entries = []
        for parameter, index in info.aliases:
            if not (0 <= parameter < len(inputs) and 0 <= index < len(outputs)):
                raise IndexError(
                    f"alias {parameter} -> {index}: {len(inputs)} inputs, {len(outputs)} outputs"
                )
            if str(inputs[parameter]) != str(outputs[index]):  # `shapes_match`: shape and element type
                continue
            alias = ir.DictAttr.get(
                {
                    "kind": ir.StringAttr.get("must_alias"),
                    "parameter_index": ir.DenseI64ArrayAttr.get([]),
                    "parameter_number": ir.IntegerAttr.get(ir.IntegerType.get_signed(64), parameter),
                }
            )
            output_index = ir.DenseI64ArrayAttr.get([index] if len(outputs) > 1 else [])
            entries.append(ir.DictAttr.get({"alias": alias, "output_index": output_index}))
        module.operation.attributes["mhlo.input_output_alias"] = ir.ArrayAttr.get(entries)


@dataclass
class Compiled:
    """A graph as the fake compiled it: the StableHLO neuronx-cc would get, what the executor binds."""

    stablehlo: str
    mutation_info: AliasingInfo
    run: Any


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> tuple[Any, list[Compiled]]:
    """TorchNeuron's `neuron` backend on one dynamo graph: the boxed function dynamo calls, and the graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch_mlir import fx as mlir_fx
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_dialect
    from torch_mlir.extras.fx_importer import FxImporter

    from vllm_neuron.compiler.decompositions import decomposition_table
    from vllm_neuron.compiler.torch_mlir_import import stand_in_collectives

    aliasing_info = AliasingAnalysis()(gm)
    compiled: list[Compiled] = []

    def fw_compiler(aot_gm: torch.fx.GraphModule, aot_inputs: list[Any]) -> Any:
        mutation_info = functionalize_copy_inplace(aot_gm)
        context = ir.Context()
        torch_dialect.register_dialect(context)
        lowered_gm, _ = stand_in_collectives(aot_gm)
        module = mlir_fx.stateless_fx_import(
            lowered_gm, output_type="stablehlo", fx_importer=FxImporter(context=context), model_name="main"
        )
        set_module_alias(module, aliasing_info)
        mutated = len(mutation_info.aliases)

        def run(*args: Any) -> list[Any]:
            outputs = aot_gm(*args)
            for parameter, index in mutation_info.aliases:
                args[parameter].copy_(outputs[index])
            return list(outputs[mutated:])

        compiled.append(Compiled(str(module), mutation_info, run))
        return make_boxed_func(run)

    backend = aot_autograd(
        fw_compiler=fw_compiler, keep_inference_input_mutations=True, decompositions=decomposition_table()
    )
    return backend(gm, example_inputs), compiled
