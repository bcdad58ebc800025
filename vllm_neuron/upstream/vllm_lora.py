"""vLLM 0.32's LoRA seam as the plugin's punica wrapper reaches it: the wrapper base class the LoRA layers
call, and the forward context its ops read the call's adapter slots from. tests/test_lora_punica.py pins what
the wrapper relies on (the abstract ops, the layers' stacked weight shapes, the embedding layer reading
`_embeddings_indices`); docs/maintaining.md says what to do when one moves.
"""

# The base of every platform's punica wrapper: vLLM's LoRA layers call its ops (add_lora_linear, ...).
from vllm.forward_context import get_forward_context
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase

__all__ = ["PunicaWrapperBase", "get_forward_context"]
