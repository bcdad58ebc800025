"""The only caller of torch.compile: static shapes, full graphs, and a count of the graphs compiled."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class GraphCounter:
    """A torch.compile backend that records each graph it is handed, then delegates to the real backend.

    Dynamo hands a backend one graph per new input shape, so the count is the number of compiles.
    """

    backend_name: str
    shapes: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._inner = torch._dynamo.lookup_backend(self.backend_name)

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.shapes.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
        return self._inner(graph_module, example_inputs)

    @property
    def num_graphs(self) -> int:
        return len(self.shapes)


def compile_static(
    module: torch.nn.Module, backend_name: str, expected_graphs: int
) -> tuple[Callable, GraphCounter]:
    """Compile `module` for static shapes: one graph per bucket shape, no graph breaks.

    backend "none" returns the module uncompiled (debugging); its counter stays at zero.
    """
    counter = GraphCounter("eager" if backend_name == "none" else backend_name)
    if backend_name == "none":
        return module, counter
    # Each bucket is one more cache entry for the same code object; the defaults (8) would silently fall
    # back to eager execution past that.
    limit = expected_graphs + 8
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, limit
    )
    compiled = torch.compile(module, backend=counter, dynamic=False, fullgraph=True)
    return compiled, counter
