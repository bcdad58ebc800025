"""The shape of the code: the product's packages import downward only, its modules import each other without
cycles, the planning package stays out of serving, and no module outgrows 500 lines (docs/architecture.md,
"Where things live")."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vllm_neuron", "worker", "kv_cache", "server", "loadtest")
# The product's packages, bottom layer first: a package imports only those of lower layers, never a sibling,
# nor tests or benchmarks, so no arrow runs back up. kv_cache, the attention math, imports no vLLM either.
LAYERS = (("kv_cache",), ("vllm_neuron",), ("worker", "loadtest"), ("server",))
DEV_PACKAGES = ("tests", "benchmarks")
MAX_LINES = 500
# Modules that may import the planning package: the commands and models that plan, and the configuration,
# which runs the automatic bucket policy once at start-up when asked to.
PLANNERS = ("vllm_neuron.planning", "server.check", "loadtest", "vllm_neuron.config")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the product's modules it imports, at any depth of its code (a lazy import is an edge)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {owner(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {owner(f"{node.module}.{alias.name}") or owner(node.module) for alias in node.names}
        edges[module] = found - {None, module}
    return edges


def _package_imports(package: str) -> dict[str, set[str]]:
    """Top-level package imported -> the places (path:line) in `package` that import it, lazy imports too."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                found.setdefault(top, set()).add(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = _cycles(_imports(_modules()))
    assert not cycles, f"import cycles (break each by moving the shared piece down): {cycles}"


def test_layers_list_every_product_package():
    assert sorted(p for layer in LAYERS for p in layer) == sorted(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_the_layers_below_it(package: str):
    rank = next(i for i, layer in enumerate(LAYERS) if package in layer)
    forbidden = {p for layer in LAYERS[rank:] for p in layer} - {package}
    forbidden |= set(DEV_PACKAGES)
    if package == "kv_cache":
        forbidden.add("vllm")
    imports = _package_imports(package)
    upward = {top: sorted(imports[top]) for top in sorted(forbidden & imports.keys())}
    assert not upward, (
        f"{package} imports packages at or above its layer (move the shared piece down): {upward}"
    )


def test_serving_does_not_import_planning():
    edges = _imports(_modules())
    serving = [m for m in edges if not m.startswith(PLANNERS)]
    offenders = {m: sorted(t for t in edges[m] if t.startswith("vllm_neuron.planning")) for m in serving}
    assert not {m: t for m, t in offenders.items() if t}, "serving modules import the planning package"


@pytest.mark.parametrize("package", [*PACKAGES, "benchmarks"])
def test_no_module_over_the_limit(package: str):
    long = {
        str(path.relative_to(ROOT)): lines
        for path in (ROOT / package).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"
