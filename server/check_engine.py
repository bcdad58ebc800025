"""The engine `vllm-neuron check` runs: the configuration `serve` resolved, in CPU mode, with fewer layers,
random weights of the real shapes (unless told to load them) and a KV cache just large enough for one request
of max_model_len. It compiles through the `lower-only` backend, so warm-up traces and lowers every graph of
the bucket plan as TorchNeuron would, and runs none of them. Then it measures the model vLLM built."""

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from server.check_report import Verdict
from vllm_neuron.buckets import ceil_div
from vllm_neuron.compiler.compile import NeuronCompileError
from vllm_neuron.compiler.stablehlo import LoweringError, RuleError
from vllm_neuron.config import NeuronConfig
from vllm_neuron.planning.capacity import AdapterSlots, ModelFigures
from vllm_neuron.upstream import torch_compile

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.worker_base import WorkerBase


@dataclass(frozen=True)
class BuiltModel:
    """What the worker measured of the model vLLM built with the check's layers."""

    layer_bytes: list[int]  # each layer's own parameters and buffers
    layer_parameters: list[int]
    other_bytes: int  # embeddings, final norm, output head, tensors the layers share
    other_parameters: int
    kv_layers: int  # layers with a KV cache
    kv_heads: int
    head_size: int
    kv_dtype_bytes: int
    # --enable-lora: the slots' count and rank, and (bytes held whole, bytes split by TP) of each layer's
    # adapter slots and of the others' (embedding, logits).
    adapter_slots: tuple[int, int] | None = None
    adapter_layer_bytes: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    adapter_other_bytes: tuple[int, int] = (0, 0)

    def figures(self, name: str, layers: int, heads: int) -> ModelFigures:
        """The whole model of `layers` layers: the built layers' mean size for each (exact where every layer
        has the same weights, as in Llama; an average over a pattern of layer kinds otherwise)."""
        built = len(self.layer_bytes)
        return ModelFigures(
            name=name,
            parameters=self.other_parameters + sum(self.layer_parameters) * layers // built,
            weight_bytes=self.other_bytes + sum(self.layer_bytes) * layers // built,
            layers=self.kv_layers * layers // built,
            heads=heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_size,
            kv_dtype_bytes=self.kv_dtype_bytes,
            adapters=self._adapters(layers),
        )

    def _adapters(self, layers: int) -> AdapterSlots | None:
        if self.adapter_slots is None:
            return None
        built = len(self.layer_bytes)
        whole, split = (
            other + sum(layer[part] for layer in self.adapter_layer_bytes) * layers // built
            for part, other in enumerate(self.adapter_other_bytes)
        )
        return AdapterSlots(*self.adapter_slots, whole_bytes=whole, split_bytes=split)


@dataclass(frozen=True)
class CheckedEngine:
    graphs: list[dict[str, object]]  # each lowered graph's summary (LoweredGraph.summary)
    model: BuiltModel
    seconds: float  # engine start-up, warm-up's lowering included


def layer_overrides(hf_text_config: Any, total: int, layers: int) -> dict[str, Any]:
    """hf_overrides that keep a model's first `layers` layers: the layer count, and each per-layer list of the
    config (layer_types and the like) cut to match, so that a pattern of layer kinds starts as it does."""
    overrides: dict[str, Any] = {"num_hidden_layers": layers}
    for name, value in hf_text_config.to_dict().items():
        if "layer" in name and isinstance(value, list) and len(value) == total:
            overrides[name] = value[:layers]
    return overrides


def check_engine_args(
    engine_args: "EngineArgs", vllm_config: "VllmConfig", layers: int, load_weights: bool
) -> "EngineArgs":
    """The serve configuration `vllm_config` (resolved from `engine_args`) as the check runs it: one rank
    with the whole model (each rank's graph at TP > 1 has the same ops on its share of heads, and the
    `stablehlo` route stands in for the collectives anyway), the resolved limits and bucket plan pinned, fewer
    layers, and blocks for one request of max_model_len."""
    model_config, scheduler_config = vllm_config.model_config, vllm_config.scheduler_config
    block_size = vllm_config.cache_config.block_size
    total = model_config.get_total_num_hidden_layers()
    overrides = dict(engine_args.hf_overrides or {})
    if layers < total:
        overrides |= layer_overrides(model_config.hf_text_config, total, layers)
    return dataclasses.replace(
        engine_args,
        tensor_parallel_size=1,
        data_parallel_size=1,
        hf_overrides=overrides,
        load_format=engine_args.load_format if load_weights else "dummy",
        skip_tokenizer_init=True,  # no text goes in or out
        max_model_len=model_config.max_model_len,
        max_num_seqs=NeuronConfig.of(vllm_config).max_num_seqs,
        max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        block_size=block_size,
        additional_config=dict(vllm_config.additional_config),
        num_gpu_blocks_override=ceil_div(model_config.max_model_len, block_size) + 1,  # + vLLM's null block
        kv_cache_memory_bytes=None,
    )


def run(engine_args: "EngineArgs") -> CheckedEngine:
    """Start the engine in this process (warm-up lowers every graph), measure, shut it down. Raises what the
    start-up raises: a refusal, a graph that does not lower, a graph break."""
    from vllm import LLMEngine
    from vllm.usage.usage_lib import UsageContext

    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args, usage_context=UsageContext.OPENAI_API_SERVER)
    seconds = time.perf_counter() - start
    try:
        (graphs,) = engine.collective_rpc("lowered_graphs")
        (model,) = engine.collective_rpc(measure_model)
    finally:
        engine.engine_core.shutdown()
    return CheckedEngine(graphs=graphs, model=model, seconds=seconds)


def measure_model(worker: "WorkerBase") -> BuiltModel:
    """Run in the worker: the built model's bytes per layer and the shape of its KV cache."""
    runner = worker.model_runner
    model = runner.model
    prefix, layers = _decoder_layers(model, worker.model_config.get_total_num_hidden_layers())
    owners: dict[int, set[int]] = {}
    tensors: dict[int, torch.Tensor] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        found = re.match(rf"{re.escape(prefix)}\.(\d+)\.", name)
        owners.setdefault(id(tensor), set()).add(int(found.group(1)) if found else -1)
        tensors[id(tensor)] = tensor
    layer_bytes, layer_parameters = [0] * layers, [0] * layers
    other_bytes = other_parameters = 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        (owner,) = owners[key] if len(owners[key]) == 1 else (-1,)  # shared by several layers: counted once
        if owner >= 0:
            layer_bytes[owner] += size
            layer_parameters[owner] += tensor.numel() if isinstance(tensor, torch.nn.Parameter) else 0
        else:
            other_bytes += size
            other_parameters += tensor.numel() if isinstance(tensor, torch.nn.Parameter) else 0
    specs = list(runner.get_kv_cache_spec().values())
    shapes = {(spec.num_kv_heads, spec.head_size, spec.dtype.itemsize) for spec in specs}
    if len(shapes) != 1:
        raise RuntimeError(f"layers with different KV cache shapes {sorted(shapes)} are not modelled")
    ((kv_heads, head_size, dtype_bytes),) = shapes
    adapters = _adapter_bytes(runner.lora, prefix, layers, worker.vllm_config) if runner.lora else {}
    return BuiltModel(
        layer_bytes=layer_bytes,
        layer_parameters=layer_parameters,
        other_bytes=other_bytes,
        other_parameters=other_parameters,
        kv_layers=len(specs),
        kv_heads=kv_heads,
        head_size=head_size,
        kv_dtype_bytes=dtype_bytes,
        **adapters,
    )


def _adapter_bytes(slots, prefix: str, layers: int, vllm_config: "VllmConfig") -> dict[str, Any]:
    """BuiltModel's adapter fields: the LoRA slots' bytes (worker/lora/slots.py) by decoder layer."""
    per_layer, other = [[0, 0] for _ in range(layers)], [0, 0]
    for name, sizes in slots.bytes_by_module().items():
        found = re.match(rf"{re.escape(prefix)}\.(\d+)\.", name)
        owner = per_layer[int(found.group(1))] if found else other
        owner[0] += sizes[0]
        owner[1] += sizes[1]
    lora = vllm_config.lora_config
    return {
        "adapter_slots": (lora.max_loras, lora.max_lora_rank),
        "adapter_layer_bytes": [tuple(sizes) for sizes in per_layer],
        "adapter_other_bytes": tuple(other),
    }


def _decoder_layers(model: torch.nn.Module, layers: int) -> tuple[str, int]:
    """The name and length of the model's list of decoder layers: vLLM builds it as one ModuleList of as many
    layers as the config says; of the lists that long, the one holding the most parameters."""
    lists = [
        (sum(p.numel() for p in module.parameters()), name)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers
    ]
    if not lists:
        raise ValueError(f"no list of {layers} decoder layers found in {type(model).__name__}")
    return max(lists)[1], layers


def verdict_of(error: BaseException) -> Verdict:
    """Why the engine did not start: a graph that does not lower (op, source line, call), one that breaks a
    rule of neuronx-cc's (the first it breaks), a graph break, a graph TorchNeuron would refuse, a refused
    configuration, or anything else by its type and message."""
    chain = [error]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    lowering = next((err for err in chain if isinstance(err, LoweringError)), None)
    if isinstance(lowering, RuleError):
        broken = str(lowering).splitlines()[1].strip().split(": ", 1)[1]  # the first rule it breaks
        return Verdict(
            "breaks a trn2 rule", broken, call=lowering.call, op=lowering.op, source=lowering.source
        )
    if lowering is not None:
        reason = f"op {lowering.op} from {lowering.source}" if lowering.op else _first_line(lowering)
        return Verdict("does not lower", reason, call=lowering.call, op=lowering.op, source=lowering.source)
    refused = next((err for err in chain if isinstance(err, NeuronCompileError)), None)
    if refused is not None:
        return Verdict("does not compile", _first_line(refused))
    graph_break = next((err for err in chain if torch_compile.is_graph_break(err)), None)
    if graph_break is not None:
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', str(graph_break))
        source = "{}:{} in {}".format(*frames[-1]) if frames else ""
        return Verdict("graph break", _first_line(graph_break), source=source)
    if isinstance(error, ValueError | NotImplementedError):  # the platform's and vLLM's refusals
        from server.serve_args import platform_message

        return Verdict("refused", platform_message(error))
    return Verdict("failed", f"{type(error).__name__}: {_first_line(error)}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
