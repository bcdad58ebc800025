"""torch 2.13's private compile stack as the plugin reaches it: dynamo's tracer, backends and settings,
AOTAutograd's boxed calling convention, the decomposition table, fake tensors, FX graph pickling and
inductor's precompilation API; and the one patch of a public torch function (torch.accelerator in CPU mode).

Where torch 2.13 has a public equivalent the plugin uses it instead (torch.compiler.list_backends in
vllm_neuron/device.py). Each import of a torch internal happens when its function is called:
vllm_neuron.device imports this module in every process, even `vllm-neuron --help`'s.
tests/unit/test_upstream.py pins each one; docs/maintaining.md says what to do when one moves.
"""

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

# Marks dynamo's step once wrapped (wrap_dynamo_step), so that a second call wraps nothing.
_STEP_HOOK = "neuron_before_step"


def wrap_dynamo_step(before_step: Callable[[], None]) -> None:
    """Call `before_step` before each bytecode instruction dynamo traces, in every thread; once per process
    (a later call, with any hook, changes nothing).

    torch 2.13: replaces `torch._dynamo.symbolic_convert.InstructionTranslatorBase.step`, which the
    translator's `run` calls once per instruction, with a wrapper (worker/compiles/background.py: a compile
    thread gives the GIL to serving between two instructions)."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    step = InstructionTranslatorBase.step
    if getattr(step, _STEP_HOOK, None) is not None:
        return

    def hooked_step(self) -> bool:
        before_step()
        return step(self)

    setattr(hooked_step, _STEP_HOOK, before_step)
    InstructionTranslatorBase.step = hooked_step


def lookup_backend(name: str) -> Callable:
    """The torch.compile backend registered under `name`. torch 2.13: `torch._dynamo.lookup_backend` (no
    public equivalent; torch.compiler.list_backends lists the names only)."""
    return torch._dynamo.lookup_backend(name)


def thread_compile_settings() -> Callable[[], None]:
    """This thread's settings of dynamo, AOTAutograd and inductor, as a function that applies them in
    another thread. torch 2.13: the config modules `torch._dynamo.config`, `torch._functorch.config` and
    `torch._inductor.config`, with their `save_config` and `load_config`."""
    import torch._functorch.config
    import torch._inductor.config

    saved = [(module, module.save_config()) for module in (torch._dynamo.config, torch._functorch.config)]
    saved.append((torch._inductor.config, torch._inductor.config.save_config()))

    def apply() -> None:
        with warnings.catch_warnings():  # the saved settings include deprecated ones, set as they were
            warnings.simplefilter("ignore", FutureWarning)
            for module, config in saved:
                module.load_config(config)

    return apply


def raise_recompile_limits(limit: int) -> None:
    """Let dynamo keep at least `limit` graphs of one function (past its limit it runs the function
    uncompiled). torch 2.13: `torch._dynamo.config.cache_size_limit` and `accumulated_cache_size_limit`."""
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, limit)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, limit)


def is_graph_break(error: BaseException) -> bool:
    """Whether `error` is dynamo refusing to trace (a graph break under fullgraph=True). torch 2.13:
    `torch._dynamo.exc.Unsupported`."""
    return isinstance(error, torch._dynamo.exc.Unsupported)


def aot_autograd(**options: Any) -> Callable:
    """AOTAutograd as a torch.compile backend (fw_compiler, decompositions, keep_inference_input_mutations).
    torch 2.13: `torch._dynamo.backends.common.aot_autograd`."""
    from torch._dynamo.backends.common import aot_autograd as make_backend

    return make_backend(**options)


def boxed(run: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """A compiled graph that AOTAutograd calls boxed: with one list of inputs, which it may clear. torch 2.13:
    the `_boxed_call` attribute AOTAutograd reads on what a fw_compiler returns."""
    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def get_decompositions(ops: Sequence[Any]) -> dict[Any, Callable]:
    """PyTorch's own decompositions of `ops` (packets or overloads). torch 2.13: `torch._decomp`."""
    from torch._decomp import get_decompositions as table

    return table(ops)


def fake_tensor_mode(*, shape_env: bool = False) -> Any:
    """A new FakeTensorMode (with a ShapeEnv of its own when asked). torch 2.13:
    `torch._subclasses.fake_tensor.FakeTensorMode`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv()) if shape_env else FakeTensorMode()


def map_tensors(function: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """`tree` with `function` applied to each tensor in it. torch 2.13:
    `torch.utils._pytree.tree_map_only`."""
    from torch.utils import _pytree

    return _pytree.tree_map_only(torch.Tensor, function, tree)


def pickle_graph(graph_module: torch.fx.GraphModule) -> bytes:
    """An FX graph as bytes another process with the same torch unpickles. Dynamo's graphs call torch
    functions, not only aten ops (the pickler's default filter), so every op is kept. torch 2.13:
    `torch.fx._graph_pickler.GraphPickler` and its `Options`."""
    from torch.fx._graph_pickler import GraphPickler, Options

    return GraphPickler.dumps(graph_module, Options(ops_filter=None, node_metadata_key_filter=None))


def unpickle_graph(data: bytes, fake_mode: Any) -> torch.fx.GraphModule:
    """The graph `pickle_graph` made, its values in `fake_mode`. torch 2.13: `GraphPickler.loads`."""
    from torch.fx._graph_pickler import GraphPickler

    return GraphPickler.loads(data, fake_mode)


def inductor_cache_dir() -> str:
    """Inductor's cache folder (TORCHINDUCTOR_CACHE_DIR, or its default). torch 2.13:
    `torch._inductor.runtime.cache_dir_utils.cache_dir`."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_default_cache_dir() -> str:
    """Inductor's cache folder when TORCHINDUCTOR_CACHE_DIR is not set. torch 2.13:
    `torch._inductor.runtime.cache_dir_utils.default_cache_dir`."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def standalone_compile(module: torch.fx.GraphModule, examples: Iterable[torch.Tensor], fake_mode: Any) -> Any:
    """Inductor's compile of a traced graph for the static shapes of `examples` (fake tensors of `fake_mode`),
    as an artefact with `save(path=, format=)`; the precompilation API vLLM's compile cache uses too. torch
    2.13: `torch._inductor.standalone_compile`."""
    return torch._inductor.standalone_compile(
        module, list(examples), dynamic_shapes="from_example_inputs", fake_mode=fake_mode
    )


def load_compiled_artifact(path: str, format: str) -> Callable:
    """An artefact `standalone_compile` saved, loaded and callable. torch 2.13:
    `torch._inductor.CompiledArtifact.load`."""
    return torch._inductor.CompiledArtifact.load(path=path, format=format)


def make_accelerator_calls_no_ops() -> None:
    """Make torch.accelerator's synchronize, empty_cache and empty_host_cache do nothing, process-wide: vLLM's
    loader, worker helpers and shutdown call them, and they raise on a host with no accelerator (CPU mode).
    Distinct functions: dynamo keys its handling of synchronize on the function object. torch 2.13: public
    functions, replaced on the `torch.accelerator` module."""

    def no_synchronize(*args: object, **kwargs: object) -> None:
        return None

    def no_empty_cache(*args: object, **kwargs: object) -> None:
        return None

    def no_empty_host_cache(*args: object, **kwargs: object) -> None:
        return None

    torch.accelerator.synchronize = no_synchronize
    torch.accelerator.empty_cache = no_empty_cache
    torch.accelerator.empty_host_cache = no_empty_host_cache
