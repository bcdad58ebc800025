"""Run one LoRA engine in a fresh process and print what tests/engine/test_lora.py checks, as JSON.

An engine built in the pytest process would, at its shutdown, tear down the parallel groups the session's
shared engine still uses; so the LoRA engine lives here, as tests/generate_in_subprocess.py's do.

    python tests/lora_in_subprocess.py '{"model": DIR, "engine": {...}, "adapters": {NAME: DIR}, ...}'

Keys: "mixed" (a list of [prompt, adapter name or null], generated in one batch), "cycle" (adapter names,
each generated alone with "prompt", twice round: eviction and reload), "load_unload" (adapter names, each
loaded with add_lora, generated alone with "prompt", then removed), "refused" (adapter names whose add_lora
must fail: their error messages), "max_tokens", "metrics" (counters of llm.get_metrics() to sum). The result
also carries `vllm-neuron check`'s measure of the built model ("built"), and on fake TorchNeuron
(tests/fake_neuron) its eager ops by rules (f), (k) and (l), those of start-up and those after, and its
blocking transfers to the device (j). Adapter ids follow the order of "adapters".
"""

import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` importable, as under pytest
FAKE_RULES = ("eager_compiles", "eager_kernels", "host_round_trips", "host_reads")  # fake TorchNeuron's


def fake_neuron_facts(worker: object = None) -> dict[str, object] | None:
    """What fake TorchNeuron recorded so far of rules (f), (k) and (l) in a worker's process, where it serves
    the engine (run through collective_rpc: each rank's), and its blocking transfers to the device per
    thread (rule (j))."""
    fake = sys.modules.get("torch_neuronx")
    if fake is None:
        return None
    with fake.runtime.lock:
        facts = fake.runtime.facts
        return {key: list(facts[key]) for key in FAKE_RULES} | {"blocking": dict(facts["blocking_to_device"])}


def calls_by_phase() -> Counter:
    """The calls the engine (in this process) ran so far, by phase."""
    from vllm_neuron import metrics

    counts: Counter = Counter()
    for metric in metrics.BUCKET_CALLS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counts[sample.labels["phase"]] += sample.value
    return counts


def main() -> None:
    request = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=request["model"], **request["engine"])
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
    loras = {
        name: LoRARequest(name, lora_id, path)
        for lora_id, (name, path) in enumerate(request["adapters"].items(), start=1)
    }
    before = llm.collective_rpc("compile_stats")
    started = llm.collective_rpc(fake_neuron_facts)
    calls_before = calls_by_phase()

    def generate(cases: list[tuple[list[int], str | None]]) -> list[list[int]]:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in cases],
            params,
            lora_request=[loras[name] if name else None for _, name in cases],
            use_tqdm=False,
        )
        return [list(output.outputs[0].token_ids) for output in outputs]

    mixed = generate(request["mixed"])
    mixed_phases = sorted(calls_by_phase() - calls_before)
    info = llm.collective_rpc("lora_info")
    # Each alone, twice round: with more adapters than slots, each evicts the least recently used.
    cycle = [generate([(request["prompt"], name)])[0] for name in request["cycle"] * 2]
    loaded = sorted(llm.llm_engine.list_loras())
    load_unload = []
    for name in request.get("load_unload", []):
        llm.llm_engine.add_lora(loras[name])
        load_unload.append(generate([(request["prompt"], name)])[0])
        llm.llm_engine.remove_lora(loras[name].lora_int_id)
    refused = {}
    for name in request["refused"]:
        try:
            llm.llm_engine.add_lora(loras[name])
            refused[name] = None
        except Exception as error:  # noqa: BLE001 (the message is the result)
            refused[name] = str(error)
    after = llm.collective_rpc("compile_stats")
    from server.check_engine import measure_model

    built = llm.collective_rpc(measure_model)[0]  # what `vllm-neuron check` measures of the slots
    metrics = dict.fromkeys(request.get("metrics", []), 0)
    for metric in llm.get_metrics() if metrics else []:
        if metric.name in metrics:
            metrics[metric.name] += metric.value
    fake = [
        {
            "start_up": start,
            "after": {key: now[key][len(start[key]) :] for key in FAKE_RULES},
            "blocking_to_device": now["blocking"],
        }
        for start, now in zip(started, llm.collective_rpc(fake_neuron_facts), strict=True)
        if now is not None
    ]
    result = {
        "fake_neuron": fake,  # each rank's, on fake TorchNeuron
        "load_unload": load_unload,
        "metrics": metrics,
        "built": dataclasses.asdict(built),
        "device_thread": llm.collective_rpc("device_thread")[0],
        "mixed": mixed,
        "mixed_phases": mixed_phases,
        "info": info,  # each rank's
        "cycle": cycle,
        "loaded": loaded,
        "refused": refused,
        "compile_stats": [before, after],  # each rank's
    }
    print("RESULT " + json.dumps(result), flush=True)
    from tests.helpers import end_script

    end_script(llm)


if __name__ == "__main__":
    main()
