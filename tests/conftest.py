"""Test-wide settings and shared fixtures: a tiny model built offline, a cached engine, HF references."""

import fcntl
import os
from pathlib import Path

from tests.environment import TEST_ENVIRONMENT

# Before anything imports vLLM.
os.environ.update(TEST_ENVIRONMENT)
# The tests' interpreter settings (tests/interpreter/sitecustomize.py): in this process now, in every process
# it starts from its start-up.
INTERPRETER = Path(__file__).resolve().parent / "interpreter"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INTERPRETER), os.environ.get("PYTHONPATH")]))
import tests.interpreter.sitecustomize  # noqa: E402, F401

# pytest-xdist's workers share the host's cores: one thread each (as the architecture matrix's shards), so
# that idle OpenMP threads spinning in one worker do not take the core another is tracing on.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402

from tests.tiny_model import build_tiny_llama  # noqa: E402

# The engine configuration shared by engine and server tests: small enough to warm up in seconds, and
# chosen so that prompts exercise every path: chunked prefill across steps (prompt > 96 tokens), sub-chunks
# within a step (chunk > 64), decode batches of several buckets, two context buckets.
MAX_MODEL_LEN = 256
ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=4,
    max_num_batched_tokens=96,
    seed=0,
    additional_config={
        "prefill_buckets": [32, 64],
        "decode_batch_buckets": [1, 2, 4],
        "context_buckets": [128, 256],
        # Capped steps carry 64 prefill tokens (the CPU default is 16), so that the scripted steps show the
        # cap, a capped chunk that is a whole prompt, and one that ends a prompt chunked across steps.
        "prefill_tokens_while_decoding": 64,
        # A fresh prefill graph for first chunks of 33-64 tokens (the default gives them to buckets of 512
        # tokens and more, which TorchNeuron's flash kernel takes), so that HF parity covers both forms.
        "fresh_prefill_buckets": [64],
    },
)
# prefill (32,128) (32,256) (64,128) (64,256) + fresh prefill (64) + decode 3 batch x 2 context + mixed: the
# decode shapes of batch 1 and 2 (at most max_num_seqs // 2 rows), each with a 64-token chunk
EXPECTED_GRAPHS = 15
# One bucket of each kind for the engines a test builds beside the shared one: a prefill, a decode and a mixed
# graph (a fifth of the shared plan's warm-up), every phase still taken.
FEW_BUCKETS = {"prefill_buckets": [64], "decode_batch_buckets": [2], "context_buckets": [256]}
FEW_BUCKETS_ENGINE = ENGINE_KWARGS | {"additional_config": FEW_BUCKETS}
FEW_BUCKETS_GRAPHS = 3
# Each form of call the shared plan has, at one bucket: prefill over the cache, fresh prefill, decode, and
# mixed with the shared plan's 64-token chunk, for an engine beside the shared one whose tokens are compared
# with its.
EVERY_FORM = FEW_BUCKETS | {"prefill_tokens_while_decoding": 64, "fresh_prefill_buckets": [64]}
EVERY_FORM_ENGINE = ENGINE_KWARGS | {"additional_config": EVERY_FORM}
EVERY_FORM_GRAPHS = 4


def run_folder(tmp_path_factory) -> Path:
    """The temporary folder of this pytest run: under pytest-xdist, the parent the workers' folders share."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture(scope="session", autouse=True)
def compile_cache_root(tmp_path_factory) -> Path:
    """Compile artefacts of the test session stay in its temporary folder (children inherit it). XLA's
    executables are shared by every process of the run, each worker's included: keyed by the module and the
    host, one serves every engine of the same shapes (vllm_neuron/compiler/xla.py), as a NEFF in TorchNeuron's
    cache does."""
    root = tmp_path_factory.mktemp("compile-cache")
    os.environ["VLLM_NEURON_CACHE_ROOT"] = str(root)
    os.environ["VLLM_NEURON_XLA_CACHE_DIR"] = str(run_folder(tmp_path_factory) / "xla-executables")
    return root


@pytest.fixture(scope="module", autouse=True)
def host_share(request, tmp_path_factory):
    """pytest-xdist's workers share the host module by module; a module marked `alone` (leases and timeouts
    that a busy host breaks) waits for the other workers' engine modules to end, and holds the host until it
    ends. Unit tests start no engine: they run beside any module."""
    if "PYTEST_XDIST_WORKER" not in os.environ or is_unit_test(request.node):
        yield
        return
    with HostLock(run_folder(tmp_path_factory), alone=request.node.get_closest_marker("alone")):
        yield


def is_unit_test(node) -> bool:
    return node.path.parent.name == "unit"


class HostLock:
    """A readers-writer lock over two files the workers share: the gate gives a waiting writer precedence."""

    def __init__(self, folder: Path, alone: object) -> None:
        self.gate = open(folder / "host-gate.lock", "a")  # noqa: SIM115 (held as long as the lock)
        self.share = open(folder / "host-share.lock", "a")  # noqa: SIM115
        self.alone = bool(alone)

    def __enter__(self) -> None:
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        fcntl.flock(self.share, fcntl.LOCK_EX if self.alone else fcntl.LOCK_SH)
        if not self.alone:
            fcntl.flock(self.gate, fcntl.LOCK_UN)

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self.share, fcntl.LOCK_UN)
        fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.gate.close()
        self.share.close()


@pytest.fixture(autouse=True)
def neuron_cc_flags_restored():
    """An FP8 engine's configuration adds neuronx-cc's FP8 option to NEURON_CC_FLAGS, process-wide as on a
    trn2 (vllm_neuron/device.py): undone after each test, so that no later engine or compile key sees it."""
    saved = os.environ.get("NEURON_CC_FLAGS")
    yield
    if saved is None:
        os.environ.pop("NEURON_CC_FLAGS", None)
    else:
        os.environ["NEURON_CC_FLAGS"] = saved


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def llm(tiny_model_dir):
    """One engine for the whole session: warm-up compiles every bucket once."""
    from vllm import LLM

    engine = LLM(model=str(tiny_model_dir), **ENGINE_KWARGS)
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def api_server(tiny_model_dir, tmp_path_factory):
    """One `vllm-neuron serve` of the tiny model for the HTTP tests, with an API key, a body limit and a step
    trace. Each form of call at one bucket (EVERY_FORM): the shared engine covers the bucket plan."""
    import json

    from tests.serving import API_KEY, MAX_REQUEST_BYTES, ServerProcess

    folder = tmp_path_factory.mktemp("server")
    server = ServerProcess(
        tiny_model_dir,
        folder / "server.log",
        "--additional-config",  # after the test plan's
        json.dumps(EVERY_FORM),
        "--api-key",
        API_KEY,
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        step_trace=folder / "steps.jsonl",
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def model_runner(llm):
    """The NeuronModelRunner inside an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


# Session engines: under pytest-xdist (`make test` runs two workers) the files that use one run on the same
# worker, so each is built once.
SHARED_ENGINES = ("llm", "api_server")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` each file is one unit of work (its module fixtures start once), and the files
    that share a session engine are one unit; without it the groups change nothing. The modules marked
    `alone` come last, as one unit, after the unit tests: the other worker runs unit tests beside them
    instead of waiting. (A wrapper: xdist reads the groups in a hook of its own.) Tests marked `neuron` skip
    without a Trainium host."""
    items.sort(key=run_order)  # stable: files keep their order within each part
    for item, unit in work_units(items).items():
        item.add_marker(pytest.mark.xdist_group(unit))
    _skip_neuron_tests(items)
    return (yield)


def run_order(item) -> int:
    """Engine tests, then unit tests, then the modules that need the host to themselves."""
    if item.get_closest_marker("alone"):
        return 2
    return 1 if is_unit_test(item) else 0


def work_units(items) -> dict:
    """Each test's unit of work: `alone` for the modules so marked, else the first shared engine its file
    uses, else its file."""
    used: dict[Path, set[str]] = {}
    for item in items:
        used.setdefault(item.path, set()).update(getattr(item, "fixturenames", ()))
    units = {}
    for item in items:
        engines = [engine for engine in SHARED_ENGINES if engine in used[item.path]]
        if item.get_closest_marker("alone"):
            units[item] = "alone"
        else:
            units[item] = engines[0] if engines else item.path.name
    return units


def _skip_neuron_tests(items) -> None:
    """Tests marked `neuron` need a Trainium host with TorchNeuron; elsewhere they skip."""
    from vllm_neuron import device

    if device.neuron_device_present():
        return
    skip = pytest.mark.skip(reason="needs a Neuron device (torch-neuronx on a Trainium host)")
    for item in items:
        if "neuron" in item.keywords:
            item.add_marker(skip)
