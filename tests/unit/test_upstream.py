"""The pins of vllm_neuron/upstream/: each private vLLM or torch name the plugin reaches still exists with the
shape it relies on, and no other module of the product reaches one (docs/maintaining.md).

Run this file first after moving to a new vLLM or torch: each failure names what moved and where the plugin
reaches it.
"""

import ast
import dataclasses
import importlib
import inspect
import textwrap
import threading
from argparse import ArgumentParser
from pathlib import Path

import pytest
import torch

from vllm_neuron.upstream import torch_compile, vllm_engine, vllm_lora, vllm_nixl, vllm_runner, vllm_server

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vllm_neuron", "worker", "kv_cache", "server", "loadtest")
UPSTREAM = ROOT / "vllm_neuron" / "upstream"
UPSTREAM_ROOTS = ("vllm", "torch")
# vLLM modules that are its implementation, not the interfaces it offers a platform plugin (Platform,
# WorkerBase, the attention backend, the scheduler classes and their outputs, EngineClient, the config):
# the GPU worker and runner and their helpers, the proposers, the sampler, the server's launch and CLI, its
# utilities. Only vllm_neuron/upstream imports from them; `TYPE_CHECKING` imports (annotations) aside.
INTERNAL_MODULES = (
    "vllm.v1.worker",
    "vllm.v1.spec_decode",
    "vllm.v1.structured_output",
    "vllm.v1.sample",
    "vllm.entrypoints.launchers",
    "vllm.entrypoints.cli",
    "vllm.entrypoints.serve",
    "vllm.utils",
    "vllm.model_executor.model_loader.reload",
)
PUBLIC_WITHIN_INTERNAL = ("vllm.v1.worker.worker_base",)  # WorkerBase: the worker's interface
INTERNAL_NAMES = {"vllm.forward_context": {"create_forward_context", "override_forward_context"}}


def moved(what: str, module: str) -> str:
    return f"vLLM or torch moved {what}: see docs/maintaining.md (its pin: vllm_neuron/upstream/{module}.py)"


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


# ---- the scan: no module outside vllm_neuron/upstream reaches a private name ------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _upstream(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in UPSTREAM_ROOTS


def _chain(node: ast.AST) -> list[str] | None:
    """a.b.c as ["a", "b", "c"]; None when it does not start from a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the import statements under `if TYPE_CHECKING:`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (_chain(node.test) or [""])[-1] == "TYPE_CHECKING":
            found |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    return found


def _bindings(tree: ast.Module) -> dict[str, str]:
    """Name in the module -> the vLLM or torch object it was imported as (anywhere in the module)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _upstream(alias.name):
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _upstream(node.module):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _resolve(dotted: str):
    """The object a dotted name of vLLM or torch names, or None."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            value = getattr(value, part, None)
        return value
    return None


def private_reaches(source: str) -> list[str]:
    """Where a module reaches a private vLLM or torch name: an import of one; an attribute of an imported
    vLLM or torch object (through torch.ops, ATen's operator names are not Python names); `__new__` on one
    (its constructor skipped); an assignment to, setattr or delattr on one (a monkeypatch); and, in a class
    derived from one, a private member it defines or uses that the vLLM or torch base has (an override, or
    the base's state)."""
    tree = ast.parse(source)
    bound = _bindings(tree)
    found = []

    def where(node: ast.AST, what: str) -> None:
        found.append(f"line {node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _upstream(alias.name) and any(map(_private, alias.name.split("."))):
                    where(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _upstream(node.module):
            for alias in node.names:
                if any(map(_private, f"{node.module}.{alias.name}".split("."))):
                    where(node, f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain is None or chain[0] not in bound:
                continue
            full = [*bound[chain[0]].split("."), *chain[1:]]
            if (_private(node.attr) or node.attr == "__new__") and full[:2] != ["torch", "ops"]:
                where(node, ".".join(chain))
            if isinstance(node.ctx, ast.Store | ast.Del):
                where(node, f"assignment to {'.'.join(chain)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            chain = _chain(node.args[0])
            if node.func.id in ("setattr", "delattr") and chain and chain[0] in bound:
                where(node, f"{node.func.id}({'.'.join(chain)}, ...)")
        elif isinstance(node, ast.ClassDef):
            found += _private_members(node, bound)
    return found


def _private_members(cls: ast.ClassDef, bound: dict[str, str]) -> list[str]:
    bases = []
    for base in cls.bases:
        chain = _chain(base)
        if chain and chain[0] in bound:
            bases.append(_resolve(".".join([*bound[chain[0]].split("."), *chain[1:]])))
    if not bases:
        return []
    own = set()  # what the class defines itself: methods, class attributes, attributes it assigns on self
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _chain(node) is not None:
            own.add(node.attr)

    def upstreams(name: str) -> bool:
        """A member of a base (an attribute, or one only declared: `_enum: PlatformEnum`); unresolved: yes."""
        return any(
            base is None
            or hasattr(base, name)
            or any(name in vars(klass).get("__annotations__", {}) for klass in getattr(base, "__mro__", ()))
            for base in bases
        )

    found = []
    for node in cls.body:
        names = [node.name] if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else []
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [target.id for target in targets if isinstance(target, ast.Name)]
        found += [
            f"line {node.lineno}: {cls.name}.{name}" for name in names if _private(name) and upstreams(name)
        ]
    for node in ast.walk(cls):
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        private_member = chain and len(chain) == 2 and chain[0] in ("self", "cls") and _private(chain[1])
        if private_member and (upstreams(chain[1]) or chain[1] not in own):
            found.append(f"line {node.lineno}: {cls.name}: {'.'.join(chain)}")
    return found


def internal_imports(source: str) -> list[str]:
    """Where a module imports from vLLM's implementation (INTERNAL_MODULES, INTERNAL_NAMES) at run time."""
    tree = ast.parse(source)
    annotations_only = _type_checking_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            imported = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in imported:
            internal = any(module == m or module.startswith(m + ".") for m in INTERNAL_MODULES)
            if internal and module not in PUBLIC_WITHIN_INTERNAL or name in INTERNAL_NAMES.get(module, ()):
                found.append(f"line {node.lineno}: {module}" + (f".{name}" if name else ""))
    return found


def _product_modules() -> list[str]:
    paths = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    return [str(path.relative_to(ROOT)) for path in paths if UPSTREAM not in path.parents]


def test_the_scan_finds_each_kind_of_private_reach():
    source = textwrap.dedent(
        """
        import torch
        import torch._inductor.config
        from torch._decomp import get_decompositions
        from torch.utils import _pytree
        from vllm.v1.spec_decode.draft_model import DraftModelProposer
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.platforms.interface import Platform

        def f(engine_client):
            torch._dynamo.reset()
            DraftModelProposer.__new__(DraftModelProposer)
            torch.accelerator.synchronize = None
            setattr(Scheduler, "schedule", None)
            torch.ops._c10d_functional.all_reduce  # an operator's name: not a Python name
            engine_client._private  # not known to be vLLM's: out of the scan's reach

        class Mine(Scheduler):
            def _update_after_schedule(self, output):  # Scheduler's
                return self._own() + self._pause_state  # its own; Scheduler's state

            def _own(self):
                return 0

        class Oot(Platform):
            _enum = None
        """
    )
    found = private_reaches(source)
    for expected in (
        "import torch._inductor.config",
        "from torch._decomp import get_decompositions",
        "from torch.utils import _pytree",
        "torch._dynamo",
        "DraftModelProposer.__new__",
        "assignment to torch.accelerator.synchronize",
        "setattr(Scheduler, ...)",
        "Mine._update_after_schedule",
        "self._pause_state",
        "Oot._enum",
    ):
        assert any(expected in line for line in found), (expected, found)
    assert not any("_c10d" in line or "_private" in line or "_own" in line for line in found), found


def test_the_scan_finds_imports_from_vllm_internals():
    source = textwrap.dedent(
        """
        from typing import TYPE_CHECKING
        from vllm.v1.worker.gpu_input_batch import InputBatch
        from vllm.v1.worker.worker_base import WorkerBase
        from vllm.forward_context import ForwardContext, override_forward_context
        import vllm.utils.torch_utils

        if TYPE_CHECKING:
            from vllm.v1.worker.gpu_input_batch import CachedRequestState
        """
    )
    found = internal_imports(source)
    assert found == [
        "line 3: vllm.v1.worker.gpu_input_batch.InputBatch",
        "line 5: vllm.forward_context.override_forward_context",
        "line 6: vllm.utils.torch_utils",
    ]


@pytest.mark.parametrize("path", _product_modules())
def test_no_module_outside_upstream_reaches_a_private_name(path):
    found = private_reaches((ROOT / path).read_text())
    assert not found, (
        f"{path} reaches private vLLM or torch names: {found}. Reach them through vllm_neuron/upstream "
        "(docs/maintaining.md, 'Adding a pin')"
    )


@pytest.mark.parametrize(
    "path",
    _product_modules(),
)
def test_no_module_outside_upstream_imports_vllm_internals(path):
    found = internal_imports((ROOT / path).read_text())
    assert not found, (
        f"{path} imports vLLM's implementation: {found}. Reach it through vllm_neuron/upstream "
        "(docs/maintaining.md, 'Adding a pin')"
    )


# ---- torch: vllm_neuron/upstream/torch_compile.py ---------------------------------------------------------


def test_dynamo_steps_one_instruction_at_a_time():
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    assert parameters(InstructionTranslatorBase.step) == ["self"], moved(
        "InstructionTranslatorBase.step", "torch_compile"
    )
    assert "self.step()" in inspect.getsource(InstructionTranslatorBase.run), moved(
        "the call of InstructionTranslatorBase.step per instruction (its run loop)", "torch_compile"
    )


def test_backend_lookup_and_listing():
    assert callable(torch_compile.lookup_backend("eager")), moved(
        "torch._dynamo.lookup_backend", "torch_compile"
    )
    # The public listing vllm_neuron/device.py uses.
    assert {"eager", "inductor"} <= set(torch.compiler.list_backends(exclude_tags=()))


def test_compile_settings_carry_to_another_thread():
    import torch._functorch.config
    import torch._inductor.config

    for config in (torch._dynamo.config, torch._functorch.config, torch._inductor.config):
        assert hasattr(config, "save_config") and hasattr(config, "load_config"), moved(
            f"{config.__name__}.save_config/load_config", "torch_compile"
        )
    for limit in ("cache_size_limit", "accumulated_cache_size_limit"):
        assert isinstance(getattr(torch._dynamo.config, limit, None), int), moved(
            f"torch._dynamo.config.{limit}", "torch_compile"
        )
    apply, seen = torch_compile.thread_compile_settings(), {}

    def in_thread() -> None:
        apply()
        seen["limit"] = torch._dynamo.config.cache_size_limit

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen["limit"] == torch._dynamo.config.cache_size_limit


def test_a_graph_break_is_recognised():
    def breaks(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x + 1

    with pytest.raises(Exception) as raised:
        torch.compile(breaks, backend="eager", fullgraph=True)(torch.ones(2))
    assert torch_compile.is_graph_break(raised.value), moved("torch._dynamo.exc.Unsupported", "torch_compile")


def test_aot_autograd_calls_a_boxed_graph_with_a_list():
    calls = []

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def run(args: list) -> list:
            calls.append(type(args))
            return list(gm(*args))

        return torch_compile.boxed(run)

    backend = torch_compile.aot_autograd(fw_compiler=fw_compiler, keep_inference_input_mutations=True)
    with torch.no_grad():
        result = torch.compile(lambda x: x * 2 + 1, backend=backend, fullgraph=True, dynamic=False)(
            torch.ones(3)
        )
    assert torch.equal(result, torch.full((3,), 3.0))
    assert calls and all(kind is list for kind in calls), moved(
        "AOTAutograd's `_boxed_call`", "torch_compile"
    )


def test_decompositions_fake_tensors_pickling():
    aten = torch.ops.aten
    assert aten.logsumexp.default in torch_compile.get_decompositions([aten.logsumexp]), moved(
        "torch._decomp.get_decompositions", "torch_compile"
    )
    fake_mode = torch_compile.fake_tensor_mode(shape_env=True)
    assert fake_mode.shape_env is not None
    with torch_compile.fake_tensor_mode():
        assert type(torch.empty(2)).__name__ == "FakeTensor"
    assert torch_compile.map_tensors(lambda t: t + 1, {"a": [torch.zeros(1)], "b": 2})["a"][0].item() == 1
    graph = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    module = torch_compile.unpickle_graph(torch_compile.pickle_graph(graph), fake_mode)
    assert str(module.graph) == str(graph.graph), moved("torch.fx._graph_pickler", "torch_compile")


def test_inductor_precompilation_api():
    import torch._inductor

    assert isinstance(torch_compile.inductor_cache_dir(), str)
    assert isinstance(torch_compile.inductor_default_cache_dir(), str)
    compile_parameters = inspect.signature(torch._inductor.standalone_compile).parameters
    assert list(compile_parameters)[:2] == ["gm", "example_inputs"], moved(
        "torch._inductor.standalone_compile", "torch_compile"
    )
    assert {"dynamic_shapes", "fake_mode"} <= set(compile_parameters)
    assert {"path", "format"} <= set(inspect.signature(torch._inductor.CompiledArtifact.load).parameters)


def test_torch_accelerator_has_the_calls_cpu_mode_replaces():
    for name in ("synchronize", "empty_cache", "empty_host_cache"):
        assert callable(getattr(torch.accelerator, name, None)), moved(
            f"torch.accelerator.{name}", "torch_compile"
        )


# ---- vLLM's engine side: vllm_neuron/upstream/vllm_engine.py ----------------------------------------------


def test_an_out_of_tree_platform_is_marked_by_its_enum():
    from vllm.platforms.interface import Platform

    @vllm_engine.out_of_tree_platform
    class Oot(Platform):
        pass

    assert Oot().is_out_of_tree(), moved("Platform._enum", "vllm_engine")


def test_validate_environ_reads_the_environment_when_called(monkeypatch):
    from vllm.platforms.interface import Platform

    from vllm_neuron.platform import NeuronPlatform

    monkeypatch.setenv("VLLM_NEURON_PIN_CHECK", "1")
    with pytest.raises(ValueError):
        Platform.validate_environ(hard_fail=True)
    NeuronPlatform.validate_environ(hard_fail=True)  # hidden from the check


def test_the_scheduler_reads_its_limits_each_step():
    from vllm.config import SchedulerConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    assert "self.max_num_scheduled_tokens = (" in inspect.getsource(Scheduler.__init__)
    schedule = inspect.getsource(Scheduler.schedule)
    assert "token_budget = self.max_num_scheduled_tokens" in schedule, moved(
        "Scheduler.max_num_scheduled_tokens (read by schedule())", "vllm_engine"
    )
    assert "self.scheduler_config.long_prefill_token_threshold" in schedule, moved(
        "SchedulerConfig.long_prefill_token_threshold (read by schedule())", "vllm_engine"
    )
    assert "long_prefill_token_threshold" in {field.name for field in dataclasses.fields(SchedulerConfig)}
    assert issubclass(AsyncScheduler, Scheduler) and "schedule" not in vars(AsyncScheduler)


def test_kv_events_are_published_with_a_steps_output(monkeypatch):
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    update = inspect.getsource(Scheduler.update_from_output)
    assert "events = self.kv_cache_manager.take_events()" in update, moved("KV events", "vllm_engine")
    assert "self.kv_event_publisher.publish(batch)" in update, moved("the KV event publisher", "vllm_engine")
    assert {"ts", "events"} <= set(KVEventBatch.__struct_fields__)
    # Sleep and /reset_prefix_cache reset through the scheduler, which ResetPublishedAtOnce extends.
    assert "self.scheduler.reset_prefix_cache(" in inspect.getsource(EngineCore.reset_prefix_cache)
    assert parameters(Scheduler.reset_prefix_cache) == ["self", "reset_running_requests", "reset_connector"]
    # The seed of the block hashes.
    seed_rule = inspect.getsource(kv_cache_utils.resolve_none_hash_seed)
    assert '"PYTHONHASHSEED"' in seed_rule and "_NON_CRYPTO_HASH_FUNCTIONS" in seed_rule, moved(
        "the block hashes' seed", "vllm_engine"
    )
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert kv_cache_utils.resolve_none_hash_seed(get_hash_fn_by_name("sha256_cbor")) == (
        vllm_engine.block_hash_seed("sha256_cbor")
    )
    assert vllm_engine.block_hash_seed("xxhash") is None
    monkeypatch.setenv("PYTHONHASHSEED", "41")
    assert vllm_engine.block_hash_seed("xxhash") == "41"


def test_the_moe_runner_chooses_its_entry_point_and_calls_forward_impl():
    from vllm.model_executor.layers.fused_moe.runner import moe_runner
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    assert "self._forward_entry = self._select_forward()" in inspect.getsource(MoERunner.__init__), moved(
        "MoERunner._select_forward", "vllm_engine"
    )
    assert "self._forward_entry(" in inspect.getsource(MoERunner.forward)
    assert parameters(MoERunner._forward_impl)[:5] == [
        "self",
        "hidden_states",
        "router_logits",
        "shared_experts_input",
        "input_ids",
    ], moved("MoERunner._forward_impl", "vllm_engine")
    # The entry point takes the custom op's arguments.
    ours = parameters(vllm_engine.MoERunnerForwardInGraph._forward_in_graph)[1:]
    assert parameters(moe_runner._moe_forward) == ours, moved(
        "the moe_forward custom op's signature", "vllm_engine"
    )


def test_the_worker_helpers():
    from vllm.model_executor.model_loader.reload.inplace import reload_weights
    from vllm.utils.torch_utils import set_random_seed
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    assert parameters(init_worker_distributed_environment) == [
        "vllm_config",
        "rank",
        "distributed_init_method",
        "local_rank",
        "backend",
    ], moved("init_worker_distributed_environment", "vllm_engine")
    assert parameters(set_random_seed)[0] == "seed"
    assert parameters(reload_weights) == [
        "vllm_config",
        "model",
        "weights_iterator",
        "weights_path",
        "is_checkpoint_format",
    ], moved("reload_weights", "vllm_engine")


# ---- vLLM's LoRA seam: vllm_neuron/upstream/vllm_lora.py ---------------------------------------------------


def test_the_punica_seam_the_lora_wrapper_fills():
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.vocab_parallel_embedding import VocabParallelEmbeddingWithLoRA

    from vllm_neuron.lora.punica import NeuronPunicaWrapper

    # Every op vLLM declares is the wrapper's own (none left abstract), reading the slots from the context.
    assert {"add_shrink", "add_expand", "add_lora_linear", "add_lora_logits", "add_lora_embedding"} <= set(
        vllm_lora.PunicaWrapperBase.__abstractmethods__
    ), moved("PunicaWrapperBase's abstract ops", "vllm_lora")
    assert not NeuronPunicaWrapper.__abstractmethods__
    assert parameters(vllm_lora.get_forward_context) == []
    # The embedding layer reads the wrapper's offsets directly, the linear layers call add_lora_linear.
    assert "self.punica_wrapper._embeddings_indices[:num_tokens]" in inspect.getsource(
        VocabParallelEmbeddingWithLoRA.forward
    ), moved("VocabParallelEmbeddingWithLoRA reading _embeddings_indices", "vllm_lora")
    assert "self.punica_wrapper.add_lora_linear(" in inspect.getsource(
        BaseLinearLayerWithLoRA._apply_lora_to_output
    ), moved("BaseLinearLayerWithLoRA calling add_lora_linear", "vllm_lora")


def test_the_adapter_manager_seam_the_lora_slots_use():
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.worker_manager import WorkerLoRAManager

    # CheckedLoRAManager checks each adapter where vLLM loads it, against the manager's wrapped modules.
    assert parameters(WorkerLoRAManager._load_adapter) == ["self", "lora_request"], moved(
        "WorkerLoRAManager._load_adapter", "vllm_lora"
    )
    init = inspect.getsource(LoRAModelManager.__init__)
    for attribute in ("self.modules:", "self.packed_modules:", "self.lora_index_to_id:"):
        assert attribute in init, moved(f"LoRAModelManager's {attribute[:-1]}", "vllm_lora")
    # split_stack: under tensor parallelism a column-parallel layer keeps A whole and slices B, a row-parallel
    # one slices A and keeps B whole.
    from vllm.lora.layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA

    for layer, whole in ((ColumnParallelLinearWithLoRA, "a"), (RowParallelLinearWithLoRA, "b")):
        kept = inspect.getsource(getattr(layer, f"slice_lora_{whole}")).splitlines()[-1].strip()
        assert kept == f"return lora_{whole}", moved(f"{layer.__name__}.slice_lora_{whole}", "vllm_lora")
    # _SlotWritingModelManager: the worker manager builds its model manager from _manager_cls, whose
    # activation writes the slot into each module of self.modules with set_lora or reset_lora.
    from vllm.lora.model_manager import LRUCacheLoRAModelManager
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    assert LRUCacheWorkerLoRAManager._manager_cls is LRUCacheLoRAModelManager
    assert "lora_manager_cls=self._manager_cls" in inspect.getsource(
        LRUCacheWorkerLoRAManager.create_lora_manager
    ), moved("LRUCacheWorkerLoRAManager._manager_cls", "vllm_lora")
    activate = inspect.getsource(LoRAModelManager.activate_adapter)
    for call in ("self.modules.items()", "module.set_lora(", "module.reset_lora(index)"):
        assert call in activate, moved(f"LoRAModelManager.activate_adapter's {call}", "vllm_lora")
    # vLLM calls update_metadata only when the mapping or the slot layout changes: one fixed mapping suffices.
    assert "self._last_slot_layout != slot_layout" in inspect.getsource(
        LoRAModelManager.set_adapter_mapping
    ), moved("LoRAModelManager.set_adapter_mapping", "vllm_lora")


def test_the_fp8_linear_seam_the_neuron_kernel_fills():
    """vllm_neuron/upstream/vllm_fp8.py: the kernel registry for out-of-tree platforms, the kernel base
    class's abstract methods, and the weight quantization op vLLM's FP8 methods call by attribute."""
    from vllm import _custom_ops
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.layers.quantization.online import fp8 as online

    from vllm_neuron.quantization.fp8 import scaled_fp8_quant
    from vllm_neuron.upstream.vllm_fp8 import FP8ScaledMMLinearKernel

    assert parameters(register_linear_kernel) == ["kernel_class", "platform", "kernel_type"], moved(
        "register_linear_kernel", "vllm_fp8"
    )
    assert FP8ScaledMMLinearKernel.__abstractmethods__ == {
        "is_supported",
        "can_implement",
        "apply_scaled_mm",
    }, moved("FP8ScaledMMLinearKernel's abstract methods", "vllm_fp8")
    assert parameters(_custom_ops.scaled_fp8_quant) == parameters(scaled_fp8_quant)
    # Online FP8 quantizes through the module attribute, and leaves the weight as a transposed view.
    source = inspect.getsource(online.Fp8PerTensorOnlineLinearMethod.process_weights_after_loading)
    assert "ops.scaled_fp8_quant(weight, scale=weight_scale)" in source and "qweight.t()" in source


# ---- vLLM's model runner: vllm_neuron/upstream/vllm_runner.py ---------------------------------------------


def test_the_runner_helpers():
    assert parameters(vllm_runner.bind_kv_cache)[:3] == ["kv_caches", "forward_context", "runner_kv_caches"]
    assert parameters(vllm_runner.create_forward_context)[:2] == ["attn_metadata", "vllm_config"]
    assert parameters(vllm_runner.override_forward_context) == ["forward_context"]
    assert parameters(vllm_runner.apply_grammar_bitmask) == [
        "scheduler_output",
        "grammar_output",
        "input_batch",
        "logits",
    ], moved("apply_grammar_bitmask", "vllm_runner")
    assert vllm_runner.strip_speculative_padding([5, 7, -1, -1]) == [5, 7]
    assert "logprobs_mode" in parameters(vllm_runner.Sampler)
    assert parameters(vllm_runner.Sampler.forward)[:3] == ["self", "logits", "sampling_metadata"]


def test_the_kv_connector_lifecycle_a_step_runs_in(monkeypatch):
    """worker/kv/kv_transfer.py runs a step's calls inside vLLM's connector lifecycle: the scheduler's
    metadata bound and a synchronous load started (with the current forward context) on entry; the saves
    waited for, the transfers collected and the metadata cleared on exit."""
    from types import SimpleNamespace
    from unittest import mock

    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorTransferResults,
    )

    connector = mock.create_autospec(KVConnectorBase_V1, instance=True)
    connector.get_transfer_results.return_value = KVConnectorTransferResults(finished_recving={"r"})
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    step = SimpleNamespace(kv_connector_metadata="meta", has_sync_kv_loads=True, finished_req_ids=set())
    mixin = vllm_runner.KVConnectorModelRunnerMixin
    with vllm_runner.override_forward_context("context"), mixin.maybe_get_kv_connector_output(step) as output:
        entry = [call[0] for call in connector.method_calls]
    assert entry == ["bind_connector_metadata", "start_load_kv"], moved(
        "the connector lifecycle", "vllm_runner"
    )
    assert connector.start_load_kv.call_args.args == ("context",)
    exit_calls = [call[0] for call in connector.method_calls[2:]]
    assert exit_calls[0] == "wait_for_save" and exit_calls[-1] == "clear_connector_metadata"
    assert output.finished_recving == {"r"}


def test_the_attention_op_runs_the_connector_hooks_only_with_metadata():
    """worker/kv/kv_transfer.py unbinds the metadata while the compiled calls run, for this check."""
    from vllm.model_executor.layers.attention import kv_transfer_utils

    hook = inspect.getsource(kv_transfer_utils.maybe_transfer_kv_layer)
    assert "not connector.has_connector_metadata()" in hook, moved(
        "the attention op's connector hooks", "vllm_runner"
    )


def test_the_nixl_connector_stages_through_host_buffers_by_two_flags():
    """worker/kv/nixl.py: vLLM's pull connector decides host staging in each side's __init__ from the
    platform's device type (never for 'cpu'), saves in wait_for_save and loads in its transfer results only
    where the worker's flag and copy operation are set, ignores the copy operation on 'cpu', and validates
    each remote engine once (vllm_nixl.check_each_remote); its agent is configured in __init__, where
    vllm_nixl.agent_progress_thread reaches it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker, connector

    worker_init = inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    assert 'self.use_host_buffer = self.kv_buffer_device == "cpu"' in worker_init, moved(
        "the NIXL worker's use_host_buffer", "vllm_nixl"
    )
    assert "self.use_host_buffer" in inspect.getsource(base_scheduler.NixlBaseConnectorScheduler.__init__)
    wait = inspect.getsource(connector.NixlBaseConnector.wait_for_save)
    assert "use_host_buffer and self.connector_worker.copy_blocks" in wait, moved(
        "wait_for_save", "vllm_nixl"
    )
    assert "self.copy_blocks = copy_operation" in inspect.getsource(
        base_worker.NixlBaseConnectorWorker.set_host_xfer_buffer_ops
    ), moved("the NIXL worker's copy_blocks", "vllm_nixl")
    validate = base_worker.NixlBaseConnectorWorker._validate_remote_agent_handshake
    assert parameters(validate)[:3] == ["self", "nixl_agent_meta", "remote_tp_size"], moved(
        "_validate_remote_agent_handshake", "vllm_nixl"
    )
    assert vllm_nixl.NixlPullConnector is connector.NixlConnector
    # The agent's config: built in the worker side's __init__ from base_worker's nixl_agent_config, which
    # vllm_nixl.agent_progress_thread(False) replaces while the connector is created.
    assert "nixl_agent_config(" in worker_init, moved("the NIXL worker's agent config", "vllm_nixl")
    with vllm_nixl.agent_progress_thread(True):
        assert base_worker.nixl_agent_config(num_threads=4).enable_pthread is True
    with vllm_nixl.agent_progress_thread(False):
        assert base_worker.nixl_agent_config(num_threads=4).enable_pthread is False
    assert base_worker.nixl_agent_config().enable_pthread is True  # nixl's own default, put back
    # The block copy's calls (worker/kv/nixl_blocks.py): host buffers to the caches' views once a transfer
    # lands, the views to the host buffers on a save; vLLM's copy_kv_blocks's arguments.
    worker = base_worker.NixlBaseConnectorWorker
    load = "".join(inspect.getsource(worker.sync_recved_kv_to_device).split())
    save = "".join(inspect.getsource(worker.save_kv_to_host).split())
    arguments = "block_ids,block_ids,"
    assert f'self.copy_blocks(self.host_xfer_buffers,self.device_kv_caches,{arguments}"h2d",)' in load, moved(
        "the NIXL worker's h2d block copy", "vllm_nixl"
    )
    assert f'self.copy_blocks(self.device_kv_caches,self.host_xfer_buffers,{arguments}"d2h",)' in save, moved(
        "the NIXL worker's d2h block copy", "vllm_nixl"
    )


def test_an_attention_layers_kv_cache_scales_are_buffers():
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    layer = torch.nn.Module()
    set_default_quant_scales(layer, register_buffer=True)
    k_scale, v_scale = vllm_runner.kv_cache_scales(layer)
    buffers = [id(b) for b in layer.buffers()]
    pin = moved("Attention._k_scale/_v_scale", "vllm_runner")
    assert id(k_scale) in buffers and id(v_scale) in buffers, pin
    assert (k_scale.shape, k_scale.dtype, float(k_scale), float(v_scale)) == ((), torch.float32, 1.0, 1.0), (
        pin
    )


def test_the_persistent_batch():
    from vllm.v1.sample.logits_processor import build_logitsprocs
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    keywords = {
        "max_num_reqs",
        "max_model_len",
        "max_num_batched_tokens",
        "device",
        "vocab_size",
        "block_sizes",
        "max_num_blocks_per_req",
        "logitsprocs",
        "logitsprocs_need_output_token_ids",
    }
    assert keywords <= set(parameters(InputBatch)), moved("InputBatch's constructor", "vllm_runner")
    assert parameters(build_logitsprocs)[:5] == [
        "vllm_config",
        "device",
        "is_pin_memory",
        "is_pooling_model",
        "custom_logitsprocs",
    ]
    batch = InputBatch(
        max_num_reqs=2,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        vocab_size=32,
        block_sizes=[16],
        max_num_blocks_per_req=[4],
    )
    missing = [name for name in vllm_runner.INPUT_BATCH_MEMBERS if not hasattr(batch, name)]
    assert not missing, moved(f"InputBatch's {missing}", "vllm_runner")
    assert batch.block_table[0].block_table.np.shape[0] == 2
    fields = {field.name for field in dataclasses.fields(CachedRequestState)}
    # worker/step/persistent_batch.py's fields of a new request.
    used = {"req_id", "prompt_token_ids", "prompt_embeds", "prompt_is_token_ids", "mm_features"}
    used |= {"sampling_params", "pooling_params", "generator", "block_ids", "num_computed_tokens"}
    used |= {"output_token_ids", "lora_request"}
    assert used <= fields, moved(f"CachedRequestState's {sorted(used - fields)}", "vllm_runner")


def test_the_ngram_proposer():
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    assert parameters(NgramProposer) == ["vllm_config"]
    assert parameters(NgramProposer.propose)[:5] == [
        "self",
        "num_speculative_tokens",
        "sampled_token_ids",
        "num_tokens_no_spec",
        "token_ids_cpu",
    ], moved("NgramProposer.propose", "vllm_runner")


def test_the_draft_proposer_loads_its_model_from_two_attributes():
    """vllm_runner.load_draft_model skips DraftModelProposer.__init__ and sets vllm_config and
    speculative_config only: `_get_model` and `_create_draft_vllm_config` must read no other attribute."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    read = _self_attributes(DraftModelProposer, ("_get_model", "_create_draft_vllm_config"))
    assert parameters(DraftModelProposer._get_model) == ["self"]
    assert read <= {"vllm_config", "speculative_config", "_create_draft_vllm_config"}, moved(
        f"DraftModelProposer._get_model (it now reads {sorted(read)})", "vllm_runner"
    )


def _self_attributes(cls, names: tuple[str, ...]) -> set[str]:
    """The attributes of `self` that `cls`'s methods `names` (as defined along its MRO) read or write."""
    read = set()
    for klass in cls.__mro__:
        for name in names:
            if name in vars(klass):
                tree = ast.parse(textwrap.dedent(inspect.getsource(vars(klass)[name])))
                read |= {
                    node.attr
                    for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                }
    return read


def test_the_eagle_proposer_loads_its_head_from_four_attributes():
    """vllm_runner.load_eagle3_head skips EagleProposer.__init__ and sets vllm_config, speculative_config,
    model and use_local_argmax_reduction: the methods it calls must read no other attribute of the proposer
    (their own methods and vLLM's logger aside)."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    methods = ("_get_model", "_create_draft_vllm_config", "_maybe_share_embeddings", "_maybe_share_lm_head")
    read = _self_attributes(EagleProposer, methods)
    allowed = {"vllm_config", "speculative_config", "model", "use_local_argmax_reduction", *methods}
    allowed |= {"_share_mtp_indices"}  # written by _maybe_share_lm_head
    assert read <= allowed, moved(
        f"EagleProposer's loading (it now reads {sorted(read - allowed)})", "vllm_runner"
    )


def test_the_gpu_runner_picks_eagle3_aux_layers_from_the_speculative_config_only():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    read = _self_attributes(GPUModelRunner, ("_get_eagle3_aux_layers_from_config",))
    assert read == {"speculative_config"}, moved(
        "GPUModelRunner._get_eagle3_aux_layers_from_config", "vllm_runner"
    )


# ---- vLLM's API server and CLI: vllm_neuron/upstream/vllm_server.py ---------------------------------------

# vLLM's run_server as server/launch.py repeats it: the steps before run_server_worker.
VLLM_RUN_SERVER = """\
async def run_server(args, **uvicorn_kwargs) -> None:
    \"\"\"Run a single-worker API server.\"\"\"
    decorate_logs("APIServer", skip_if_decorated=True)

    # Interrupt initialization if SIGTERM arrives before uvicorn installs its
    # own signal handlers. Once uvicorn is running it replaces this.
    def _interrupt_init(*_) -> None:
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, _interrupt_init)

    listen_address, sock = setup_server(args, reuse_port=False)
    await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)
"""


def test_launch_repeats_vllm_run_server_as_it_is():
    from vllm.entrypoints.launchers.api_server import entry

    assert inspect.getsource(entry.run_server) == VLLM_RUN_SERVER, (
        "vLLM's run_server changed: server/launch.py repeats its steps before run_server_worker; bring it "
        "in line, then update VLLM_RUN_SERVER (docs/maintaining.md)"
    )
    assert parameters(entry.run_server_worker)[:3] == ["listen_address", "sock", "args"]


def test_vllm_hooks_the_lifecycle_relies_on():
    """server/lifecycle.py: the app starts (ASGI lifespan) before vLLM's HTTP server listens, vLLM keeps its
    parsed arguments as app.state.args, and its SIGTERM handler starts the drain by calling the engine
    client's shutdown."""
    from uvicorn.server import Server
    from vllm.entrypoints.launchers import launcher
    from vllm.entrypoints.launchers.api_server import app_state

    startup = inspect.getsource(Server.startup)
    assert startup.index("self.lifespan.startup()") < startup.index("create_server"), (
        "uvicorn no longer starts the app before it listens: re-check server.lifecycle.app_starting"
    )
    assert "state.args = args" in inspect.getsource(app_state), moved("app.state.args", "vllm_server")
    serve_http = inspect.getsource(launcher.serve_http)
    assert "loop.add_signal_handler(signal.SIGTERM, signal_handler)" in serve_http
    assert "partial(engine_client.shutdown, timeout=timeout)" in serve_http, (
        "vLLM's SIGTERM handling no longer calls engine_client.shutdown: re-check how server.lifecycle "
        "marks the drain (vllm_neuron/upstream/vllm_server.py, call_before_shutdown)"
    )


def test_vllm_checks_admission_before_a_response_starts():
    """server/admission.py wraps EngineClient.check_admission: every generation endpoint's preflight."""
    from vllm.engine.protocol import EngineClient
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.v1.engine.async_llm import AsyncLLM

    assert parameters(EngineClient.check_admission) == ["self", "n", "request_id"], moved(
        "EngineClient.check_admission", "vllm_server"
    )
    assert "self.engine_client.check_admission(n)" in inspect.getsource(GenerateBaseServing._preflight)
    source = inspect.getsource(AsyncLLM.check_admission)
    assert "raise QueueOverflowError()" in source and "raise MaxQueuedTokensError()" in source
    # ... and again as a request enters the engine, with its id: server/admission.py lets that one pass.
    assert "self.check_admission(parent_params.n, parent_request.request_id)" in inspect.getsource(
        AsyncLLM.add_request
    )
    assert "self.check_admission(request_id=request.request_id)" in inspect.getsource(AsyncLLM._add_request)


def test_vllm_answers_a_failed_add_lora_with_its_message():
    """vllm_server.answer_refused_adapters_with_400 recognises the engine core's failure message, which
    /v1/load_lora_adapter passes on (as a 500) from OpenAIServingModels.load_lora_adapter."""
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.lora import api_router
    from vllm.v1.engine.core import EngineCoreProc

    core = inspect.getsource(EngineCoreProc)
    assert 'f"Call to {name} method failed: {str(e)}"' in core, moved(
        "the utility failure message", "vllm_server"
    )
    assert parameters(OpenAIServingModels.load_lora_adapter) == ["self", "request", "base_model_name"]
    load = inspect.getsource(OpenAIServingModels.load_lora_adapter)
    assert "await self.engine_client.add_lora(lora_request)" in load and "message=str(e)" in load
    assert "handler.load_lora_adapter(request)" in inspect.getsource(api_router)


def test_engine_client_methods_are_replaced_on_the_instance():
    calls = []

    class Client:
        def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
            calls.append(("vllm", n))

        def shutdown(self, timeout: float | None = None) -> None:
            calls.append(("shutdown", timeout))

    client = Client()
    vllm_server.wrap_admission_check(client, lambda check, n, request_id: check(n + 1))
    vllm_server.call_before_shutdown(client, lambda: calls.append(("before", None)))
    client.check_admission(2)
    client.shutdown(timeout=5)
    assert calls == [("vllm", 3), ("before", None), ("shutdown", 5)]


def test_the_serve_subcommand():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert issubclass(FlexibleArgumentParser, ArgumentParser) and callable(cli_env_setup)
    assert parameters(ServeSubcommand.subparser_init)[:2] == ["self", "subparsers"], moved(
        "ServeSubcommand.subparser_init", "vllm_server"
    )
    assert all(callable(getattr(ServeSubcommand, name, None)) for name in ("cmd", "validate"))


def test_the_api_key_check():
    from starlette.datastructures import Headers
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    assert parameters(AuthenticationMiddleware)[:2] == ["app", "tokens"], moved(
        "AuthenticationMiddleware", "vllm_server"
    )
    verify = vllm_server.api_key_verifier(["key"])
    assert verify(Headers({"authorization": "Bearer key"})) and not verify(
        Headers({"authorization": "Bearer x"})
    )
    assert "/v1" in vllm_server.api_key_guarded_prefixes()
