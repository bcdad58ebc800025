"""The persistent compile cache: keyed by everything an artefact depends on, reused on restart."""

import json
import os

import pytest
from vllm.engine.arg_utils import EngineArgs

from tests.conftest import ENGINE_KWARGS
from vllm_neuron.compiler import compile_cache
from vllm_neuron.config import NeuronConfig


def configs(model_dir, **overrides):
    kwargs = dict(model=str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=4)
    kwargs.update(overrides)
    vllm_config = EngineArgs(**kwargs).create_engine_config()
    return vllm_config, NeuronConfig.of(vllm_config)


def key_of(model_dir, **overrides) -> str:
    return compile_cache.cache_key(compile_cache.key_fields(*configs(model_dir, **overrides)))


def test_key_is_stable_and_changes_with_what_the_graphs_depend_on(tiny_model_dir, tmp_path, monkeypatch):
    base = key_of(tiny_model_dir)
    assert key_of(tiny_model_dir) == base
    assert key_of(tiny_model_dir, dtype="bfloat16") != base
    assert key_of(tiny_model_dir, additional_config={"decode_batch_buckets": [1, 4]}) != base
    assert key_of(tiny_model_dir, max_model_len=128) != base
    # The prefill share per step is the chunk of the mixed calls, which are graphs too ...
    assert key_of(tiny_model_dir, additional_config={"prefill_tokens_while_decoding": 32}) != base
    assert key_of(tiny_model_dir, additional_config={"mixed_batch_buckets": []}) != base
    # ... but without mixed calls it is only a scheduling choice: the graphs do not depend on it.
    separate = [{"mixed_batch_buckets": [], "prefill_tokens_while_decoding": n} for n in (32, 64)]
    assert key_of(tiny_model_dir, additional_config=separate[0]) == key_of(
        tiny_model_dir, additional_config=separate[1]
    )
    # FP8 weights quantized at load and an FP8 KV cache: the same files, other graphs.
    half = key_of(tiny_model_dir, dtype="float16")
    assert len({half, key_of(tiny_model_dir, dtype="float16", quantization="fp8")}) == 2
    assert key_of(tiny_model_dir, kv_cache_dtype="fp8") != base
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert key_of(tiny_model_dir) != base
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    other_model = tmp_path / "other"
    other_model.mkdir()
    for item in tiny_model_dir.iterdir():
        (other_model / item.name).write_bytes(item.read_bytes())
    assert key_of(other_model) != base  # another model, even with the same files
    fields = compile_cache.key_fields(*configs(tiny_model_dir))
    fields["versions"] = {**fields["versions"], "torch": "9.9.9"}
    assert compile_cache.cache_key(fields) != base
    fields = compile_cache.key_fields(*configs(tiny_model_dir))
    fields["tensor_parallel_size"] = 2
    assert compile_cache.cache_key(fields) != base
    # Each tensor-parallel rank keeps its own artefacts.
    rank_1 = compile_cache.key_fields(*configs(tiny_model_dir), tp_rank=1)
    assert rank_1["tensor_parallel_rank"] == 1 and compile_cache.cache_key(rank_1) != base


def test_inductor_default_location_is_not_taken_for_a_choice(tiny_model_dir, tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()  # inductor writes its default into the environment on first use
    folder = compile_cache.prepare(*configs(tiny_model_dir))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")


def test_prepare_points_the_compilers_at_the_folder(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", "/mnt/users-own-neff-cache")
    folder = compile_cache.prepare(*configs(tiny_model_dir))
    assert folder.parent == tmp_path
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] == "/mnt/users-own-neff-cache"  # the user's choice wins
    described = json.loads((folder / "key.json").read_text())
    assert described["dtype"] == "torch.float32" and described["buckets"]["context_tokens"] == [256]


@pytest.mark.slow
def test_restart_reuses_compiled_graphs(tiny_model_dir, hf_model, tmp_path):
    """Inductor, the CPU stand-in for the NEFF cache, as a pre-warm Job and then a serving pod use it. The
    cold start (full readiness, two compiles at once) compiles all three graphs in compile processes before
    serving; the restart (staged) finds all three in the cache, the minimal ones (a prefill, a one-row
    decode) before it serves and the other in the background, and compiles nothing. The smallest plan
    that has both: no mixed calls, two decode buckets."""
    from tests.helpers import MAX_TOKENS, PROMPTS, hf_greedy, run_engine

    small = {
        **ENGINE_KWARGS,
        "max_num_seqs": 2,
        "additional_config": {
            "prefill_buckets": [64],
            "decode_batch_buckets": [1, 2],
            "context_buckets": [256],
            "mixed_batch_buckets": [],
        },
    }
    env = {
        "VLLM_NEURON_DEVICE": "cpu",
        "VLLM_NEURON_COMPILE_BACKEND": "inductor",
        "VLLM_NEURON_CACHE_ROOT": str(tmp_path),
        "TORCHINDUCTOR_CACHE_DIR": None,
    }
    cold = run_engine(
        tiny_model_dir, small, env | {"VLLM_NEURON_READINESS": "full", "VLLM_NEURON_COMPILE_WORKERS": "2"}
    )
    warm = run_engine(
        tiny_model_dir, small, env | {"VLLM_NEURON_READINESS": "staged"}, extra={"wait_background": True}
    )
    for run, readiness in ((cold, "full"), (warm, "staged")):
        progress = run["compile_progress"]
        assert (progress["graphs_total"], progress["graphs_ready"], progress["graphs_pending"]) == (3, 3, 0)
        assert progress["readiness"] == readiness and run["compile_stats"][0]["unexpected_recompiles"] == 0
    compiled, cached = "graphs_compiled_in_processes", "graphs_from_cache"
    assert cold["compile_progress"]["compile_workers"] == 2
    assert (cold["compile_progress"][compiled], cold["compile_progress"][cached]) == (3, 0)
    assert (warm["compile_progress"][compiled], warm["compile_progress"][cached]) == (0, 3)
    assert warm["tokens"] == cold["tokens"] == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    (folder,) = tmp_path.iterdir()  # one configuration, one folder
    assert any((folder / "inductor").rglob("*"))  # and the artefacts are in it


def test_warm_only_with_compiled_artefacts(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path))
    for variable in compile_cache.CACHE_VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)  # restored after the test
    folder = compile_cache.prepare(*configs(tiny_model_dir))
    compile_cache.prepare(*configs(tiny_model_dir))  # a restart before anything compiled
    assert (folder / "key.json").exists() and not compile_cache.is_warm(folder)
    neff = folder / "neff" / "ab" / "cd" / "abcd.neff"
    neff.parent.mkdir(parents=True)
    neff.write_bytes(b"NEFF")
    assert compile_cache.is_warm(folder)


def test_key_follows_the_neuron_compiler_and_its_flags(tiny_model_dir, monkeypatch):
    from importlib import metadata

    base = key_of(tiny_model_dir)
    monkeypatch.setenv("NEURON_CC_FLAGS", "--optlevel 1")
    assert key_of(tiny_model_dir) != base
    monkeypatch.delenv("NEURON_CC_FLAGS")
    monkeypatch.setenv("NEURON_COMPILER_OPT_LEVEL", "-O1")  # TorchNeuron's level for torch.compile graphs
    assert key_of(tiny_model_dir) != base
    monkeypatch.delenv("NEURON_COMPILER_OPT_LEVEL")
    installed = metadata.version

    def with_compiler(dist: str, compiler: str) -> str:
        return compiler if dist == "neuronx-cc" else installed(dist)

    keys = set()
    for compiler in ("2.21.0", "2.22.0"):
        monkeypatch.setattr(metadata, "version", lambda dist, c=compiler: with_compiler(dist, c))
        assert compile_cache.key_fields(*configs(tiny_model_dir))["versions"]["neuronx-cc"] == compiler
        keys.add(key_of(tiny_model_dir))
    assert len(keys) == 2 and base not in keys


def test_a_check_finds_the_folders_trainium_compiled_for_its_configuration(
    tiny_model_dir, tmp_path, monkeypatch
):
    """`vllm-neuron check` on a CPU: the folders Trainium hosts compiled for the same configuration, whatever
    their rank and versions; neither a CPU folder nor one of other buckets."""
    from vllm_neuron import device

    monkeypatch.setenv("VLLM_NEURON_CACHE_ROOT", str(tmp_path))
    for variable in compile_cache.CACHE_VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)  # restored after the test
    same, other = (
        configs(tiny_model_dir),
        configs(tiny_model_dir, additional_config={"decode_batch_buckets": [1]}),
    )
    cpu_folder = compile_cache.prepare(*same)
    monkeypatch.setattr(device, "mode", lambda: "neuron")
    monkeypatch.setattr(device, "compile_backend", lambda: "neuron")
    monkeypatch.setattr(device, "versions", lambda: {"torch": "2.13.0", "neuronx-cc": "2.22.0"})
    rank_1 = compile_cache.prepare(*same, tp_rank=1)
    other_buckets = compile_cache.prepare(*other)
    for index in range(2):
        (rank_1 / "neff" / f"{index}.neff").parent.mkdir(parents=True, exist_ok=True)
        (rank_1 / "neff" / f"{index}.neff").write_bytes(b"NEFF")
    monkeypatch.undo()  # back on the CPU, as the check runs

    found = compile_cache.neuron_folders(tmp_path, compile_cache.key_fields(*same))
    assert [path for path, _ in found] == [rank_1]
    ((_, recorded),) = found
    assert recorded["tensor_parallel_rank"] == 1 and recorded["versions"]["neuronx-cc"] == "2.22.0"
    assert compile_cache.artefact_count(rank_1) == 2
    assert {cpu_folder, other_buckets} <= set(tmp_path.iterdir())
