"""Start one engine with staged readiness and serve while its background compiles run; print JSON.

    python tests/staged_run.py '{"model": DIR, "engine": {}, "prompts": [[1]], "max_tokens": 4}'

Records every compiled call the serving thread makes with whether its graph was ready at that moment, the
compile progress when the engine was ready, while asleep (sleep mode pauses the background), after the first
generation (background still compiling) and once
every graph is ready, and the greedy tokens of the same prompts before and after.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` importable, as under pytest


def main() -> None:
    request = json.loads(sys.argv[1])
    from vllm import LLM

    from tests.helpers import end_script, generate_ids, greedy

    started = time.perf_counter()
    llm = LLM(model=request["model"], **request["engine"])
    ready_seconds = time.perf_counter() - started
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    runner = worker.model_runner
    at_ready = runner.compile_progress()
    # Sleep mode pauses the background compiles (they run on the weights and KV cache it releases): none
    # finishes while asleep, and wake-up takes them up again.
    llm.sleep(level=1)
    asleep = [runner.compile_progress()]
    time.sleep(2)
    asleep.append(runner.compile_progress())
    llm.wake_up()
    calls: list[dict] = []
    all_graphs = runner.buckets.graphs()
    run = runner.compiled.run

    def recording_run(call, inputs):
        ready = runner.readiness.ready_graphs
        calls.append(
            {"graph": list(call.graph), "ready": call.graph in ready, "pending": len(ready) < len(all_graphs)}
        )
        return run(call, inputs)

    runner.compiled.run = recording_run
    params = greedy(request["max_tokens"])
    during = generate_ids(llm, request["prompts"], params)
    after_first = runner.compile_progress()
    calls_during = calls[:]
    calls.clear()
    finished = (
        runner.readiness.background.wait(timeout=600) if runner.readiness.background is not None else True
    )
    after = generate_ids(llm, request["prompts"], params)
    stats = worker.compile_stats()
    result = {
        "ready_seconds": ready_seconds,
        "finished": finished,
        "at_ready": at_ready,
        "asleep": asleep,
        "after_first": after_first,
        "at_end": runner.compile_progress(),
        "calls_during": calls_during,
        "calls_after": calls,
        "during": during,
        "after": after,
        "graphs": stats["graphs"],
        "unexpected_recompiles": stats["unexpected_recompiles"],
        "all_graphs": [list(graph) for graph in runner.buckets.graphs()],
        "minimal_graphs": [list(graph) for graph in runner.buckets.minimal_graphs()],
    }
    print("RESULT " + json.dumps(result), flush=True)
    end_script(llm)


if __name__ == "__main__":
    main()
