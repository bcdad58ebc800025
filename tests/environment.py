"""The environment every engine of the tests runs in, set before vLLM is imported (by conftest, and by the
architecture matrix in its own process)."""

TEST_ENVIRONMENT = dict(
    # Our plugin in CPU mode, the engine core in this process, nothing leaves 127.0.0.1, no hub lookups, no
    # usage reports.
    VLLM_NEURON_DEVICE="cpu",
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    VLLM_HOST_IP="127.0.0.1",
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    VLLM_NO_USAGE_STATS="1",
    DO_NOT_TRACK="1",
    TOKENIZERS_PARALLELISM="false",
    # Any compile after warm-up fails the test that caused it. (So no test may call torch._dynamo.reset() in
    # the pytest process: it would drop the graphs of the engine the session shares.)
    VLLM_NEURON_STRICT_SHAPES="1",
    # Every engine compiles through TorchNeuron's lowering route to StableHLO, and XLA compiles and runs that
    # very program: each graph is proven to lower, to compute the tokens, and to keep the KV cache in place
    # (tensor parallelism: TENSOR_PARALLEL_ENVIRONMENT below).
    VLLM_NEURON_COMPILE_BACKEND="xla",
    # XLA's HLO passes as served (fusion, buffer assignment: what the in-place checks read), LLVM's code
    # generation unoptimised and without its expensive passes: each tiny graph compiles in about 55% of the
    # time, and runs for microseconds.
    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    # A KV cache the size the tests use (the CPU default is 512 MiB): in bfloat16 XLA's CPU compiler converts
    # the whole cache around each write (no bfloat16 scatter), so every call's cost follows its size.
    VLLM_NEURON_CPU_KV_CACHE_BYTES=str(64 * 1024**2),
    # No collection after each dynamo compile (a gc.collect(1) per graph, ~1 s of CPU per 15 graphs under
    # cProfile): the tests' interpreter collects rarely anyway (tests/interpreter/sitecustomize.py).
    TORCH_DYNAMO_RUN_GC_AFTER_COMPILE="0",
    # Every graph before the engine serves, so each test sees the calls of the whole bucket set; staged
    # readiness has its own tests (tests/engine/test_staged_readiness.py).
    VLLM_NEURON_READINESS="full",
)
# Tensor-parallel engines: XLA runs one rank's program, so the ranks' graphs (with their collectives) run as
# FX graphs under the stablehlo backend, lowered all the same.
TENSOR_PARALLEL_ENVIRONMENT = dict(VLLM_NEURON_DEVICE="cpu", VLLM_NEURON_COMPILE_BACKEND="stablehlo")
