"""Start-up checks: the plugin activates only when asked for, and refuses what it cannot serve with a message
that says what to change."""

import ctypes
import os
import subprocess
import sys

import pytest
import torch

import vllm_neuron
from tests.helpers import engine_config
from vllm_neuron import device


@pytest.fixture
def fresh_device_mode():
    device.mode.cache_clear()
    yield
    device.mode.cache_clear()


def test_register_stays_inactive_without_neuron_or_cpu_mode(monkeypatch):
    monkeypatch.delenv("VLLM_NEURON_DEVICE", raising=False)
    assert not device.neuron_device_present()
    assert vllm_neuron.register() is None  # vLLM keeps its own platform; CPU mode is never chosen silently
    monkeypatch.setenv("VLLM_NEURON_DEVICE", "auto")
    assert vllm_neuron.register() is None


def test_register_activates_cpu_mode_when_asked(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_DEVICE", "cpu")
    assert vllm_neuron.register() == "vllm_neuron.platform.NeuronPlatform"


def test_register_keeps_vllm_on_the_v1_model_runner(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_DEVICE", "cpu")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    vllm_neuron.register()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


@pytest.mark.slow
def test_importing_the_platform_changes_nothing():
    """No device resolution and no environment change at import: both wait until vLLM asks."""
    code = (
        "import os; before = dict(os.environ); from vllm_neuron import device, platform; "
        "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
        "assert device.mode.cache_info().currsize == 0; "
        "assert platform.NeuronPlatform.device_type == 'cpu' and device.mode.cache_info().currsize == 1"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_importing_the_cli_leaves_vllms_platform_unresolved_and_prometheus_unloaded():
    """`vllm-neuron serve` without VLLM_NEURON_DEVICE picks CPU mode after its imports: an import that made
    vLLM resolve its platform first (vllm.v1.outputs does) would serve on vLLM's own CPU platform."""
    code = "import server.cli, vllm.platforms; assert vllm.platforms._current_platform is None"
    # Nor may the CLI's imports load prometheus_client: its multiprocess directory (the engine's series on
    # /metrics) must be set before that.
    code += "; import sys; assert 'prometheus_client' not in sys.modules"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_DEVICE"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_unknown_device_mode_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_DEVICE", "gpu")
    with pytest.raises(ValueError, match="use auto, neuron or cpu"):
        vllm_neuron.register()


def test_neuron_mode_without_a_device_says_what_to_do(monkeypatch, fresh_device_mode):
    monkeypatch.setenv("VLLM_NEURON_DEVICE", "neuron")
    with pytest.raises(RuntimeError, match="VLLM_NEURON_DEVICE=cpu"):
        device.mode()


def test_engine_config_gets_our_worker_buckets_and_no_vllm_compilation(tiny_model_dir):
    from vllm.config import CompilationMode

    config = engine_config(tiny_model_dir, max_num_batched_tokens=128)
    assert config.parallel_config.worker_cls == "worker.neuron_worker.NeuronWorker"
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.scheduler_config.async_scheduling is True  # vLLM's default, kept
    assert config.scheduler_config.scheduler_cls == "vllm_neuron.scheduler.NeuronAsyncScheduler"
    assert config.cache_config.block_size == 32
    assert config.additional_config == {
        "prefill_buckets": [128],
        "decode_batch_buckets": [1, 2, 4],
        "context_buckets": [256],
        "decode_context_buckets": [],  # decode calls use the context buckets
        "prefill_tokens_while_decoding": 16,  # what a decode call takes along cheaply in CPU mode
        "mixed_batch_buckets": [1, 2],  # steps with at most max_num_seqs // 2 = 2 rows decoding
        "fresh_prefill_buckets": [],  # no prefill bucket is a multiple of 512
    }


@pytest.mark.parametrize(
    ("additional_config", "mixed_batch", "graphs"),
    [
        # prefill 2 x 2 contexts + decode 2 x 2 + mixed: the decode shapes of the mixed batches
        ({}, [1, 2], 12),
        ({"mixed_batch_buckets": [2]}, [2], 10),
        ({"mixed_batch_buckets": []}, [], 8),
        ({"prefill_tokens_while_decoding": 0}, [], 8),  # no cap, no capped steps to merge
        # decode and mixed calls over one context bucket of their own: 4 + 2 x 1 + 2 x 1
        ({"decode_context_buckets": [256]}, [1, 2], 8),
    ],
)
def test_mixed_calls(tiny_model_dir, additional_config, mixed_batch, graphs):
    from vllm_neuron.config import NeuronConfig

    buckets = {"prefill_buckets": [32, 64], "decode_batch_buckets": [1, 2], "context_buckets": [128, 256]}
    config = engine_config(tiny_model_dir, additional_config=buckets | additional_config)
    resolved = NeuronConfig.of(config).buckets
    assert config.additional_config["mixed_batch_buckets"] == mixed_batch
    assert resolved.mixed_batch_buckets == tuple(mixed_batch)
    assert resolved.mixed_chunk_bucket == (16 if mixed_batch else 0)  # the prefill share's chunk (16)
    assert resolved.num_graphs == graphs


@pytest.mark.parametrize(
    ("additional_config", "expected"),
    [
        ({"prefill_buckets": [32, 64, 128]}, 16),  # rides in the decode call: mixed_call_prefill_share()
        ({"prefill_buckets": [8]}, 8),  # at most the largest prefill bucket
        # Mixed calls off: the chunk's own call; the smallest prefill bucket of at least 48 ...
        ({"prefill_buckets": [32, 64, 128], "mixed_batch_buckets": []}, 64),
        ({"prefill_buckets": [16, 32], "mixed_batch_buckets": []}, 32),  # ... or the largest
        ({"prefill_tokens_while_decoding": 48}, 48),
        ({"prefill_tokens_while_decoding": 0}, 0),  # no cap
    ],
)
def test_prefill_share_while_decoding(tiny_model_dir, additional_config, expected):
    config = engine_config(tiny_model_dir, max_num_batched_tokens=128, additional_config=additional_config)
    assert config.additional_config["prefill_tokens_while_decoding"] == expected


def test_a_cpu_resolves_a_trainium_servers_defaults_for_the_neuron_target(tiny_model_dir, monkeypatch):
    """VLLM_NEURON_TARGET=neuron (what `vllm-neuron check` sets): the prefill share a NeuronCore takes along
    in a decode call, and no device memory for vLLM's batch defaults, as on Trainium."""
    from vllm.platforms import current_platform

    assert current_platform.get_device_total_memory() > 0  # CPU mode: the host's
    monkeypatch.setenv("VLLM_NEURON_TARGET", "neuron")
    config = engine_config(tiny_model_dir, max_num_batched_tokens=128)
    assert config.additional_config["prefill_tokens_while_decoding"] == 128
    with pytest.raises(NotImplementedError):
        current_platform.get_device_total_memory()
    monkeypatch.setenv("VLLM_NEURON_TARGET", "tpu")
    with pytest.raises(ValueError, match="VLLM_NEURON_TARGET='tpu'"):
        device.target()


def test_bucket_overrides_from_environment_win(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_DECODE_BATCH_BUCKETS", "2,4")
    config = engine_config(tiny_model_dir, additional_config={"decode_batch_buckets": [1, 4]})
    assert config.additional_config["decode_batch_buckets"] == [2, 4]


def test_sleep_mode_can_be_enabled(tiny_model_dir):
    # vLLM refuses --enable-sleep-mode where the platform says sleep mode is unavailable.
    assert engine_config(tiny_model_dir, enable_sleep_mode=True).model_config.enable_sleep_mode


def test_float64_is_refused(tiny_model_dir):
    import torch

    with pytest.raises(ValueError, match="TorchNeuron computes float64 as float32"):
        engine_config(tiny_model_dir, dtype=torch.float64)


@pytest.mark.parametrize(
    ("additional_config", "message"),
    [
        ({"decode_batch_buckets": [1, 8]}, "exceeds max_num_seqs=4"),
        ({"context_buckets": [128]}, "below max_model_len=256"),
        ({"context_buckets": [100, 256]}, "not multiples of the KV block size"),
        ({"decode_context_buckets": [128]}, "largest decode context bucket 128 is below max_model_len=256"),
        ({"decode_context_buckets": [100, 256]}, "decode context buckets .100. are not multiples"),
        ({"decode_context_buckets": [256, 128]}, "VLLM_NEURON_DECODE_CONTEXT_BUCKETS"),
        ({"prefill_buckets": [64, 32]}, "strictly ascending"),
        ({"prefill_bucket": [64]}, "unknown --additional-config keys"),
        ({"prefill_buckets": 64}, "must be a list of integers"),
        ({"prefill_tokens_while_decoding": -1}, "must be a non-negative integer"),
        ({"mixed_batch_buckets": [3]}, "are not decode batch buckets"),
        ({"mixed_batch_buckets": 2}, "must be a list of integers"),
        ({"fresh_prefill_buckets": [48]}, "fresh prefill buckets .48. are not prefill buckets"),
        ({"fresh_prefill_buckets": 64}, "fresh_prefill_buckets must be a list of integers"),
        (
            {"mixed_batch_buckets": [1], "prefill_tokens_while_decoding": 0},
            "needs prefill_tokens_while_decoding > 0",
        ),
    ],
)
def test_invalid_buckets_fail_at_start_up(tiny_model_dir, additional_config, message):
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_model_dir, additional_config=additional_config)


@pytest.mark.parametrize(
    ("additional_config", "fresh"),
    [
        ({"prefill_buckets": [128, 512]}, [512]),  # by default the buckets the flash kernel takes
        ({"prefill_buckets": [128, 512], "fresh_prefill_buckets": []}, []),
        ({"prefill_buckets": [128, 512], "fresh_prefill_buckets": [128]}, [128]),
    ],
)
def test_fresh_prefill_graphs_by_default_for_the_flash_kernels_buckets(
    tiny_model_dir, additional_config, fresh
):
    config = engine_config(
        tiny_model_dir, max_model_len=1024, max_num_batched_tokens=512, additional_config=additional_config
    )
    assert config.additional_config["fresh_prefill_buckets"] == fresh


def test_malformed_bucket_variable_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_PREFILL_BUCKETS", "64,lots")
    with pytest.raises(ValueError, match="VLLM_NEURON_PREFILL_BUCKETS"):
        engine_config(tiny_model_dir)


def _config_only_model(folder, tiny_model_dir, config) -> None:
    """A model folder with the tiny model's tokenizer and this config, and no weights (config checks only)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    config.save_pretrained(folder)


def test_sliding_window_models_are_accepted(tmp_path, tiny_model_dir):
    from transformers import MistralConfig

    config = MistralConfig(vocab_size=452, hidden_size=128, num_attention_heads=4, sliding_window=64)
    _config_only_model(tmp_path, tiny_model_dir, config)
    assert engine_config(tmp_path).model_config.get_sliding_window() == 64


def test_state_space_models_are_refused(tmp_path, tiny_model_dir):
    from transformers import MambaConfig

    _config_only_model(
        tmp_path, tiny_model_dir, MambaConfig(vocab_size=452, hidden_size=64, num_hidden_layers=2)
    )
    with pytest.raises(ValueError, match="state-space"):
        engine_config(tmp_path)


def test_automatic_bucket_policy_fits_the_graph_budget(tiny_model_dir):
    traffic = {"prompt_len": [8, 256], "output_len": [8, 64], "concurrency": 4}
    config = engine_config(
        tiny_model_dir,
        max_num_batched_tokens=128,
        additional_config={"bucket_policy": "auto", "graph_budget": 8, "traffic": traffic},
    )
    from vllm_neuron.config import NeuronConfig

    resolved = NeuronConfig.of(config)
    assert resolved.buckets.num_graphs <= 8
    assert set(config.additional_config) == {
        "prefill_buckets",
        "decode_batch_buckets",
        "context_buckets",
        "decode_context_buckets",
        "prefill_tokens_while_decoding",
        "mixed_batch_buckets",
        "fresh_prefill_buckets",
    }
    assert config.additional_config["fresh_prefill_buckets"] == []  # the policy's budget has none
    assert config.additional_config["decode_batch_buckets"][0] == 1


def test_automatic_bucket_policy_plans_with_the_cost_profile_asked_for(tiny_model_dir):
    """CPU mode plans with the CPU profile unless told otherwise; the trn2 estimate weighs a call's pass over
    the weights against ~220 token slots instead of 64, so it chooses other buckets."""
    from vllm_neuron.config import NeuronConfig

    def chosen(**policy):
        settings = {"bucket_policy": "auto", "graph_budget": 12, **policy}
        config = engine_config(tiny_model_dir, max_num_batched_tokens=128, additional_config=settings)
        return NeuronConfig.of(config).buckets

    assert chosen() == chosen(call_costs="cpu") != chosen(call_costs="trn2")


@pytest.mark.parametrize(
    ("additional_config", "message"),
    [
        ({"bucket_policy": "clever"}, 'must be "default" or "auto"'),
        ({"graph_budget": 12}, "only apply with"),
        ({"bucket_policy": "auto", "graph_budget": 1}, "raise graph_budget"),
        ({"bucket_policy": "auto", "traffic": {"prompt_len": [8, 64]}}, "missing"),
        ({"bucket_policy": "auto", "call_costs": "gpu"}, 'call_costs must be "cpu" or "trn2"'),
        ({"call_costs": "trn2"}, "only apply with"),
    ],
)
def test_bad_policy_settings_fail_at_start_up(tiny_model_dir, additional_config, message):
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_model_dir, additional_config=additional_config)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
        + ("fordblks", "keepcost")
    ]


def test_cpu_mode_keeps_freed_host_memory_for_the_next_step():
    """After keep_host_heap, a freed 16 MiB activation stays in the heap for reuse (by default glibc maps it
    and unmaps it on free, and every step page-faults it in again)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    assert device.keep_host_heap()
    activation = torch.ones(16 << 20, dtype=torch.uint8)
    del activation
    assert libc.mallinfo2().fordblks >= 16 << 20


def test_the_settings_are_resolved_once_and_read_back(tiny_model_dir, monkeypatch):
    """The platform's check resolves the settings once; the engine core and the workers read them back from
    the VllmConfig they are sent (pickled), whatever the environment says by then."""
    import pickle

    from vllm_neuron.config import NeuronConfig, NeuronConfigError

    config = engine_config(tiny_model_dir)
    resolved = NeuronConfig.of(config)
    assert resolved.compile_backend == "xla"  # tests/environment.py
    assert NeuronConfig.of(config) is resolved
    monkeypatch.setenv("VLLM_NEURON_DECODE_BATCH_BUCKETS", "2,4")
    monkeypatch.setenv("VLLM_NEURON_COMPILE_BACKEND", "eager")
    sent = pickle.loads(pickle.dumps(config))
    assert NeuronConfig.of(sent) == resolved
    assert sent.additional_config == config.additional_config
    # Settings nobody resolved are refused, not resolved again behind the platform's back.
    sent.additional_config = dict(sent.additional_config)
    with pytest.raises(NeuronConfigError, match="not resolved"):
        NeuronConfig.of(sent)
