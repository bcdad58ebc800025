"""Tensor-parallel start-up checks and rank pinning: bad sizes fail before any engine starts, with a message
that names the constraint."""

import os

import pytest
import torch

from tests.helpers import engine_config
from vllm_neuron import device
from vllm_neuron.parallel import (
    TensorParallelError,
    check_fits_cores,
    check_heads,
    cpu_share,
    parse_cores,
    rank_core,
)


def test_core_ranges_parse_like_the_neuron_runtime():
    assert parse_cores("3") == [3]
    assert parse_cores("0-3") == [0, 1, 2, 3]
    assert parse_cores("4-5,8") == [4, 5, 8]
    for bad in ("a-b", "3-1"):
        with pytest.raises(TensorParallelError, match="NEURON_RT_VISIBLE_CORES"):
            parse_cores(bad)


def test_each_rank_gets_its_own_core_of_those_given():
    assert [rank_core(None, rank, 4) for rank in range(4)] == [0, 1, 2, 3]
    # The Kubernetes device plugin gives a pod e.g. cores 8-11: rank r takes the r-th of them.
    assert [rank_core("8-11", rank, 4) for rank in range(4)] == [8, 9, 10, 11]
    with pytest.raises(TensorParallelError, match="4 ranks on this node need 4 NeuronCores"):
        rank_core("8-9", 0, 4)


def test_cpu_mode_gives_each_worker_on_the_host_its_share_of_the_cpus(monkeypatch):
    """Data-parallel engines (and their TP ranks) on one host: each its own contiguous CPUs, as each has its
    own NeuronCore on Trainium; one worker alone keeps them all."""
    cpus = list(range(8))
    assert [cpu_share(cpus, slot, 2) for slot in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [cpu_share(cpus, slot, 3) for slot in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    with pytest.raises(TensorParallelError, match="4 workers on this host need a CPU each, but this process"):
        cpu_share([0, 1], 3, 4)
    pinned: list[set[int]] = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda _, cpus: pinned.append(set(cpus)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: pinned.append(n))
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    device.pin_rank(0, 1, assigned=1, host_workers=2)  # the second DP engine's one rank
    device.pin_rank(0, 1, assigned=None, host_workers=1)  # one engine: its process keeps every CPU
    assert pinned == [{2, 3}, 2]
    assert "NEURON_RT_VISIBLE_CORES" not in os.environ


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (4, 2, 3, "must divide the model's 4 attention heads; use one of \\[1, 2, 4\\]"),
        (6, 3, 2, "must divide the model's 3 KV heads"),
        (12, 4, 6, "each KV head is replicated: TP must then be a multiple of 4"),
    ],
)
def test_head_constraints_are_named(heads, kv_heads, tp, message):
    with pytest.raises(TensorParallelError, match=message):
        check_heads(heads, kv_heads, tp)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (4, 2, 4), (4, 1, 4), (8, 8, 8)])
def test_head_splits_and_replication_vllm_supports_pass(heads, kv_heads, tp):
    check_heads(heads, kv_heads, tp)


def test_tp_must_fit_the_visible_cores():
    check_fits_cores(4, 4)
    with pytest.raises(TensorParallelError, match="needs 8 NeuronCores on this node .* but 4 are visible"):
        check_fits_cores(8, 4)


def test_a_group_across_instances_is_refused_by_name(tiny_model_dir):
    with pytest.raises(
        ValueError, match="--nnodes 2: a tensor-parallel group across instances is not supported"
    ):
        engine_config(tiny_model_dir, tensor_parallel_size=2, nnodes=2, master_addr="10.0.0.1")


def test_tp_that_does_not_divide_the_heads_fails_at_start_up(tiny_model_dir):
    with pytest.raises(ValueError, match="attention heads \\(4\\) must be divisible by tensor parallel size"):
        engine_config(tiny_model_dir, tensor_parallel_size=3)


def test_kv_heads_tp_cannot_split_fail_at_start_up(tmp_path, tiny_model_dir):
    from transformers import LlamaConfig

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    LlamaConfig(
        vocab_size=452,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 must divide the model's 3 KV heads"):
        engine_config(tmp_path, tensor_parallel_size=2)


def test_tp2_engine_config_uses_our_communicator_and_multiprocess_executor(tiny_model_dir):
    from vllm.platforms import current_platform

    config = engine_config(tiny_model_dir, tensor_parallel_size=2)
    assert config.parallel_config.distributed_executor_backend == "mp"
    assert config.parallel_config.worker_cls == "worker.neuron_worker.NeuronWorker"
    assert current_platform.get_device_communicator_cls().endswith("cpu_communicator.CpuCommunicator")
