"""TorchNeuron's aliasing analysis of a dynamo graph (vllm_neuron/compiler/aliasing.py): which inputs a graph
writes in place, numbered as AOTAutograd numbers its outputs, by TorchNeuron's rules, quirks included. The
fake TorchNeuron (tests/fake_neuron/torch_neuronx/neuron_dynamo_backend.py) has its own reading of the same
source; the two agree on every case."""

import importlib.util
from pathlib import Path

import pytest
import torch

from kv_cache import kernels
from vllm_neuron.compiler.aliasing import Alias, analyse, functionalize_copies

_SPEC = importlib.util.spec_from_file_location(
    "fake_neuron_dynamo_backend",
    Path(__file__).parents[1] / "fake_neuron" / "torch_neuronx" / "neuron_dynamo_backend.py",
)
fake = importlib.util.module_from_spec(_SPEC)  # the module alone: the package would patch this process
_SPEC.loader.exec_module(fake)


def dynamo_graph(function, *args) -> torch.fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(function, backend=capture, fullgraph=True, dynamic=False)(*args)
    (graph,) = graphs
    return graph


def in_place_method(x, y):
    x.add_(y)
    return y * 2


def through_a_view(cache, rows, index):
    cache.view(-1, 4).index_copy_(0, index, rows)
    return rows.sum()


def through_a_slice(x, y):
    x[1:3].mul_(2)
    return y + 1


def through_an_int_index(x, y):
    x[0].add_(y)  # getitem with an int is no view to the analysis: unseen
    return y + 1


def by_setitem(x, index, y):
    x[index] = y
    return y.sum()


def by_schema(cache, key, value, slots):
    kernels.write_kv(cache, key, value, slots)  # `Tensor(a!) kv_cache`
    return key.sum()


def two_in_reverse_order(a, b, c):
    c.zero_()
    a.add_(1)
    return b + 1


def returns_a_view_of_an_input(x, y):
    y.add_(1)
    return x.view(-1), x + 1


CACHE = torch.zeros(4, 8, 2, 4)
CASES = [
    (in_place_method, (torch.zeros(3), torch.ones(3)), [Alias(0, 0)]),
    (through_a_view, (torch.zeros(8, 4), torch.ones(2, 4), torch.tensor([1, 5])), [Alias(0, 0)]),
    (through_a_slice, (torch.zeros(4, 2), torch.ones(2)), [Alias(0, 0)]),
    (through_an_int_index, (torch.zeros(2, 3), torch.ones(3)), []),
    (by_setitem, (torch.zeros(6), torch.tensor([1, 4]), torch.ones(2)), [Alias(0, 0)]),
    (
        by_schema,
        (CACHE.clone(), torch.ones(3, 2, 4), torch.ones(3, 2, 4), torch.tensor([1, 2, 9])),
        [Alias(0, 0)],
    ),
    # dynamo's inputs come in the order the code first uses them: c, a, b; then y, x.
    (two_in_reverse_order, (torch.zeros(2), torch.zeros(2), torch.zeros(2)), [Alias(0, 0), Alias(1, 1)]),
    (returns_a_view_of_an_input, (torch.zeros(2, 2), torch.zeros(2)), [Alias(0, 0), Alias(1, 1)]),
]


@pytest.mark.parametrize(("function", "args", "expected"), CASES, ids=[case[0].__name__ for case in CASES])
def test_the_analysis_finds_what_torchneuron_s_finds(function, args, expected):
    graph = dynamo_graph(function, *args)
    assert analyse(graph) == expected
    assert [Alias(*pair) for pair in fake.AliasingAnalysis()(graph).aliases] == expected


def test_the_copy_pass_puts_each_written_input_first():
    """After AOTAutograd: each copy_ into an input removed, its value first among the outputs, in graph
    order, as the executor binds them; the fake's pass does the same."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    found = []

    def compiler(gm, example_inputs):
        written = functionalize_copies(gm)
        outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
        found.append((written, [node.name for node in outputs]))
        return make_boxed_func(lambda *args: list(gm(*args))[len(written) :])

    backend = aot_autograd(fw_compiler=compiler, keep_inference_input_mutations=True)
    torch.compile(two_in_reverse_order, backend=backend, fullgraph=True)(*CASES[6][1])
    ((written, outputs),) = found
    assert written == [Alias(0, 0), Alias(1, 1)] and len(outputs) == 3
