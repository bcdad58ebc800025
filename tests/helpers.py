"""Helpers the test modules share: prompts, sampling parameters, engine configurations and runs."""

import json
import os
import random
import subprocess
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.inputs import TokensPrompt


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 400) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate_ids(llm, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


PROMPTS = [random_prompt(n, seed=100 + n) for n in (3, 40, 120)]
MAX_TOKENS = 12


def run_engine(
    model_dir: Path,
    engine: dict,
    env: dict[str, str | None],
    prompts: list[list[int]] = PROMPTS,
    max_tokens: int = MAX_TOKENS,
    extra: dict | None = None,
    script: str = "generate_in_subprocess.py",
) -> dict:
    """Run `script` (a file of tests/) on one engine in a fresh process with `env` changed (None: unset)."""
    request = {"model": str(model_dir), "engine": engine, "prompts": prompts, "max_tokens": max_tokens}
    request |= extra or {}
    child_env = dict(os.environ)
    for name, value in env.items():
        if value is None:
            child_env.pop(name, None)
        else:
            child_env[name] = value
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), json.dumps(request)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def end_script(llm=None) -> NoReturn:
    """End a script of tests/ once it printed its result: `llm`'s engine shut down as at any exit, then the
    process ends without the interpreter's finalization, which tears down the heap of torch, vLLM and
    dynamo (3-4 s of CPU a process: vllm_neuron/process_exit.py) and checks nothing a test reads. A test of
    the exit itself asks for it with "natural_exit" (tests/engine/test_clean_stop.py)."""
    if llm is not None:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # reported and passed over, as vLLM's finalizer of the engine does at exit
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def engine_config(model_dir, **overrides):
    """vLLM wraps errors raised by the platform hook in a pydantic ValidationError (a ValueError)."""
    kwargs = dict(model=str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=4)
    kwargs.update(overrides)
    return EngineArgs(**kwargs).create_engine_config()


def hf_greedy(hf_model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    return hf_greedy_with_logprobs(hf_model, prompt_ids, max_tokens)[0]


def hf_greedy_with_logprobs(
    hf_model, prompt_ids: list[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """HF transformers greedy decoding with its KV cache, and the log-probability of each chosen token; like
    ignore_eos in vLLM it neither stops at EOS nor bans it (generate's min_new_tokens would ban it)."""
    import torch

    tokens: list[int] = []
    logprobs: list[float] = []
    step_input, past = torch.tensor([prompt_ids]), None
    with torch.no_grad():
        for _ in range(max_tokens):
            result = hf_model(input_ids=step_input, past_key_values=past, use_cache=True)
            past = result.past_key_values
            logits = result.logits[0, -1].float()
            tokens.append(int(logits.argmax()))
            logprobs.append(float(torch.log_softmax(logits, -1)[tokens[-1]]))
            step_input = torch.tensor([[tokens[-1]]])
    return tokens, logprobs


def build_adapter(base_dir: Path, out: Path, rank: int, alpha: int, targets: list[str], seed: int):
    """A peft adapter with random A and B (init_lora_weights=False: the default B = 0 is a no-op), saved to
    `out`; returns the HF model with it applied."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config).eval()
    peft_model.save_pretrained(out)
    return peft_model
