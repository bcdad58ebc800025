"""LoRA adapters served through the real engine (issue 39, slice 2): two adapters built offline with peft
(different ranks and target modules, random nonzero B) and the base model in one batch give HF's greedy
tokens with that adapter applied, and serving them compiles no graph after warm-up."""

from pathlib import Path

import pytest
import torch

from tests.conftest import ENGINE_KWARGS
from tests.helpers import greedy, hf_greedy, random_prompt

MAX_TOKENS = 10
# name -> (rank, alpha, target modules, seed): one attention-only adapter, one over every projection
ADAPTERS = {
    "attention": (8, 16, ["q_proj", "v_proj"], 1),
    "everywhere": (16, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 2),
}
PROMPTS = [random_prompt(n, seed=300 + n) for n in (5, 40, 70)]  # 70: a prompt past the 64-token bucket


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
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: (folder / name, build_adapter(tiny_model_dir, folder / name, *spec))
        for name, spec in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir):
    """One engine with two adapter slots of rank up to 16."""
    from vllm import LLM

    engine = LLM(
        model=str(tiny_model_dir),
        **{**ENGINE_KWARGS, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16},
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_two_adapters_and_the_base_in_one_batch_give_hf_peft_tokens(lora_llm, adapters, hf_model):
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    [before] = lora_llm.collective_rpc("compile_stats")
    requests = {
        name: LoRARequest(name, lora_id, str(path))
        for lora_id, (name, (path, _)) in enumerate(adapters.items(), start=1)
    }
    # Every prompt with each adapter and with none, all in one generate call.
    cases = [(tuple(prompt), name) for prompt in PROMPTS for name in (*ADAPTERS, None)]
    outputs = lora_llm.generate(
        [TokensPrompt(prompt_token_ids=list(prompt)) for prompt, _ in cases],
        greedy(MAX_TOKENS),
        lora_request=[requests[name] if name else None for _, name in cases],
        use_tqdm=False,
    )
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    references = {name: model for name, (_, model) in adapters.items()} | {None: hf_model}
    expected = [hf_greedy(references[name], list(prompt), MAX_TOKENS) for prompt, name in cases]
    assert tokens == expected
    # Each adapter changes the tokens of some prompt: the slots are not read as the base's.
    by_case = dict(zip(cases, tokens, strict=True))
    for name in ADAPTERS:
        assert any(by_case[(tuple(p), name)] != by_case[(tuple(p), None)] for p in PROMPTS), name
    [after] = lora_llm.collective_rpc("compile_stats")
    assert (after["graphs"], after["unexpected_recompiles"]) == (before["graphs"], 0)
