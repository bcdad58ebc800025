"""Ray: refused at start-up with the reason, in both device modes, and the platform attributes vLLM's Ray and
data-parallel code read."""

from types import SimpleNamespace

import pytest

from tests.helpers import engine_config
from vllm_neuron import parallel
from vllm_neuron.platform import NeuronPlatform


@pytest.fixture
def ray_installed(monkeypatch):
    """Ray is not installed here (nor in the image), and vLLM refuses a Ray backend itself when it cannot
    import Ray, before the platform's check. Standing in for an installed Ray: its availability check passes,
    and vLLM's first Ray executor class (which imports without Ray, unlike the default V2 one) is the one
    resolved, so the config reaches the plugin's refusal as it would where Ray is installed."""
    import vllm.envs
    from vllm.v1.executor import ray_utils

    monkeypatch.setattr(ray_utils, "assert_ray_available", lambda: None)
    # An attribute, not the variable: an engine started earlier in the session froze vLLM's envs cache.
    monkeypatch.setattr(vllm.envs, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND", False, raising=False)


@pytest.mark.parametrize(
    "overrides",
    [
        {"distributed_executor_backend": "ray", "tensor_parallel_size": 2},
        {"distributed_executor_backend": "ray"},
        {"data_parallel_backend": "ray"},
    ],
)
def test_ray_is_refused_through_the_engine_config(tiny_model_dir, ray_installed, overrides):
    with pytest.raises(ValueError, match="Ray is not supported") as refused:
        engine_config(tiny_model_dir, **overrides)
    message = str(refused.value)
    assert "--distributed-executor-backend mp" in message and "MASTER_ADDR" in message


def test_the_multiprocess_executor_is_still_the_default(tiny_model_dir):
    assert (
        engine_config(tiny_model_dir, tensor_parallel_size=2).parallel_config.distributed_executor_backend
        == "mp"
    )


def test_ray_is_refused_in_neuron_mode_too():
    """parallel.check gets the visible core count in Neuron mode; Ray is refused before it is used."""
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            nnodes=1, use_ray=True, data_parallel_backend="mp", tensor_parallel_size=1
        )
    )
    with pytest.raises(parallel.TensorParallelError, match="Ray is not supported"):
        parallel.check(config, visible_cores=4)


def test_platform_attributes():
    # vLLM's mark of a platform without Ray: its Ray code would raise "does not support ray" past our check.
    assert NeuronPlatform.ray_device_key == ""
    assert NeuronPlatform.ray_noset_device_env_vars == []
    # The Neuron runtime's (and the device plugin's) core list; vLLM's data-parallel launcher splits it.
    assert NeuronPlatform.device_control_env_var == "NEURON_RT_VISIBLE_CORES"
