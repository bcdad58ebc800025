"""On a Trainium host: the same engine on device `neuron`, compile backend `neuron`. Skipped elsewhere."""

import pytest

from tests.conftest import ENGINE_KWARGS
from tests.helpers import MAX_TOKENS, PROMPTS, hf_greedy, run_engine

pytestmark = [pytest.mark.neuron, pytest.mark.slow]


def test_greedy_tokens_on_neuron_match_hf(tiny_model_dir, hf_model):
    result = run_engine(tiny_model_dir, ENGINE_KWARGS, {"VLLM_NEURON_DEVICE": "neuron"})
    assert result["platform"] == "NeuronPlatform"
    assert result["tokens"] == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
