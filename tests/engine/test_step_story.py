"""One decode step, one short story: the product files and functions a decode step enters, from
execute_model until its sampled tokens are returned to the engine (sample_tokens, or the async output's
get_output), stay few. Counted with sys.setprofile while the runner's entry points run; comprehensions and
lambdas are not counted as functions of their own."""

import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest
from vllm import SamplingParams

from tests.conftest import model_runner
from tests.helpers import generate_ids, random_prompt
from worker.step.model_runner import StepOutput

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = tuple(str(ROOT / folder) + "/" for folder in ("vllm_neuron", "worker", "kv_cache", "server"))
# The files one decode step enters (the compiled program's runner in CPU mode included): a change that needs
# another should fold one in, so that the story stays as short as it is.
MAX_FILES = 10
INNER = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")


class StoryTracer:
    """Product (file, function) pairs entered inside the runner's entry points, for the first pure decode
    step (every row one token, no new request) after `skip` of them."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.functions: set[tuple[str, str]] = set()
        self.tracing = False  # between the decode step's execute_model and its output's return
        self.done = False
        self._depth = 0

    def _profile(self, frame: FrameType, event: str, _arg: object) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PRODUCT) and code.co_name not in INNER:
            self.functions.add((code.co_filename[len(str(ROOT)) + 1 :], code.co_qualname))

    def entered(self, call: Callable, *args: object) -> object:
        """Runs one of the runner's entry points, profiled while the step's window is open."""
        profiled = self.tracing and not self._depth
        self._depth += 1
        if profiled:
            sys.setprofile(self._profile)
        try:
            return call(*args)
        finally:
            if profiled:
                sys.setprofile(None)
            self._depth -= 1

    def execute_model(self, call: Callable, scheduler_output) -> object:
        decode = (
            not self.done
            and not scheduler_output.scheduled_new_reqs
            and scheduler_output.total_num_scheduled_tokens > 0
            and all(count == 1 for count in scheduler_output.num_scheduled_tokens.values())
        )
        if decode and not self.tracing:
            if self.skip:
                self.skip -= 1
            else:
                self.tracing = True
        return self.entered(call, scheduler_output)

    def returned(self) -> None:
        """The step's tokens went back to the engine: the window closes."""
        if self.tracing:
            self.tracing, self.done = False, True


@pytest.mark.slow
def test_one_decode_step_enters_few_product_files(llm, monkeypatch):
    runner = model_runner(llm)
    # Staged readiness's background compiles take the demand a step reports: not part of a served step.
    deadline = time.monotonic() + 600
    while runner.readiness.staging:
        assert time.monotonic() < deadline, "graphs still compiling in the background"
        time.sleep(0.1)
    tracer = StoryTracer(skip=2)
    execute_model, sample_tokens = runner.execute_model, runner.sample_tokens
    get_output = StepOutput.get_output

    def traced_sample_tokens(grammar_output):
        was_tracing = tracer.tracing
        output = tracer.entered(sample_tokens, grammar_output)
        if was_tracing and not isinstance(output, StepOutput):
            tracer.returned()
        return output

    def traced_get_output(output: StepOutput):
        was_tracing = tracer.tracing
        result = tracer.entered(get_output, output)
        if was_tracing:
            tracer.returned()
        return result

    monkeypatch.setattr(runner, "execute_model", lambda out: tracer.execute_model(execute_model, out))
    monkeypatch.setattr(runner, "sample_tokens", traced_sample_tokens)
    monkeypatch.setattr(StepOutput, "get_output", traced_get_output)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    generate_ids(llm, [random_prompt(12, seed=540), random_prompt(5, seed=541)], params)
    assert tracer.done, "no decode step traced"
    files = sorted({path for path, _ in tracer.functions})
    story = "\n".join(
        f"{path}: {', '.join(sorted(name for p, name in tracer.functions if p == path))}" for path in files
    )
    print(f"\none decode step: {len(files)} product files, {len(tracer.functions)} functions\n{story}")
    assert len(files) <= MAX_FILES, f"{len(files)} product files in one decode step:\n{story}"
