"""vLLM's async scheduling with the plugin (its default): the engine schedules a step while the previous
one's calls run on the runner's device thread, and outputs are those of async scheduling off."""

from concurrent.futures import Future

from vllm import SamplingParams

from tests.conftest import ENGINE_KWARGS, EXPECTED_GRAPHS, model_runner
from tests.helpers import MAX_TOKENS, PROMPTS, generate_ids, greedy, random_prompt, run_engine
from vllm_neuron.scheduler import NeuronAsyncScheduler, NeuronScheduler
from worker.async_steps import StepOutput


def test_the_shared_engine_schedules_ahead_with_the_prefill_share(llm):
    core = llm.llm_engine.engine_core.engine_core
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    assert isinstance(core.scheduler, NeuronAsyncScheduler) and core.batch_queue_size == 2
    assert model_runner(llm).device_thread is not None


def test_a_step_returns_before_its_calls_end_and_its_output_waits_for_them(llm):
    """execute_model hands the calls to the device thread; sample_tokens gives the engine an output it
    waits on; the next step makes it first if the engine has not asked."""
    runner = model_runner(llm)
    outputs: list = []
    sample_tokens = runner.sample_tokens

    def recording(grammar_output):
        output = sample_tokens(grammar_output)
        outputs.append((output, runner._in_flight))
        return output

    runner.sample_tokens = recording
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        tokens = generate_ids(llm, [random_prompt(20, seed=400), random_prompt(7, seed=401)], params)
    finally:
        del runner.sample_tokens
    assert [len(ids) for ids in tokens] == [6, 6]
    async_steps = [(output, step) for output, step in outputs if isinstance(output, StepOutput)]
    assert len(async_steps) >= 5
    for output, step in async_steps:
        assert step is not None and step.result is not None  # made (by the engine or the next step)
        assert not isinstance(step.outputs, Future)
        assert output.get_output() is step.result  # made once
    assert runner.recorder.num_graphs == EXPECTED_GRAPHS


def test_outputs_equal_async_scheduling_off(tiny_model_dir, llm):
    engine = {**ENGINE_KWARGS, "async_scheduling": False}
    result = run_engine(tiny_model_dir, engine, {"VLLM_NEURON_DEVICE": "cpu"})
    assert result["async_scheduling"] is False
    assert result["tokens"] == generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))
    assert result["compile_stats"][0]["unexpected_recompiles"] == 0


def test_the_scheduler_class_follows_async_scheduling(tiny_model_dir):
    from tests.helpers import engine_config

    assert engine_config(tiny_model_dir).scheduler_config.get_scheduler_cls() is NeuronAsyncScheduler
    off = engine_config(tiny_model_dir, async_scheduling=False).scheduler_config.get_scheduler_cls()
    assert off is NeuronScheduler
