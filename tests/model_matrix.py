"""The architecture matrix: every case of tests/architectures.py served through the plugin in CPU mode, its
graphs lowered through the `stablehlo` route and run by XLA (the `xla` backend), its greedy tokens compared
with HF transformers (float32, eager attention), and docs/models.md rendered from the results.

    python -m tests.model_matrix [--only NAME ... | --shard I/N] [--json FILE] [--write-doc docs/models.md]

(`make models-doc` runs it and rewrites docs/models.md; tests/engine/test_model_matrix.py runs it in CI.)

Each case runs in this one process, one engine after another (dynamo's caches are reset between them), so
the matrix costs one vLLM import. A case the plugin refuses at start-up is recorded with its reason.
"""

import argparse
import gc
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` importable, as under pytest

from tests.architectures import ARCHITECTURES, WINDOW, Architecture, build  # noqa: E402
from tests.environment import TEST_ENVIRONMENT  # noqa: E402

MAX_MODEL_LEN = 128
# Few graphs per case: one prefill bucket, one decode batch bucket, one context bucket (no mixed call: 2 rows
# are more than max_num_seqs // 2).
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
# The cases whose first chunk's attention over its own keys (the fresh prefill graph: kv_cache.ops.
# causal_attention, SDPA's causal flag or the masked form) takes other arguments than Llama's: a sliding
# window, a soft-cap, a scale, or a head layout other than 4 query heads of 16 over 2. They serve that graph
# too. The others' first chunks go through the prefill graph over the cache: their fresh prefill attention
# would be Llama's, which Llama's case serves.
FRESH_PREFILL = {"fresh_prefill_buckets": [64]}
FRESH_PREFILL_CASES = frozenset(
    {"Llama", "Mistral", "Qwen3", "Gemma 2", "Gemma", "Granite", "GPT-2", "OPT", "Falcon", "Gemma 3"}
    | {"Cohere 2", "EXAONE 4", "MiniCPM3"}
)
# A prompt within a decode bucket, one past the sliding window, one chunked across steps (> 64 tokens).
PROMPT_LENGTHS = (5, 2 * WINDOW + 3, 90)
MAX_TOKENS = 10
# Greedy tokens must be equal, and each one's log-probability within this of HF's: an error that leaves the
# argmax alone (a feature with a small effect in a tiny random model) still shows.
LOGPROB_TOLERANCE = 1e-3


@dataclass
class Generation:
    """Greedy tokens of each prompt and the log-probability of each."""

    tokens: list[list[int]]
    logprobs: list[list[float]]

    def error(self, reference: "Generation") -> float:
        """Largest log-probability difference from the reference; infinite where the tokens differ."""
        if self.tokens != reference.tokens:
            return float("inf")
        pairs = zip(sum(self.logprobs, []), sum(reference.logprobs, []), strict=True)
        return max(abs(a - b) for a, b in pairs)


@dataclass
class CaseResult:
    name: str
    architecture: str  # vLLM's (and HF's) architecture class
    features: list[str]
    status: str  # "served" (equal to HF), "refused", "mismatch" or "failed"
    reason: str = ""
    graphs: int = 0
    lowered: int = 0
    # What keeps a lowered graph's KV caches from being written in place (vllm_neuron.compiler.hlo_text).
    cache_problems: list[str] = field(default_factory=list)
    logprob_error: float | None = None
    # Each feature_off variant of the case: whether HF with that feature off would fail the comparison.
    features_exercised: dict[str, bool] = field(default_factory=dict)


def prompts() -> list[list[int]]:
    from tests.helpers import random_prompt

    return [random_prompt(n, seed=n) for n in PROMPT_LENGTHS]


def hf_generation(model_dir: Path, overrides: dict | None = None) -> Generation:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers import hf_greedy_with_logprobs

    config = AutoConfig.from_pretrained(model_dir)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    runs = [hf_greedy_with_logprobs(model, prompt, MAX_TOKENS) for prompt in prompts()]
    return Generation([tokens for tokens, _ in runs], [logprobs for _, logprobs in runs])


def plugin_generation(llm) -> Generation:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [step[token].logprob for step, token in zip(o.outputs[0].logprobs, ids, strict=True)]
        for o, ids in zip(outputs, tokens, strict=True)
    ]
    return Generation(tokens, logprobs)


def engine_settings(arch: Architecture) -> dict:
    buckets = ENGINE["additional_config"] | (FRESH_PREFILL if arch.name in FRESH_PREFILL_CASES else {})
    return ENGINE | {"additional_config": buckets} | arch.engine


def run_case(arch: Architecture, root: Path) -> CaseResult:
    import torch
    from vllm import LLM

    model_dir = build(arch, root / arch.name)
    architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    result = CaseResult(arch.name, architecture, list(arch.features), status="failed")
    try:
        llm = LLM(model=str(model_dir), **engine_settings(arch))
    except Exception as err:  # noqa: BLE001 - a refusal is a result, whatever vLLM wraps it in
        result.status, result.reason = "refused", _reason(err)
        # An engine refused while building its model leaves vLLM's process groups behind, without the
        # expert-parallel group a later MoE case needs; a started engine's shutdown tears them down.
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        return result
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        got = plugin_generation(llm)
        result.graphs = runner.recorder.num_graphs
        result.lowered = len(runner.lowered_graphs())
        result.cache_problems = cache_problems(runner.recorder.lowering.graphs, len(runner.kv_cache.tensors))
        expected = hf_generation(model_dir, arch.reference_config)
        result.logprob_error = got.error(expected)
        if result.logprob_error <= LOGPROB_TOLERANCE:
            result.status = "served"
        elif got.tokens == expected.tokens:
            result.status, result.reason = (
                "mismatch",
                f"log-probabilities differ by {result.logprob_error:.2g}",
            )
        else:
            result.status, result.reason = "mismatch", f"greedy tokens {got.tokens} != HF {expected.tokens}"
        result.features_exercised = {
            feature: hf_generation(model_dir, arch.reference_config | overrides).error(expected)
            > LOGPROB_TOLERANCE
            for feature, overrides in arch.feature_off.items()
        }
    except Exception as err:  # noqa: BLE001 - recorded, and the matrix goes on
        result.status, result.reason = "failed", _reason(err)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        torch._dynamo.reset()
        # vLLM's shutdown unfroze the heap its start froze (vllm/utils/gc_utils.py); frozen again, the next
        # case's start collects its own objects, not the whole process's again (~2 s of CPU a case).
        gc.collect()
        gc.freeze()
    return result


def cache_problems(graphs: list, layers: int) -> list[str]:
    """Each graph must update every layer's cache with one aliased scatter of its new rows and copy no
    cache-sized tensor."""
    from vllm_neuron.compiler import hlo_text

    problems = []
    for graph in graphs:
        writes = hlo_text.cache_writes(graph.stablehlo)
        if len(writes) != layers:
            problems.append(f"{graph.label}: {len(writes)} cache writes for {layers} layers")
        problems += [f"{graph.label}: {problem}" for write in writes for problem in write.problems]
        if graph.compiled is not None:  # what XLA's buffer assignment made of it
            problems += [f"{graph.label}: XLA {problem}" for problem in graph.compiled.problems]
    return problems


def _reason(err: BaseException) -> str:
    """The line of an error that says why: the plugin's own where there is one, without pydantic's
    wrapping."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    lines = [line for line in lines if not line.endswith("raised:")] or lines  # dynamo's wrapper
    line = next((line for line in lines if "Neuron" in line), lines[0])
    if line.endswith("said:"):  # a lowering failure: add torch-mlir's own words
        line += " " + next((later for later in lines if "error" in later or "exception" in later), "")
    return re.sub(r"^Value error, | \[type=.*$", "", line).strip()


def inspect_models_in_this_process() -> None:
    """vLLM learns what a model class supports (vllm.model_executor.models.registry) in a subprocess of its
    own, to keep CUDA out of the caller, for each class not yet in its cache (~/.cache/vllm/modelinfos): a
    fresh import of vLLM per case, about 10 s of CPU each on a cold cache. This process runs on the CPU and
    imports the served cases' model code anyway, so it inspects each class itself: the same answer, cached
    the same way."""
    from vllm.model_executor.models import registry

    assert callable(registry._run_in_subprocess), "vLLM's registry no longer inspects in a subprocess"
    registry._run_in_subprocess = lambda inspect: inspect()


def run(cases: list[Architecture]) -> list[CaseResult]:
    os.environ.update(TEST_ENVIRONMENT)  # before run_case imports vLLM
    inspect_models_in_this_process()
    with tempfile.TemporaryDirectory(prefix="model-matrix-") as root:
        results = []
        for arch in cases:
            result = run_case(arch, Path(root))
            results.append(result)
            line = f"{arch.name:12} {result.status:8} {result.lowered}/{result.graphs} graphs lowered"
            print(f"MATRIX {line} {result.reason}", flush=True)
        return results


DOC_HEADER = f"""# Models

vLLM's own model code runs through the plugin, so any decoder-only architecture vLLM serves is meant to serve
here. This page is what the architecture matrix proved, case by case. It is generated: `make models-doc`
rewrites it, and CI (tests/engine/test_model_matrix.py) fails when a fresh run disagrees with it. For a model
of your own, `vllm-neuron check MODEL` gives the same verdict before you rent a trn2.

Each case is a tiny random-weight model built offline from the architecture's transformers config (2
layers, hidden size 64; the structural features listed kept), served through the plugin in CPU mode with
every graph lowered through TorchNeuron's route to StableHLO, and that StableHLO compiled and run by XLA
with every KV cache kept in place (the `xla` backend), and compared with HF transformers in float32 with
eager attention: prompts of {", ".join(map(str, PROMPT_LENGTHS))} tokens, {MAX_TOKENS} greedy tokens each,
all equal, and each token's log-probability within {LOGPROB_TOLERANCE:g} of HF's. A sliding window is
{WINDOW} tokens, shorter than the longer prompts. A feature marked **(proven)** is switched off in a second
HF run, and that run fails the same comparison: serving with the feature ignored could not pass.
Each case serves a prefill graph over the cache and a decode graph; a case whose attention takes other
arguments than Llama's (a window, a soft-cap, a scale, a head layout) serves the fresh prefill graph too (a
prompt's first chunk over its own keys).
"""


def render(results: list[CaseResult]) -> str:
    """docs/models.md from the matrix's results: what it served, what it refused and why."""
    served = [r for r in results if r.status == "served"]
    others = [r for r in results if r.status != "served"]
    lines = [DOC_HEADER, "## Served, equal to HF", ""]
    lines += ["| model | architecture | graphs lowered | features |", "|---|---|---|---|"]
    for r in served:
        features = ", ".join(f + (" **(proven)**" if r.features_exercised.get(f) else "") for f in r.features)
        lines.append(f"| {r.name} | `{r.architecture}` | {r.lowered} of {r.graphs} | {features} |")
    lines += ["", "## Refused at start-up, or not served", ""]
    lines += ["| model | architecture | status | why |", "|---|---|---|---|"]
    for r in others:
        lines.append(f"| {r.name} | `{r.architecture}` | {r.status} | {r.reason} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these cases")
    parser.add_argument("--shard", metavar="I/N", help="run every N-th case from the I-th (0-based)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--write-doc", type=Path, metavar="FILE", help="write docs/models.md here")
    args = parser.parse_args(argv)
    cases = [a for a in ARCHITECTURES if not args.only or a.name in args.only]
    if args.shard:
        index, count = map(int, args.shard.split("/"))
        cases = cases[index::count]
    results = run(cases)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.write_doc:
        args.write_doc.write_text(render(results))


if __name__ == "__main__":
    main()
    from tests.helpers import end_script

    end_script()
