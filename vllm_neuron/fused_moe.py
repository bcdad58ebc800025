"""vLLM's FusedMoE layer on the Neuron platform: routing and experts traced into the step's graph, in the
plain torch of vllm_neuron/moe.py, so that they lower to StableHLO with the rest of the model.

vLLM builds every MoE layer (FusedMoEFactory) as a MoERunner holding a router, the expert weights and a
quant method. Two classes are replaced through vLLM's out-of-tree registration, the documented way for a
platform to supply a layer:
- MoERunner (a PluggableLayer): on an out-of-tree platform vLLM calls the experts through its custom op
  `vllm::moe_forward`, whose argument is the layer's name as an opaque script object: torch-mlir cannot
  lower it ("Could not deduce type from value info: FakeScriptObject") and what runs behind it is invisible
  to the compiler. NeuronMoERunner calls what that op calls directly, as vLLM does on CPU and TPU (vLLM's
  private entry points, reached in vllm_neuron/upstream/vllm_engine.py): the shared experts, the router gate
  and the tensor-parallel all-reduce stay vLLM's code.
- UnquantizedFusedMoEMethod (a CustomOp): monolithic, routing from the router logits itself, because
  vLLM's router for this case calls the `topk_softmax` kernel of vllm._C (absent from a Neuron build of
  vLLM, and opaque to the compiler); then the dense experts.

What the dense experts do not implement is refused when the model is built, naming the layer; a quantized
MoE model is refused earlier, by the platform (vLLM builds the quant method before the runner).
"""

import functools

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from vllm_neuron import moe
from vllm_neuron.refusals import UnsupportedConfigError
from vllm_neuron.upstream.vllm_engine import MoERunnerForwardInGraph


class NeuronUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Unquantized experts as vllm_neuron.moe computes them: softmax top-k routing, then dense experts."""

    @property
    def is_monolithic(self) -> bool:
        return True

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        super().process_weights_after_loading(layer)
        # vLLM's in-tree backends build the quant config here; left to the first forward, the state change
        # inside the traced step would make each bucket's graph compile a second time.
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)

    def apply_monolithic(
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weights, ids = moe.route(router_logits, layer.top_k, layer.renormalize)
        return moe.dense_experts(x, layer.w13_weight, layer.w2_weight, weights, ids)


class NeuronMoERunner(MoERunnerForwardInGraph, MoERunner):
    """vLLM's MoERunner with the expert computation called in the traced graph, not through a custom op."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        refused = unsupported(self)
        if refused:
            raise UnsupportedConfigError(f"Neuron plugin: MoE layer {self.layer_name}: {'; '.join(refused)}")


def unsupported(runner: MoERunner) -> list[str]:
    """What about this MoE layer the plugin's experts do not compute, each with what to change."""
    experts = runner.routed_experts
    router = runner.router
    parallel = runner.moe_config.moe_parallel_config
    refusals = {
        f"{type(router).__name__} routing is not supported, only softmax top-k routing (vLLM's "
        "FusedTopKRouter with softmax scoring: Mixtral, Qwen-MoE, OLMoE)": (
            type(router) is not FusedTopKRouter or router.scoring_func != "softmax"
        ),
        f"expert activation {experts.activation.value} is not supported, only SiLU-gated (SwiGLU) experts": (
            experts.activation is not MoEActivation.SILU
        ),
        "expert biases are not supported": runner.moe_config.has_bias,
        "router weights applied to the experts' input are not supported": (
            experts.apply_router_weight_on_input
        ),
        "expert and data parallelism are not supported: use --tensor-parallel-size alone": (
            parallel.use_ep or parallel.dp_size > 1
        ),
    }
    return [message for message, refused in refusals.items() if refused]


@functools.cache
def register() -> None:
    """Make vLLM build its MoE layers from the classes above; once per process, before a model is built."""
    MoERunner.register_oot(NeuronMoERunner)
    UnquantizedFusedMoEMethod.register_oot(NeuronUnquantizedFusedMoEMethod)
