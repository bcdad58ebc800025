"""Run one vLLM engine in a fresh process and print its greedy token ids as JSON.

A process picks its vLLM platform once, so comparisons with vLLM's own CPU platform (plugin off) and
engines of other dtypes run here, in their own process, with the environment the caller chose.

    python tests/generate_in_subprocess.py '{"model": DIR, "engine": {}, "prompts": [[1]], "max_tokens": 4}'

Optional keys: "sampling" (a list of {"prompt", "params": SamplingParams keywords}, generated in one batch
after the greedy prompts: "sampled_tokens"), "churn_bursts" (then run tests/engine/test_churn.py's workload
and report it), "sleep_level" (then sleep at that level, wake up, reload the weights after level 2, and
generate again), "wait_background" (then wait until staged readiness's background compiles are done),
"record_drafts" (each greedy prompt's drafts as the scheduler received them: "drafts"), "metrics" (the
values of these counters of llm.get_metrics(), summed over labels: "metrics" in the result,
and "greedy_metrics" after the greedy prompts),
"save_dequantized" (a path: the driver rank's FP8 linear weights dequantized, torch.save'd), "natural_exit"
(end as a user's script does, finalization included, not by tests/helpers.py's end_script), and with the
plugin active the result carries each rank's compile_stats (graphs, recompiles after warm-up, KV cache shape)
and the driver's compile_progress."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` importable, as under pytest


def main() -> None:
    request = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    llm = LLM(model=request["model"], **request["engine"])
    # Count preemptions (in-process engine core only); behaviour is unchanged.
    preempted: list[str] = []
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is not None:
        scheduler = core.scheduler
        preempt = scheduler._preempt_request

        def counting_preempt(request, *args, **kwargs):
            preempted.append(request.request_id)
            return preempt(request, *args, **kwargs)

        scheduler._preempt_request = counting_preempt
    # Each request's drafts as the scheduler receives them (non-empty ones, in order), if asked.
    drafts: dict[str, list[list[int]]] = {}
    if request.get("record_drafts"):
        update_drafts = core.scheduler.update_draft_token_ids

        def recording_update(draft_token_ids, *args, **kwargs):
            for req_id, ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True):
                if len(ids):
                    drafts.setdefault(req_id, []).append([int(token) for token in ids])
            return update_drafts(draft_token_ids, *args, **kwargs)

        core.scheduler.update_draft_token_ids = recording_update
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    greedy_metrics = _metrics(llm, request.get("metrics"))
    sampled = None
    if request.get("sampling"):  # one prompt per SamplingParams keywords, all in one batch
        cases = request["sampling"]
        sampled_outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=case["prompt"]) for case in cases],
            [SamplingParams(**case["params"]) for case in cases],
            use_tqdm=False,
        )
        sampled = [list(o.outputs[0].token_ids) for o in sampled_outputs]
    churn = None
    if request.get("churn_bursts"):
        from tests.engine.test_churn import run_churn

        free_before = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        requests, finished, cancelled = run_churn(llm.llm_engine, bursts=request["churn_bursts"])
        free_after = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        churn = {"requests": requests, "finished": finished, "cancelled": cancelled}
        churn["blocks_freed"] = free_after == free_before
    after_wake_up = None
    if request.get("sleep_level"):
        level = request["sleep_level"]
        llm.sleep(level=level)
        llm.wake_up()
        if level == 2:
            llm.collective_rpc("reload_weights")
        again = llm.generate(prompts, params, use_tqdm=False)
        after_wake_up = [list(o.outputs[0].token_ids) for o in again]
    ours = type(current_platform).__name__ == "NeuronPlatform"
    if request.get("wait_background"):  # staged readiness: until every graph is compiled
        runner = core.model_executor.driver_worker.worker.model_runner
        if runner.readiness.background is not None and not runner.readiness.background.wait(timeout=600):
            raise TimeoutError("background compiles did not finish")
    metrics = _metrics(llm, request.get("metrics"))
    if request.get("save_dequantized"):  # FP8 weights as the model computes with them, for the HF reference
        from tests.fp8_reference import dequantized_weights

        torch.save(llm.collective_rpc(dequantized_weights)[0], request["save_dequantized"])
    result = {
        "metrics": metrics,
        "greedy_metrics": greedy_metrics,
        "platform": type(current_platform).__name__,
        "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
        "sampled_on_host": llm.collective_rpc("sampled_on_host")[0] if ours else None,
        "device_thread": llm.collective_rpc("device_thread")[0] if ours else None,
        "compile_stats": llm.collective_rpc("compile_stats") if ours else None,
        "compile_progress": llm.collective_rpc("compile_progress")[0] if ours else None,
        "churn": churn,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        # (the scheduler's request ids are the outputs' with a random suffix)
        "drafts": [
            next((ids for req_id, ids in drafts.items() if req_id.startswith(f"{o.request_id}-")), [])
            for o in outputs
        ]
        if drafts
        else None,
        "sampled_tokens": sampled,
        "tokens_after_wake_up": after_wake_up,
        "preemptions": len(preempted),
    }
    print("RESULT " + json.dumps(result), flush=True)
    if not request.get("natural_exit"):
        from tests.helpers import end_script

        end_script(llm)


def _metrics(llm, names: list[str] | None) -> dict[str, float] | None:
    """The counters `names` of llm.get_metrics() now, summed over labels; the plugin's (vllm_neuron:...) from
    this process's Prometheus registry, which the in-process engine core writes, those of one label's value
    as "name{label=value}"."""
    if not names:
        return None
    from prometheus_client import REGISTRY

    metrics = dict.fromkeys(names, 0)
    for metric in llm.get_metrics():
        if metric.name in metrics:
            metrics[metric.name] += metric.value
    for family in REGISTRY.collect():
        for name in metrics:
            if name.split("{")[0] != family.name or not name.startswith("vllm_neuron:"):
                continue
            label = name.removesuffix("}").split("{")[1].split("=") if "{" in name else None
            metrics[name] += sum(
                sample.value
                for sample in family.samples
                if sample.name.endswith("_total")
                and (label is None or sample.labels.get(label[0]) == label[1])
            )
    return metrics


if __name__ == "__main__":
    main()
