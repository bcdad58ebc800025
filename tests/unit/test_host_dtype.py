"""CPU mode on hosts without native bfloat16 (issue 42): `--dtype auto` serves a bfloat16 checkpoint in a
dtype the host computes natively, an explicit --dtype is served as asked, Neuron's configuration keeps
bfloat16, and the host's ISA is reported."""

import json
import shutil

import pytest
import torch

from tests.helpers import engine_config
from vllm_neuron import host_cpu, platform


@pytest.fixture(scope="module")
def bfloat16_checkpoint(tiny_model_dir, tmp_path_factory):
    """The tiny model with a bfloat16 checkpoint dtype, as most served models have."""
    target = tmp_path_factory.mktemp("bf16") / "tiny-bf16"
    shutil.copytree(tiny_model_dir, target)
    config = json.loads((target / "config.json").read_text())
    config.pop("torch_dtype", None)
    (target / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    return target


def test_the_host_dtypes_follow_its_bfloat16(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_CPU_BF16", "native")
    assert host_cpu.fast_dtypes()[0] == torch.bfloat16
    monkeypatch.setenv("VLLM_NEURON_CPU_BF16", "emulated")
    assert host_cpu.fast_dtypes()[0] == torch.float32 and torch.bfloat16 not in host_cpu.fast_dtypes()
    monkeypatch.setenv("VLLM_NEURON_CPU_BF16", "auto")
    detected = bool({"avx512_bf16", "amx_bf16"} & host_cpu.flags())
    assert host_cpu.native_bfloat16() == detected
    assert host_cpu.describe()["native_bfloat16"] == detected
    # every reported feature is one the CPU has, by its flag
    assert {flag for flag, name in host_cpu.FEATURES.items() if name in host_cpu.isa()} <= host_cpu.flags()


@pytest.mark.parametrize(
    "bf16, target, dtype, served",
    [
        ("emulated", "", "auto", torch.float32),
        ("emulated", "", "bfloat16", torch.bfloat16),  # asked for: served as asked
        ("native", "", "auto", torch.bfloat16),
        ("emulated", "neuron", "auto", torch.bfloat16),  # a Trainium server's configuration
    ],
    ids=["emulated: float32", "emulated, --dtype bfloat16", "native: bfloat16", "neuron target"],
)
def test_dtype_auto_serves_what_the_host_computes_natively(
    bfloat16_checkpoint, monkeypatch, bf16, target, dtype, served
):
    monkeypatch.setenv("VLLM_NEURON_CPU_BF16", bf16)
    monkeypatch.setenv("VLLM_NEURON_TARGET", target)
    said: list[str] = []
    monkeypatch.setattr(platform.logger, "info", lambda message, *args: said.append(message % args))
    config = engine_config(bfloat16_checkpoint, dtype=dtype)
    assert config.model_config.dtype == served
    why = [line for line in said if "computes bfloat16 by emulation" in line]
    assert bool(why) == (dtype == "auto" and served == torch.float32)
