"""LoRA adapters served through the real engine (issue 39, slice 2): two adapters built offline with peft
(different ranks and target modules, random nonzero B) and the base model in one batch give HF's greedy
tokens with that adapter applied (peft), with no graph compiled after warm-up; adapters the slots cannot
hold, and configurations the slots do not serve, are refused by name."""

import copy
from pathlib import Path

import pytest
import torch

from tests.conftest import ENGINE_KWARGS
from tests.engine.test_neuron_startup import fake_neuron_environment
from tests.environment import TENSOR_PARALLEL_ENVIRONMENT
from tests.fp8_reference import round_kv_through_fp8
from tests.helpers import build_adapter, engine_config, hf_greedy, random_prompt, run_engine

MAX_TOKENS = 8
MAX_RANK = 16
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, seed): q and v only at rank 8; every projection at the maximum rank
ADAPTERS = {"qv": (8, 16, ["q_proj", "v_proj"], 1), "all": (MAX_RANK, 8, ATTENTION + MLP, 2)}
# Adapters the slots cannot hold, and the reason each is refused for.
REFUSED = {"head": (4, 4, ["q_proj", "lm_head"], 3), "wide": (2 * MAX_RANK, 2 * MAX_RANK, ["q_proj"], 3)}
REFUSED_MESSAGES = {
    "head": "targets modules the adapter slots do not hold: lm_head",
    "wide": "LoRA rank 32 is greater than max_lora_rank 16",
}
SHORT, LONG = random_prompt(5, seed=305), random_prompt(100, seed=400)
REPEATED = random_prompt(7, seed=306) * 4
ENGINE = {
    **ENGINE_KWARGS,
    "max_num_seqs": 8,
    "enable_lora": True,
    "max_loras": 2,
    "max_lora_rank": MAX_RANK,
    # The projections only: lm_head and embed_tokens get no slots, so an adapter on them is refused.
    "lora_target_modules": ATTENTION + MLP,
    # Few graphs, every path taken: sub-chunks (past 64 tokens), decode rows of several adapters, mixed calls
    # (a chunk beside a decode batch of up to 4).
    "additional_config": {"prefill_buckets": [64], "decode_batch_buckets": [4, 8], "context_buckets": [256]},
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """The served adapters (ADAPTERS, then a third that takes a slot by eviction) and two the slots cannot
    hold (REFUSED)."""
    folder = tmp_path_factory.mktemp("adapters")
    specs = ADAPTERS | {"third": (4, 8, ["o_proj", "down_proj"], 4)} | REFUSED
    return {
        name: (folder / name, build_adapter(tiny_model_dir, folder / name, *spec))
        for name, spec in specs.items()
    }


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, adapters) -> dict:
    """The module's one LoRA engine, in its own process (tests/lora_in_subprocess.py), with the calls on a
    thread of their own as on Trainium (VLLM_NEURON_DEVICE_THREAD=on), so that slot writes follow the calls
    already submitted."""
    # One batch (max_num_seqs 8): a short prompt with each adapter and with none, and a long one with an
    # adapter, chunked past the step's 96 tokens (sub-chunks of the 64-token bucket), whose last chunk rides
    # with the three decode rows in a mixed call.
    mixed = [(SHORT, name) for name in (*ADAPTERS, None)] + [(LONG, "all")]
    extra = {
        "adapters": {name: str(path) for name, (path, _) in adapters.items()},
        "mixed": mixed,
        "prompt": SHORT,
        "cycle": [*ADAPTERS, "third"],
        "refused": list(REFUSED),
    }
    env = {"VLLM_NEURON_DEVICE": "cpu", "VLLM_NEURON_DEVICE_THREAD": "on"}
    result = run_engine(
        tiny_model_dir, ENGINE, env, max_tokens=MAX_TOKENS, extra=extra, script="lora_in_subprocess.py"
    )
    assert result["device_thread"]
    return result


def references(adapters, hf_model) -> dict:
    return {name: model for name, (_, model) in adapters.items()} | {None: hf_model}


@pytest.mark.slow
def test_two_adapters_and_the_base_in_one_batch_give_hf_peft_tokens(lora_run, adapters, hf_model):
    assert lora_run["mixed_phases"] == ["decode", "mixed", "prefill"]
    models = references(adapters, hf_model)
    cases = [(SHORT, name) for name in (*ADAPTERS, None)] + [(LONG, "all")]
    assert lora_run["mixed"] == [hf_greedy(models[name], prompt, MAX_TOKENS) for prompt, name in cases]
    # Each adapter changes the short prompt's tokens: its slot is read, not the base's.
    tokens = lora_run["mixed"]
    assert tokens[0] != tokens[2] and tokens[1] != tokens[2]


@pytest.mark.slow
def test_no_graph_is_compiled_for_adapters(lora_run):
    """Every generate of the run (two adapters mixed, a third by eviction, reloads, refusals): 0 graphs."""
    [before], [after] = lora_run["compile_stats"]
    assert (after["graphs"], after["unexpected_recompiles"]) == (before["graphs"], 0)


@pytest.mark.slow
def test_the_slots_bytes_are_counted_beside_the_weights(lora_run):
    # Per layer and slot, in units of the rank: qkv A 3 x 128 + B (128 + 64 + 64), o 128 + 128, gate_up
    # A 2 x 128 + B 2 x 256, down 256 + 128 = 2048; 2 layers, 2 slots, rank 16, float32.
    [info] = lora_run["info"]
    assert (info["max_loras"], info["max_lora_rank"], sorted(info["slots"])) == (2, MAX_RANK, [1, 2])
    assert info["slot_bytes"] == 2048 * 2 * 2 * MAX_RANK * 4


@pytest.mark.slow
def test_the_check_measures_the_slots_of_each_layer_and_how_tp_splits_them(lora_run):
    """`vllm-neuron check`'s measure (server/check_engine.py), per layer in units of slots x rank x 4 bytes:
    held whole on each rank, A of the column-parallel qkv (3 x 128) and gate_up (2 x 128), B of the
    row-parallel o and down (128 each); split by tensor parallelism, their other halves (256 + 512 + 128 +
    256). Nothing else is wrapped (lora_target_modules)."""
    built = lora_run["built"]
    unit = 2 * MAX_RANK * 4
    assert built["adapter_slots"] == [2, MAX_RANK]
    assert built["adapter_layer_bytes"] == [[896 * unit, 1152 * unit]] * 2
    assert built["adapter_other_bytes"] == [0, 0]


@pytest.mark.slow
def test_an_adapter_evicted_and_reloaded_gives_the_same_tokens(lora_run, adapters, hf_model):
    """A third adapter takes the least recently used slot (and host copy: max_cpu_loras = max_loras); each
    evicted adapter, reloaded from its folder, gives its tokens again."""
    models = references(adapters, hf_model)
    names = [*ADAPTERS, "third"]
    expected = [hf_greedy(models[name], SHORT, MAX_TOKENS) for name in names]
    assert lora_run["cycle"] == expected * 2
    assert len({tuple(tokens) for tokens in expected}) == 3
    assert len(lora_run["loaded"]) == 2 and set(lora_run["loaded"]) <= {1, 2, 3}


@pytest.mark.slow
def test_an_adapter_the_slots_cannot_hold_is_refused_by_name(lora_run):
    assert set(lora_run["refused"]) == set(REFUSED)
    for name, message in REFUSED_MESSAGES.items():
        assert message in (lora_run["refused"][name] or "accepted"), lora_run["refused"][name]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_adapter_loads_on_trainium_compile_nothing_and_never_cross_the_host(
    tiny_model_dir, adapters, hf_model, tmp_path, ranks
):
    """Neuron mode on fake TorchNeuron, one rank or two (each rank's slice of the slots): load the adapter of
    the maximum rank, serve, unload, load one of a lower rank into the freed slot (vLLM's own writes of it
    would go through the host: rule (l)), serve. No eager kernel is compiled once the engine has started
    (rule (k): vLLM's reset of a slot would be a fill), nothing crosses the host (rule (l)), no write to the
    device waits (rule (j)), and the tokens are HF+peft's."""
    order = ["all", "qv"]
    assert ADAPTERS["qv"][0] < MAX_RANK == ADAPTERS["all"][0]
    extra = {
        "adapters": {name: str(adapters[name][0]) for name in order},
        "mixed": [(SHORT, None)],
        "prompt": SHORT,
        "cycle": [],
        "load_unload": order,
        "refused": [],
    }
    small = {"prefill_buckets": [64], "decode_batch_buckets": [2], "context_buckets": [256]}
    engine = ENGINE | {"max_num_seqs": 2, "additional_config": small}
    (tmp_path / "fake_neuron").mkdir()  # a record per process
    env = fake_neuron_environment(tmp_path / "fake_neuron", tmp_path / "compile-cache")
    if ranks > 1:
        engine |= {"tensor_parallel_size": ranks, "distributed_executor_backend": "mp"}
        env |= {"NEURON_RT_ROOT_COMM_ID": None, "MASTER_ADDR": None}
    result = run_engine(
        tiny_model_dir, engine, env, max_tokens=MAX_TOKENS, extra=extra, script="lora_in_subprocess.py"
    )
    models = references(adapters, hf_model)
    assert result["mixed"] == [hf_greedy(models[None], SHORT, MAX_TOKENS)]
    assert result["load_unload"] == [hf_greedy(models[name], SHORT, MAX_TOKENS) for name in order]
    assert len(result["fake_neuron"]) == ranks
    for fake in result["fake_neuron"]:
        seen = {"eager_kernels after start-up": len(fake["after"]["eager_kernels"])}
        for rule in ("host_round_trips", "host_reads", "eager_compiles"):
            seen[rule] = len(fake["start_up"][rule]) + len(fake["after"][rule])
        assert seen == dict.fromkeys(seen, 0), fake
        assert fake["blocking_to_device"] == {}  # rule (j): the slot writes wait for no graph


@pytest.mark.parametrize(
    "option, refused",
    [
        ({"fully_sharded_loras": True}, "--fully-sharded-loras is not supported"),
        (
            {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}},
            "with a draft model",
        ),
    ],
)
def test_lora_configurations_the_slots_do_not_serve_are_refused(tiny_model_dir, option, refused):
    if "speculative_config" in option:
        option["speculative_config"]["model"] = str(tiny_model_dir)
    with pytest.raises(ValueError, match=refused):
        engine_config(tiny_model_dir, enable_lora=True, **option)


@pytest.mark.slow
def test_two_ranks_and_ngram_verify_calls_over_an_fp8_cache_give_the_same_tokens(
    tiny_model_dir, adapters, hf_model
):
    """TP=2 (gloo, each rank's graphs lowered by the stablehlo backend): B of the column-parallel layers and A
    of the row-parallel ones split across the ranks, the adapters' share of the row-parallel output summed
    by the layer's all-reduce. With n-gram speculation, so that verify calls carry each row's slot for every
    query too, and an FP8 KV cache (scales 1.0), so that adapters' keys and values go through FP8. The mixed
    batch and a repeated phrase (whose n-grams propose drafts) give the tokens of HF+peft with its keys and
    values rounded through FP8 the same way."""
    mixed = [(SHORT, name) for name in (*ADAPTERS, None)] + [(LONG, "all"), (REPEATED, "qv")]
    extra = {
        "adapters": {name: str(adapters[name][0]) for name in ADAPTERS},
        "mixed": mixed,
        "prompt": SHORT,
        "cycle": [],
        "refused": [],
        "metrics": ["vllm:spec_decode_num_draft_tokens"],
    }
    speculative = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 2,
    }
    engine = ENGINE | {
        "kv_cache_dtype": "fp8",
        "tensor_parallel_size": 2,
        "speculative_config": speculative,
        "disable_log_stats": False,
    }
    result = run_engine(
        tiny_model_dir,
        engine,
        TENSOR_PARALLEL_ENVIRONMENT,
        max_tokens=MAX_TOKENS,
        extra=extra,
        script="lora_in_subprocess.py",
    )
    unit_scales = {0: (1.0, 1.0), 1: (1.0, 1.0)}
    models = {
        name: round_kv_through_fp8(copy.deepcopy(model), unit_scales)
        for name, model in references(adapters, hf_model).items()
    }
    assert result["mixed"] == [hf_greedy(models[name], prompt, MAX_TOKENS) for prompt, name in mixed]
    assert result["metrics"]["vllm:spec_decode_num_draft_tokens"] > 0
    assert [stats["kv_cache_dtype"] for stats in result["compile_stats"][1]] == ["uint8"] * 2
    # Each rank's slot bytes: the check's AdapterSlots at TP=2 (per layer 896 held whole, 1152 split: above).
    unit = 2 * MAX_RANK * 4
    assert [rank["slot_bytes"] for rank in result["info"]] == [2 * (896 + 1152 // 2) * unit] * 2  # 2 layers
    for before, after in zip(*result["compile_stats"], strict=True):
        assert (after["graphs"], after["unexpected_recompiles"]) == (before["graphs"], 0)
