"""vLLM's async scheduling with the plugin (its default): the engine schedules a step while the previous
one's calls run on the runner's device thread, and outputs are those of async scheduling off."""

from concurrent.futures import Future

import torch
from vllm import SamplingParams

from tests.conftest import EVERY_FORM_ENGINE, EXPECTED_GRAPHS, FEW_BUCKETS_ENGINE, model_runner
from tests.helpers import MAX_TOKENS, PROMPTS, generate_ids, greedy, random_prompt, run_engine
from vllm_neuron.scheduler import NeuronAsyncScheduler, NeuronScheduler
from worker.step.model_runner import DeviceThread, StepOutput


def test_the_shared_engine_schedules_ahead_with_the_prefill_share(llm):
    core = llm.llm_engine.engine_core.engine_core
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    assert isinstance(core.scheduler, NeuronAsyncScheduler) and core.batch_queue_size == 2
    # CPU mode runs a step's calls in the engine's thread (a second OpenMP team would throttle both).
    assert model_runner(llm).device_thread is not None and not model_runner(llm).device_thread.threaded


def test_a_step_returns_before_its_calls_end_and_its_output_waits_for_them(llm):
    """execute_model hands the calls to the device thread; sample_tokens gives the engine an output it
    waits on; the next step makes it first if the engine has not asked."""
    runner = model_runner(llm)
    outputs: list = []
    sample_tokens = runner.sample_tokens

    def recording(grammar_output):
        output = sample_tokens(grammar_output)
        outputs.append((output, runner.steps.in_flight))
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


def test_outputs_equal_async_scheduling_and_the_device_sampler_off(tiny_model_dir, llm):
    """The engine as it was before both: every step's logits to vLLM's sampler, one step at a time (on a
    plan of one graph per phase: greedy tokens do not depend on the buckets)."""
    engine = {**FEW_BUCKETS_ENGINE, "async_scheduling": False}
    result = run_engine(tiny_model_dir, engine, {"VLLM_NEURON_DEVICE": "cpu", "VLLM_NEURON_SAMPLER": "host"})
    assert result["async_scheduling"] is False and result["sampled_on_host"]
    assert result["tokens"] == generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))
    assert result["compile_stats"][0]["unexpected_recompiles"] == 0


def test_trainiums_device_thread_in_cpu_mode_gives_the_same_tokens_and_survives_churn(tiny_model_dir, llm):
    """VLLM_NEURON_DEVICE_THREAD=on: the calls on a thread of their own, as on Trainium, end to end, each step
    prepared while the previous one runs: the same greedy and seeded tokens as the shared engine (calls
    inline), with top-p rows the graph leaves to the host and host-path rows in the batch; then churn
    (cancellations, n > 1, preemption-free drains) with no graph added and every KV block freed. On a plan of
    each form of call at one bucket: tokens do not depend on the buckets."""
    cases = [
        (random_prompt(9, seed=420), dict(temperature=0.9, top_p=0.95, seed=5)),  # flat logits: NO_TOKEN rows
        (random_prompt(40, seed=421), dict(temperature=0.8, top_k=20, seed=6, logprobs=2)),
        (random_prompt(23, seed=422), dict(temperature=0.7, repetition_penalty=1.3, seed=7)),  # host path
        (random_prompt(70, seed=423), dict(temperature=0.0)),
    ]
    sampling = [
        {"prompt": prompt, "params": {"max_tokens": 12, "ignore_eos": True, **params}}
        for prompt, params in cases
    ]
    env = {"VLLM_NEURON_DEVICE": "cpu", "VLLM_NEURON_DEVICE_THREAD": "on"}
    extra = {"churn_bursts": 2, "sampling": sampling}
    result = run_engine(tiny_model_dir, EVERY_FORM_ENGINE, env, extra=extra)
    assert result["async_scheduling"] is True and result["device_thread"] is True
    assert result["tokens"] == generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))
    inline = [
        generate_ids(llm, [prompt], SamplingParams(max_tokens=12, ignore_eos=True, **params))[0]
        for prompt, params in cases
    ]
    assert result["sampled_tokens"] == inline
    assert result["churn"]["finished"] + result["churn"]["cancelled"] == result["churn"]["requests"]
    assert result["churn"]["blocks_freed"]
    assert result["compile_stats"][0]["unexpected_recompiles"] == 0


def test_the_scheduler_class_follows_async_scheduling(tiny_model_dir):
    from tests.helpers import engine_config

    assert engine_config(tiny_model_dir).scheduler_config.get_scheduler_cls() is NeuronAsyncScheduler
    off = engine_config(tiny_model_dir, async_scheduling=False).scheduler_config.get_scheduler_cls()
    assert off is NeuronScheduler


def test_the_device_thread_runs_steps_in_order_without_grad_and_starts_again_after_close():
    import threading

    thread = DeviceThread(threaded=True)
    gate, seen = threading.Event(), []

    def step(name: str) -> str:
        gate.wait(timeout=10)
        seen.append((name, threading.current_thread().name, torch.is_grad_enabled()))
        return name

    first, second = thread.submit(lambda: step("a")), thread.submit(lambda: step("b"))
    assert not first.done()  # submit returned while the calls wait
    gate.set()
    assert (first.result(timeout=10), second.result(timeout=10)) == ("a", "b")
    assert [name for name, _, _ in seen] == ["a", "b"]
    assert all(name.startswith("neuron-device") and not grad for _, name, grad in seen)
    thread.close()
    assert thread.submit(lambda: "again").result(timeout=10) == "again"
    thread.close()
    inline = DeviceThread(threaded=False).submit(lambda: threading.current_thread().name)
    assert inline.done() and inline.result() == threading.current_thread().name
