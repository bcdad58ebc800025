"""vLLM platform plugin for AWS Trainium through TorchNeuron.

`register()` is the `vllm.platform_plugins` entry point. It runs in every vLLM process during platform
detection, before vLLM imports the platform class or reads its settings, so it stays cheap and imports nothing
from vLLM.
"""

import logging
import os

logger = logging.getLogger("vllm.vllm_neuron")

PLATFORM_CLS = "vllm_neuron.platform.NeuronPlatform"


def register() -> str | None:
    """Our platform with a Neuron device or CPU mode is asked for, else None (vLLM keeps its own)."""
    from vllm_neuron import device

    mode = device.requested_mode()
    if mode is None:
        return None
    if mode == "cpu":
        logger.info("vllm-torchneuron: CPU mode (VLLM_NEURON_DEVICE=cpu), no Neuron device will be used")
    # Our runner drives vLLM's V1 scheduler protocol; the V2 runner changes what the scheduler sends. vLLM
    # reads the variable from the engine configuration on; child processes inherit it.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    return PLATFORM_CLS
