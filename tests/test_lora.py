"""LoRA adapters served through the real engine (issue 39, slice 2): two adapters built offline with peft
(different ranks and target modules, random nonzero B) and the base model in one batch give HF's greedy
tokens with that adapter applied (peft), with no graph compiled after warm-up; adapters the slots cannot
hold, and configurations the slots do not serve, are refused by name."""

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import ENGINE_KWARGS
from tests.helpers import engine_config, greedy, hf_greedy, random_prompt

MAX_TOKENS = 8
MAX_RANK = 16
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, seed): q and v only at rank 8; every projection at the maximum rank
ADAPTERS = {"qv": (8, 16, ["q_proj", "v_proj"], 1), "all": (MAX_RANK, 8, ATTENTION + MLP, 2)}
SHORT, LONG = random_prompt(5, seed=305), random_prompt(100, seed=400)
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


def calls_by_phase() -> Counter:
    """The calls the engine (in this process) ran so far, by phase."""
    from vllm_neuron import metrics

    counts: Counter = Counter()
    for metric in metrics.BUCKET_CALLS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counts[sample.labels["phase"]] += sample.value
    return counts


def build_adapter(base_dir: Path, out: Path, rank: int, alpha: int, targets: list[str], seed: int):
    """A peft adapter with random A and B (init_lora_weights=False: the default B = 0 is a no-op), saved to
    `out`; returns the HF model with it applied."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config).eval()
    peft_model.save_pretrained(out)
    return peft_model


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, adapter_dir) -> dict[str, tuple[Path, torch.nn.Module]]:
    return {
        name: (adapter_dir / name, build_adapter(tiny_model_dir, adapter_dir / name, *spec))
        for name, spec in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir):
    """The module's one engine: two adapter slots of rank up to 16, and the calls on a thread of their own as
    on Trainium (VLLM_NEURON_DEVICE_THREAD=on), so that slot writes follow the calls already submitted."""
    from vllm import LLM

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_NEURON_DEVICE_THREAD", "on")  # read by the engine core process at its start
        engine = LLM(model=str(tiny_model_dir), **ENGINE)
    [threaded] = engine.collective_rpc("device_thread")
    assert threaded
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_two_adapters_and_the_base_in_one_batch_give_hf_peft_tokens(lora_llm, adapters, hf_model):
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    [before] = lora_llm.collective_rpc("compile_stats")
    calls_before = calls_by_phase()
    requests = {
        name: LoRARequest(name, lora_id, str(path))
        for lora_id, (name, (path, _)) in enumerate(adapters.items(), start=1)
    }
    # One generate call, one batch (max_num_seqs 8): a short prompt with each adapter and with none, and a
    # long one with an adapter, chunked past the step's 96 tokens (sub-chunks of the 64-token bucket), whose
    # last chunk rides with the three decode rows in a mixed call.
    cases = [(SHORT, name) for name in (*ADAPTERS, None)] + [(LONG, "all")]
    outputs = lora_llm.generate(
        [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in cases],
        greedy(MAX_TOKENS),
        lora_request=[requests[name] if name else None for _, name in cases],
        use_tqdm=False,
    )
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    assert set(calls_by_phase() - calls_before) == {"prefill", "decode", "mixed"}
    references = {name: model for name, (_, model) in adapters.items()} | {None: hf_model}
    assert tokens == [hf_greedy(references[name], prompt, MAX_TOKENS) for prompt, name in cases]
    # Each adapter changes the short prompt's tokens: its slot is read, not the base's.
    assert tokens[0] != tokens[2] and tokens[1] != tokens[2]
    [after] = lora_llm.collective_rpc("compile_stats")
    assert (after["graphs"], after["unexpected_recompiles"]) == (before["graphs"], 0)


@pytest.mark.slow
def test_the_slots_bytes_are_counted_beside_the_weights(lora_llm):
    # Per layer and slot, in units of the rank: qkv A 3 x 128 + B (128 + 64 + 64), o 128 + 128, gate_up
    # A 2 x 128 + B 2 x 256, down 256 + 128 = 2048; 2 layers, 2 slots, rank 16, float32.
    [info] = lora_llm.collective_rpc("lora_info")
    assert (info["max_loras"], info["max_lora_rank"], len(info["slots"])) == (2, MAX_RANK, 2)
    assert info["slot_bytes"] == 2048 * 2 * 2 * MAX_RANK * 4


@pytest.mark.slow
def test_an_adapter_evicted_and_reloaded_gives_the_same_tokens(
    lora_llm, adapters, tiny_model_dir, adapter_dir
):
    """A third adapter takes the least recently used slot (and host copy: max_cpu_loras = max_loras); the
    evicted adapter, reloaded from its folder, gives its tokens again, with no graph compiled."""
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    build_adapter(tiny_model_dir, adapter_dir / "third", 4, 8, ["o_proj", "down_proj"], seed=4)
    requests = [
        LoRARequest(name, lora_id, str(adapter_dir / name)) for lora_id, name in enumerate(ADAPTERS, 1)
    ]
    requests.append(LoRARequest("third", 3, str(adapter_dir / "third")))
    [before] = lora_llm.collective_rpc("compile_stats")
    prompt = [TokensPrompt(prompt_token_ids=SHORT)]

    def generate(request: "LoRARequest") -> list[int]:
        [output] = lora_llm.generate(prompt, greedy(MAX_TOKENS), lora_request=request, use_tqdm=False)
        return list(output.outputs[0].token_ids)

    first = [generate(request) for request in requests]
    again = [generate(request) for request in requests]  # each evicts the least recently used
    assert again == first
    assert len({tuple(tokens) for tokens in first}) == 3
    assert lora_llm.llm_engine.list_loras() <= {1, 2, 3} and len(lora_llm.llm_engine.list_loras()) == 2
    [after] = lora_llm.collective_rpc("compile_stats")
    assert (after["graphs"], after["unexpected_recompiles"]) == (before["graphs"], 0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, rank, targets, refused",
    [
        ("head", 4, ["q_proj", "lm_head"], "targets modules the adapter slots do not hold: lm_head"),
        ("wide", 2 * MAX_RANK, ["q_proj"], "LoRA rank 32 is greater than max_lora_rank 16"),
    ],
)
def test_an_adapter_the_slots_cannot_hold_is_refused_by_name(
    lora_llm, tiny_model_dir, adapter_dir, name, rank, targets, refused
):
    from vllm.lora.request import LoRARequest

    build_adapter(tiny_model_dir, adapter_dir / name, rank, rank, targets, seed=3)
    with pytest.raises(Exception, match=refused):
        lora_llm.llm_engine.add_lora(LoRARequest(name, 10 + rank, str(adapter_dir / name)))


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
