"""Staged readiness on the tiny engine: the engine serves once its two minimal graphs are compiled, the others
compile in the background and join as they finish, no request waits for a compile or uses a graph that is
not ready, in strict mode, and outputs equal HF before and after every graph is ready."""

import pytest

from tests.conftest import ENGINE_KWARGS, EXPECTED_GRAPHS
from tests.helpers import hf_greedy, random_prompt, run_engine

# Every shape the bucket set serves: one-token to full-context prompts (chunked across steps, sub-chunked
# within one), decode batches of 1 to 4 rows, and capped chunks beside decoding requests (mixed calls).
PROMPTS = [random_prompt(n, seed=300 + n) for n in (1, 5, 31, 33, 64, 90, 130, 200)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def staged(tiny_model_dir):
    # The stablehlo backend: a background compile is then mostly dynamo's tracing and the lowering, so the
    # first generation's steps meet the tracer and it rests for them (checked below). Under xla most of it is
    # XLA's own compile, which releases the GIL and has nothing to rest, and a step meets the tracer by
    # chance.
    env = {
        "VLLM_NEURON_READINESS": "staged",
        "VLLM_NEURON_STRICT_SHAPES": "1",
        "VLLM_NEURON_COMPILE_BACKEND": "stablehlo",
    }
    return run_engine(tiny_model_dir, ENGINE_KWARGS, env, PROMPTS, MAX_TOKENS, script="staged_run.py")


def test_serves_on_the_minimal_graphs_first(staged):
    at_ready = staged["at_ready"]
    assert at_ready["readiness"] == "staged"
    assert at_ready["graphs_total"] == EXPECTED_GRAPHS
    assert at_ready["graphs_ready"] == len(staged["minimal_graphs"]) == 2
    assert at_ready["graphs_pending"] == EXPECTED_GRAPHS - 2
    # The first generation's calls ran while graphs were still compiling in the background, and the
    # background's tracing rested for them.
    assert sum(call["pending"] for call in staged["calls_during"]) >= 10
    assert staged["after_first"]["rests_for_serving"] > 0


def test_sleep_mode_pauses_the_background_compiles(staged):
    first, later = staged["asleep"]
    assert first["graphs_pending"] > 0 and later["graphs_ready"] == first["graphs_ready"]
    assert staged["at_end"]["graphs_ready"] == EXPECTED_GRAPHS  # taken up again after wake-up


def test_no_call_uses_a_graph_that_is_not_ready(staged):
    """Every call of the serving thread ran a ready graph: with strict shapes on, a compile there would have
    failed the generation; none happened."""
    assert staged["calls_during"] and all(call["ready"] for call in staged["calls_during"])
    assert all(call["ready"] for call in staged["calls_after"])
    assert staged["unexpected_recompiles"] == 0


def test_background_graphs_join(staged):
    """Every graph compiled in the background and steps then use the bucket set's own shapes: a decode batch
    of 4 rows is one call of batch 4, not four of batch 1."""
    assert staged["finished"]
    end = staged["at_end"]
    assert (end["graphs_ready"], end["graphs_pending"], end["graphs_failed"]) == (EXPECTED_GRAPHS, 0, [])
    assert end["seconds_to_all_graphs"] >= end["seconds_to_ready"] > 0
    assert staged["graphs"] == EXPECTED_GRAPHS
    used_after = {tuple(call["graph"]) for call in staged["calls_after"]}
    assert ("decode", 4, 256) in used_after or ("decode", 4, 128) in used_after
    assert not used_after <= {tuple(graph) for graph in staged["minimal_graphs"]}


def test_outputs_equal_hf_during_and_after(staged, hf_model):
    expected = [hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in PROMPTS]
    assert staged["during"] == expected
    assert staged["after"] == expected
