"""Every private vLLM or torch name the plugin reaches, in one place, each pinned by
tests/unit/test_upstream.py.

- `vllm_engine`: the engine side outside the model runner (platform, scheduler, MoE layer, worker);
- `vllm_runner`: the model runner and its parts (persistent batch, speculative decoding, draft model);
- `vllm_server`: the API server and `serve`'s command line;
- `torch_compile`: dynamo, AOTAutograd, inductor and the rest of torch's compile stack.

Each function or constant says which version it was written against and what internal it reaches. The call
sites import from here, never from the internal itself (tests/unit/test_upstream.py checks that), so moving to
the next vLLM or torch release starts in this package: docs/maintaining.md says how.

Importing this package imports nothing else; `vllm_engine`, `vllm_server` and `torch_compile` import vLLM's
and torch's internals when a function is called, so a light process (`vllm-neuron --help`) stays light.
"""
