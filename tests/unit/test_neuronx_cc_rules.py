"""neuronx-cc's rules as code (vllm_neuron/compiler/neuronx_cc_rules.py): each rule broken on purpose is
named, with the op and, where a graph made it, the source line; warnings are reported without failing the
lowering. That the engines' graphs meet every rule is checked where they warm up (every lowering raises on a
broken one)."""

import inspect

import pytest
import torch

from vllm_neuron import trn2
from vllm_neuron.compiler import neuronx_cc_rules
from vllm_neuron.compiler.stablehlo import RuleError, StableHLOBackend

FP8 = torch.float8_e4m3fn


def lowered_violations(function, *args) -> list[neuronx_cc_rules.Violation]:
    """The rules `function`'s graph breaks, as the lowering reports them (warnings included)."""
    backend = StableHLOBackend(execute="none")
    compiled = torch.compile(function, backend=backend, fullgraph=True, dynamic=False)
    try:
        compiled(*args)
    except Exception as error:  # dynamo wraps the backend's error
        assert isinstance(error.__cause__ or error, RuleError) or "a trn2 would refuse" in str(error)
    return backend.graphs[-1].broken_rules


def wide_top_k(x):
    return torch.topk(x, 4)


def integer_top_k(x):
    return torch.topk(x, 4)


def fp8_without_option(x):
    return (x.clamp(-240, 240).to(FP8).to(torch.float32) * 2).sum()


def fp8_beyond_240(x):
    return x.clamp(-448, 448).to(FP8).to(torch.float32).sum()


def fp8_output(x):
    return x.clamp(-240, 240).to(FP8)


def integer_scatter_add(index, counts):
    return torch.zeros(8, dtype=torch.int32).scatter_add(0, index, counts)


def integer_matmul(a, b):
    return a @ b


def hidden_write(cache, rows):
    cache[0].add_(rows)  # an int getitem is no view to TorchNeuron's analysis: the write goes unseen
    return rows.sum()


def argmax(x):
    return x.argmax(-1)


LOWERED = [
    ("NCC_EVRF014", wide_top_k, (torch.randn(2, trn2.SORT_LIMIT + 1),), "a top-k of k=16385"),
    ("NCC_EVRF013", integer_top_k, (torch.randint(0, 9, (2, 64), dtype=torch.int32),), "a top-k of i32 keys"),
    ("NCC_EVRF051", fp8_without_option, (torch.randn(4, 8),), "lacks --internal-hlo2tensorizer-options"),
    ("trn2 e4m3 range", fp8_beyond_240, (torch.randn(4, 8),), "clamped at +-448 becomes f8E4M3FN"),
    ("TorchNeuron IO types", fp8_output, (torch.randn(4, 8),), "output 0 is f8E4M3FN"),
    (
        "NCC_EVRF060",
        integer_scatter_add,
        (torch.tensor([1, 3, 1]), torch.ones(3, dtype=torch.int32)),
        "scatters i32 with a computation",
    ),
    ("NCC_EVRF035", integer_matmul, (torch.ones(4, 4, dtype=torch.int32),) * 2, "multiplies i32 matrices"),
    ("in-place inputs", hidden_write, (torch.zeros(2, 4), torch.ones(4)), "is written but not in mhlo"),
]


@pytest.mark.parametrize(("code", "function", "args", "detail"), LOWERED, ids=[case[0] for case in LOWERED])
def test_a_graph_that_breaks_a_rule_fails_its_lowering_naming_rule_op_and_line(
    code, function, args, detail, monkeypatch
):
    if code == "NCC_EVRF051":
        monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    else:
        monkeypatch.setenv("NEURON_CC_FLAGS", trn2.FP8_COMPILER_OPTION)  # only the rule under test breaks
    violations = lowered_violations(function, *args)
    broken = [violation for violation in violations if violation.rule.code == code]
    assert broken, violations
    assert detail in str(broken[0])
    assert all(violation.rule.code == code for violation in violations), violations
    if broken[0].op != "module":  # an op's violation names the line that made it
        line = inspect.getsourcelines(function)[1] + 1
        assert broken[0].source == f"tests/unit/test_neuronx_cc_rules.py:{line}", broken[0]


def test_a_warning_is_reported_and_the_graph_still_lowers():
    backend = StableHLOBackend(execute="fx")
    x = torch.randn(3, 50)
    out = torch.compile(argmax, backend=backend, fullgraph=True, dynamic=False)(x)
    assert torch.equal(out, x.argmax(-1))
    (violation,) = backend.graphs[0].broken_rules
    assert violation.rule.severity == "warns" and violation.rule.code == "variadic reduce"
    assert "aws-neuron-sdk#1210" in str(violation) and "reduces 2 operands" in str(violation)
    assert neuronx_cc_rules.blocking([violation]) == []


def module(body: str, arguments: str = "%arg0: tensor<4x8xf32>", results: str = "tensor<4x8xf32>") -> str:
    """A module's text as torch-mlir prints one, for ops no torch code of the plugin makes."""
    return f"module {{\n  func.func @main({arguments}) -> {results} {{\n{body}\n  }}\n}}\n"


TEXTS = [
    (
        "NCC_EVRF015",
        module(
            '    %0 = stablehlo.custom_call @TopK(%arg0) {backend_config = ""} : '
            "(tensor<4x8xf32>) -> tensor<4x8xf32>\n    return %0 : tensor<4x8xf32>"
        ),
        "custom call target TopK",
    ),
    (
        "sort comparator",
        module(
            '    %0 = "stablehlo.sort"(%arg0) <{dimension = 1 : i64, is_stable = true}> ({\n'
            "    ^bb0(%a: tensor<f32>, %b: tensor<f32>):\n"
            "      %1 = stablehlo.compare GT, %a, %b, TOTALORDER : (tensor<f32>, tensor<f32>) -> tensor<i1>\n"
            "      %2 = stablehlo.compare EQ, %a, %b, FLOAT : (tensor<f32>, tensor<f32>) -> tensor<i1>\n"
            "      %3 = stablehlo.or %1, %2 : tensor<i1>\n"
            "      stablehlo.return %3 : tensor<i1>\n"
            "    }) : (tensor<4x8xf32>) -> tensor<4x8xf32>\n"
            "    return %0 : tensor<4x8xf32>"
        ),
        "its comparator compares by GT, EQ",
    ),
    (
        "NCC_EOCP001",
        module(
            "    %0 = stablehlo.bitcast_convert %arg0 : (tensor<4x8xui8>) -> tensor<4x8xf8E4M3FN>\n"
            "    %1 = stablehlo.bitcast_convert %arg0 : (tensor<4x8xui8>) -> tensor<4x8xf8E4M3>\n"
            "    return %arg0 : tensor<4x8xui8>",
            arguments="%arg0: tensor<4x8xui8>",
            results="tensor<4x8xui8>",
        ),
        "f8E4M3, f8E4M3FN",
    ),
    (
        "NCC_EVRF005",
        module(
            "    %0 = stablehlo.bitcast_convert %arg0 : (tensor<4x8xui8>) -> tensor<4x8xf8E4M3FNUZ>\n"
            "    return %arg0 : tensor<4x8xui8>",
            arguments="%arg0: tensor<4x8xui8>",
            results="tensor<4x8xui8>",
        ),
        "computes in f8E4M3FNUZ",
    ),
    (
        "NCC_EMOD025",
        module(
            "    %0 = stablehlo.abs %arg0 : (tensor<?x8xf32>) -> tensor<?x8xf32>\n"
            "    return %arg0 : tensor<4x8xf32>"
        ),
        "has a dynamic dimension",
    ),
    (
        "NCC_EVRF019",
        module(
            "    %c = stablehlo.constant dense<0.0> : tensor<f32>\n"
            '    %0:2 = "stablehlo.reduce_window"(%arg0, %arg0, %c, %c) '
            "<{window_dimensions = array<i64: 1, 2>}> ({\n"
            "    ^bb0(%a: tensor<f32>, %b: tensor<f32>, %c1: tensor<f32>, %d: tensor<f32>):\n"
            "      stablehlo.return %a, %b : tensor<f32>, tensor<f32>\n"
            "    }) : (tensor<4x8xf32>, tensor<4x8xf32>, tensor<f32>, tensor<f32>) -> "
            "(tensor<4x7xf32>, tensor<4x7xf32>)\n"
            "    return %arg0 : tensor<4x8xf32>"
        ),
        "reduces 2 operands at once",
    ),
    (
        "NCC_EVRF006",
        module(
            "    %0:2 = stablehlo.rng_bit_generator %arg0, algorithm =  THREE_FRY : (tensor<2xui64>) -> "
            "(tensor<2xui64>, tensor<4xui32>)\n    return %arg0 : tensor<2xui64>",
            arguments="%arg0: tensor<2xui64>",
            results="tensor<2xui64>",
        ),
        "other than DEFAULT",
    ),
]


@pytest.mark.parametrize(
    ("code", "text", "detail"), TEXTS, ids=[f"{case[0]}-{i}" for i, case in enumerate(TEXTS)]
)
def test_a_module_that_breaks_a_rule_is_named(code, text, detail, monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", trn2.FP8_COMPILER_OPTION)
    violations = neuronx_cc_rules.check(text)
    assert [violation.rule.code for violation in violations] == [code], violations
    assert detail in str(violations[0])


def test_the_report_names_what_holds():
    assert neuronx_cc_rules.report([]).endswith(
        f"{len(neuronx_cc_rules.RULES)} of neuronx-cc's {len(neuronx_cc_rules.RULES)} rules checked hold.\n"
    )
    every_rule_is_cited = all(rule.source and rule.says for rule in neuronx_cc_rules.RULES)
    assert every_rule_is_cited


def test_check_names_the_first_rule_a_graph_breaks():
    """`vllm-neuron check`'s verdict on an engine whose warm-up met a graph neuronx-cc would refuse."""
    from server.check_engine import verdict_of

    backend = StableHLOBackend(execute="none")
    backend.label = "prefill of 5 tokens at 0: tokens 32 x context 128"
    compiled = torch.compile(wide_top_k, backend=backend, fullgraph=True, dynamic=False)
    with pytest.raises(Exception) as failure:
        compiled(torch.randn(2, trn2.SORT_LIMIT + 1))
    verdict = verdict_of(failure.value)
    assert verdict.status == "breaks a trn2 rule" and not verdict.serves
    assert verdict.reason.startswith("NCC_EVRF014") and verdict.call == backend.label
    assert verdict.op == "stablehlo.sort" and verdict.source.startswith(
        "tests/unit/test_neuronx_cc_rules.py:"
    )
