"""The architecture matrix: every case of tests/architectures.py served through the plugin in CPU mode, its
graphs lowered through the `stablehlo` route, its greedy tokens compared with HF transformers (float32, eager
attention), and docs/models.md rendered from the results.

    python -m tests.model_matrix [--only NAME ...] [--json FILE] [--write-doc docs/models.md]

Each case runs in this one process, one engine after another (dynamo's caches are reset between them), so
the matrix costs one vLLM import. A case the plugin refuses at start-up is recorded with its reason.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` importable, as under pytest

# Before vLLM is imported: the plugin in CPU mode, every graph lowered to StableHLO, no compile after warm-up,
# the engine core in this process, nothing leaves 127.0.0.1.
os.environ.update(
    VLLM_NEURON_DEVICE="cpu",
    VLLM_NEURON_COMPILE_BACKEND="stablehlo",
    VLLM_NEURON_STRICT_SHAPES="1",
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    VLLM_HOST_IP="127.0.0.1",
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    VLLM_NO_USAGE_STATS="1",
    DO_NOT_TRACK="1",
    TOKENIZERS_PARALLELISM="false",
)

from tests.architectures import ARCHITECTURES, WINDOW, Architecture, build  # noqa: E402

MAX_MODEL_LEN = 128
# Few graphs per case: one prefill bucket, one decode batch bucket, one context bucket, and the mixed call.
ENGINE = dict(
    dtype="float32",
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=2,
    max_num_batched_tokens=64,
    seed=0,
    additional_config={
        "prefill_buckets": [64],
        "decode_batch_buckets": [2],
        "context_buckets": [MAX_MODEL_LEN],
    },
)
# A prompt within a decode bucket, one past the sliding window, one chunked across steps (> 64 tokens).
PROMPT_LENGTHS = (5, 2 * WINDOW + 3, 90)
MAX_TOKENS = 10


@dataclass
class CaseResult:
    name: str
    architecture: str
    features: list[str]
    status: str  # "served" (equal to HF), "refused", "mismatch" or "failed"
    reason: str = ""
    graphs: int = 0
    lowered: int = 0
    feature_checked: bool | None = None  # HF's tokens change with the feature off (None: nothing to check)


def prompts() -> list[list[int]]:
    from tests.helpers import random_prompt

    return [random_prompt(n, seed=n) for n in PROMPT_LENGTHS]


def hf_tokens(model_dir: Path, overrides: dict | None = None) -> list[list[int]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers import hf_greedy

    config = AutoConfig.from_pretrained(model_dir)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return [hf_greedy(model, prompt, MAX_TOKENS) for prompt in prompts()]


def run_case(arch: Architecture, root: Path) -> CaseResult:
    import torch
    from vllm import LLM

    from tests.helpers import generate_ids, greedy

    model_dir = build(arch, root / arch.name)
    result = CaseResult(arch.name, arch.model_type, list(arch.features), status="failed")
    try:
        llm = LLM(model=str(model_dir), **ENGINE)
    except Exception as err:  # noqa: BLE001 - a refusal is a result, whatever vLLM wraps it in
        result.status, result.reason = "refused", _first_line(err)
        return result
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        got = generate_ids(llm, prompts(), greedy(MAX_TOKENS))
        result.graphs = runner.recorder.num_graphs
        result.lowered = len(runner.lowered_graphs())
        expected = hf_tokens(model_dir)
        if got == expected:
            result.status = "served"
        else:
            result.status = "mismatch"
            result.reason = f"plugin {got} != HF {expected}"
        if arch.feature_off is not None:
            result.feature_checked = hf_tokens(model_dir, arch.feature_off) != expected
    except Exception as err:  # noqa: BLE001 - recorded, and the matrix goes on
        result.status, result.reason = "failed", _first_line(err)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch._dynamo.reset()
    return result


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return next((line.strip() for line in text.splitlines() if "Neuron" in line), text.splitlines()[0])


def run(names: list[str] | None = None) -> list[CaseResult]:
    cases = [a for a in ARCHITECTURES if not names or a.name in names]
    with tempfile.TemporaryDirectory(prefix="model-matrix-") as root:
        results = []
        for arch in cases:
            result = run_case(arch, Path(root))
            results.append(result)
            line = f"{arch.name:12} {result.status:8} {result.lowered}/{result.graphs} graphs lowered"
            print(f"MATRIX {line} {result.reason}", flush=True)
        return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these cases")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    results = run(args.only)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
