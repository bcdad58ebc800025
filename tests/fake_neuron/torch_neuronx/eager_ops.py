"""Rules (k) and (l) of the fake TorchNeuron: eager ops on device tensors, outside compiled graphs.

Which tensors are the device's: the fake's device tensors are host tensors, so a storage counts as a device
storage once a compiled graph has read or written it (its example inputs at the compile, its inputs and
outputs at each run): on Trainium every tensor a graph reads is a device tensor (weights, KV caches, token
slots, LoRA slots, each call's inputs). Eager tensor ops are intercepted at the Python methods (`copy_`,
`fill_`, `zero_`, `index_put_`, `__setitem__`, `__getitem__`), skipped while dynamo compiles (whose
tracing calls them on fake tensors; its flag is process-wide, so an op while another thread compiles is not
seen) and while a compiled graph runs in the thread; dynamo traces tensor methods by name, so the
interception changes no graph.

What TorchNeuron runs for each (parmoham-aws/test-repo-parmoham@98154b8, torch_neuronx/):
- a host tensor copied into a contiguous device tensor, at any storage offset, is a runtime write
  (python_ops/copy.py, csrc/utils/CopyUtils.cpp copy_cpu_to_neuron): rule (i)'s business, not recorded here;
- (k) every other op on a device tensor is a kernel neuronx-cc compiles once per new op, input shapes and
  dtypes (python_ops/torch_mlir/kernel.py, keyed in kernels/base.py): `fill_`, `zero_`,
  `index_put_`, `__setitem__` with tensor indices or a scalar (a scalar is expanded and copied), `__getitem__`
  with tensor indices (`index`, python_ops/__init__.py), and a device-to-device `copy_`
  (python_ops/torch_mlir/ops/copy.py, `src + 0`; float64 and bool take a runtime copy instead, and a copy
  without non_blocking also synchronizes the stream: not modelled, the plugin makes none); a fill's scalar is
  part of its key (static_argnums);
- (l) a write into a non-contiguous device view (python_ops/cast_policy.py `_write_to_noncontiguous_neuron`):
  a compiled transpose to the view's stride order runs first (k); a permutation of the whole storage then
  takes a device copy; anything else (a slice with gaps, such as `stacked[i, 0, :out, :r]` with r below the
  stacked rank, fails the device copy's size check; a broadcast skips the transpose) copies the WHOLE storage
  to the host and back: from a host source, four blocking transfers (copy.py's temporary, its read-back, the
  storage down and up);
- a device-to-host read that bypasses the to_host seam: recorded too (`host_reads`), and, unless
  non-blocking, counted as a synchronize (rule (g)): copy_neuron_to_cpu (csrc/utils/CopyUtils.cpp:73-118)
  waits until the stream is idle, every graph queued before it included. `copy_` from a device tensor into
  a host one (python_ops/copy.py, case B); `cpu()` and `tolist()` (aten::_to_copy to the CPU, blocking:
  python_ops/to_copy.py, cast_policy.py copy_neuron_to_cpu; torch's tensor_to_list converts to the CPU
  first); `item()` and the scalar conversions (`bool`, `int`, `float`: aten::_local_scalar_dense, which
  TorchNeuron runs as `self.cpu()`, csrc/aten/NeuronNativeFunctions.cpp:344-360). `cpu()` hands back a host
  copy of its own, as on Trainium. `numpy()` of a device tensor raises on Trainium (torch converts only CPU
  tensors): FakeNeuronRuleError here.
"""

import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not FakeTensor, FunctionalTensor, ...: those have no storage
_in_graph = threading.local()  # .running: a compiled graph runs in this thread


class DeviceStorages:
    """The storages compiled graphs touched, by address, each with a weak reference to the storage (PyTorch
    keeps one Python object per live storage): a freed storage's address, reused by a host tensor, is not
    the device's."""

    def __init__(self) -> None:
        self._by_address: dict[int, weakref.ref] = {}

    def add(self, values: Iterable[Any]) -> None:
        for value in values:
            if isinstance(value, list | tuple):  # a boxed call's one list of inputs
                self.add(value)
            elif type(value) in _PLAIN:
                storage = value.untyped_storage()
                address = storage.data_ptr()
                known = self._by_address.get(address)
                if address and (known is None or known() is not storage):
                    self._by_address[address] = weakref.ref(storage)

    def holds(self, value: Any) -> bool:
        if type(value) not in _PLAIN:
            return False
        storage = value.untyped_storage()
        known = self._by_address.get(storage.data_ptr())
        return known is not None and known() is storage


def _advanced(index: Any) -> bool:
    """Tensor (or list) indices: `index`/`index_put_`, not a view."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor | list) for part in parts)


def _permutes_whole_storage(view: torch.Tensor) -> bool:
    """`_write_to_noncontiguous_neuron`'s device path: the permuted source is copied over the whole storage,
    whose size check passes only where the view covers it (no gaps, no broadcast)."""
    return 0 not in view.stride() and view.numel() * view.element_size() == view.untyped_storage().nbytes()


class EagerRules:
    """Rules (k) and (l), recorded in the runtime's facts."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.storages = DeviceStorages()
        self._kernels: set[tuple] = set()
        runtime.facts.update(eager_kernels=[], host_round_trips=[], host_reads=[])

    def _append(self, key: str, entry: dict[str, Any]) -> None:
        with self.runtime.lock:
            self.runtime.facts[key].append({**entry, "thread": threading.current_thread().name})
        self.runtime.record()

    def kernel(self, op: str, tensors: list[torch.Tensor], static: list[Any] | None = None) -> None:
        """Rule (k): a kernel compiled once per new (op, input shapes, dtypes, static arguments)."""
        shapes = [list(t.shape) for t in tensors]
        dtypes = [str(t.dtype) for t in tensors]
        key = (op, repr(shapes), repr(dtypes), repr(static))
        with self.runtime.lock:
            new = key not in self._kernels
            self._kernels.add(key)
        if new:
            self._append("eager_kernels", {"op": op, "shapes": shapes, "dtypes": dtypes, "static": static})

    def write_view(self, op: str, view: torch.Tensor) -> None:
        """Rule (l): the value reaches a non-contiguous device view."""
        if view.is_contiguous():
            return
        if 0 not in view.stride():  # a broadcast goes to the host at once
            # The transpose to the view's stride order compiles and runs first; only a permutation of the
            # whole storage then fits the device copy's size check.
            order = sorted(range(view.dim()), key=lambda d: -view.stride(d))
            self.kernel("noncontiguous_copy_transpose", [view], [order])
            if _permutes_whole_storage(view):
                return
        self._append(
            "host_round_trips",
            {
                "op": op,
                "shape": list(view.shape),
                "stride": list(view.stride()),
                "storage_offset": view.storage_offset(),
                "dtype": str(view.dtype),
                "bytes": view.untyped_storage().nbytes(),
            },
        )

    # ---- the intercepted methods: each sees the operands before the op runs ----

    def copy_(self, dst: torch.Tensor, src: Any, *args: Any, **kwargs: Any) -> None:
        if self.storages.holds(dst):
            if self.storages.holds(src):
                self.kernel("copy_", [src, dst])
            self.write_view("copy_", dst)
        elif self.storages.holds(src):
            self.read("copy_", src, waits=not kwargs.get("non_blocking", bool(args and args[0])))

    def read(self, op: str, source: torch.Tensor, waits: bool = True) -> bool:
        """A device-to-host read past the to_host seam, if `source` is the device's (returns whether); a
        blocking one synchronizes."""
        if not self.storages.holds(source):
            return False
        self._append(
            "host_reads",
            {"op": op, "shape": list(source.shape), "dtype": str(source.dtype), "bytes": source.nbytes},
        )
        if waits:
            self.runtime.synchronize()
        return True

    def numpy(self, source: torch.Tensor, *_: Any, **__: Any) -> None:
        if self.storages.holds(source):
            from torch_neuronx import FakeNeuronRuleError

            raise FakeNeuronRuleError(
                f"numpy() of a device tensor (shape {list(source.shape)}): torch converts only CPU tensors "
                "(bring it to the host through vllm_neuron.device.to_host first)"
            )

    def fill_(self, dst: torch.Tensor, value: Any, *_: Any, **__: Any) -> None:
        if self.storages.holds(dst):
            static = None if isinstance(value, torch.Tensor) else [value]
            self.kernel("fill_", [dst], static)
            self.write_view("fill_", dst)

    def zero_(self, dst: torch.Tensor, *_: Any, **__: Any) -> None:
        if self.storages.holds(dst):
            self.kernel("zero_", [dst])
            self.write_view("zero_", dst)

    def index_put_(self, dst: torch.Tensor, indices: Any, values: Any, *_: Any, **__: Any) -> None:
        if self.storages.holds(dst):
            tensors = [dst, *(i for i in indices if isinstance(i, torch.Tensor))]
            self.kernel("index_put_", tensors + ([values] if isinstance(values, torch.Tensor) else []))

    def setitem(self, dst: torch.Tensor, index: Any, value: Any) -> None:
        if not self.storages.holds(dst):
            return
        if _advanced(index):
            self.index_put_(dst, [i for i in _parts(index) if isinstance(i, torch.Tensor)], value)
            return
        view = _ORIGINALS["__getitem__"](dst, index)
        if isinstance(value, torch.Tensor) and value.dim() > 0 or self.storages.holds(value):
            self.copy_(view, value)
        else:  # a scalar: made a device tensor, broadcast and copied on the device
            self.kernel("__setitem__", [view])
            self.write_view("__setitem__", view)

    def getitem(self, source: torch.Tensor, index: Any) -> None:
        if _advanced(index) and self.storages.holds(source):
            self.kernel("index", [source, *(i for i in _parts(index) if isinstance(i, torch.Tensor))])


def _parts(index: Any) -> tuple:
    return index if isinstance(index, tuple) else (index,)


_ORIGINALS: dict[str, Callable] = {}


def _outside_graphs() -> bool:
    """Neither a compiled graph running in this thread nor dynamo tracing: an eager op."""
    return not getattr(_in_graph, "running", False) and not torch.compiler.is_compiling()


def _intercept(name: str, rule: Callable[..., None]) -> None:
    original = _ORIGINALS.setdefault(name, getattr(torch.Tensor, name))

    @functools.wraps(original)
    def checked(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _outside_graphs():
            rule(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, checked)


def install(runtime: Any) -> EagerRules:
    """Rules (k) and (l) on `runtime`: its compiles and graph runs register the device storages, the tensor
    methods are intercepted, and `vllm_neuron.device.to_host` and `cpu()` hand back a host copy of their
    own, as on Trainium (the fake's `.to("cpu")` of a host tensor is the tensor itself: the device's
    storage)."""
    rules = EagerRules(runtime)
    compile_graph = runtime.compile

    def compiling(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        rules.storages.add(example_inputs)
        run = compile_graph(graph, example_inputs)

        def running(*args: Any) -> Any:
            rules.storages.add(args)
            before, _in_graph.running = getattr(_in_graph, "running", False), True
            try:
                outputs = run(*args)
            finally:
                _in_graph.running = before
            rules.storages.add(outputs)
            return outputs

        running.__dict__.update(run.__dict__)  # the calling convention dynamo reads from the function
        return running

    runtime.compile = compiling
    for name in ("copy_", "fill_", "zero_", "index_put_", "numpy"):
        _intercept(name, getattr(rules, name))
    _intercept("__setitem__", rules.setitem)
    _intercept("__getitem__", rules.getitem)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        _intercept(name, lambda tensor, *_, op=name, **__: rules.read(op, tensor))
    original_cpu = _ORIGINALS.setdefault("cpu", torch.Tensor.cpu)

    @functools.wraps(original_cpu)
    def cpu(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        host = original_cpu(tensor, *args, **kwargs)
        # The fake's device tensor is a host one: the read hands back a copy of its own, as on Trainium.
        return host.clone() if _outside_graphs() and rules.read("cpu", tensor) else host

    torch.Tensor.cpu = cpu

    import vllm_neuron.device

    to_host = vllm_neuron.device.to_host
    vllm_neuron.device.to_host = lambda tensor: to_host(tensor).clone()
    return rules
