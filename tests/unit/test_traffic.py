"""vllm_neuron.planning.traffic: declared traffic shapes, request sampling and the load profile."""

import pytest

from vllm_neuron.planning.traffic import TrafficShape, load_at, sample_requests

TRAFFIC = TrafficShape(prompt_len=(8, 2048), output_len=(8, 256), concurrency=32)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(prompt_len=(0, 10)), "prompt_len bounds must be positive"),
        (dict(prompt_len=(-5, 10)), "prompt_len bounds must be positive"),
        (dict(output_len=(10, 0)), "output_len bounds must be positive"),
        (dict(prompt_len=(100, 10)), "prompt_len min 100 is above its max 10"),
        (dict(output_len=(9, 8)), "output_len min 9 is above its max 8"),
        (dict(prompt_len=(8,)), r"prompt_len must be a \[min, max\] pair"),
        (dict(output_len=(1, 2, 3)), r"output_len must be a \[min, max\] pair"),
        (dict(output_len=64), r"output_len must be a \[min, max\] pair"),
        (dict(prompt_len=(8.0, 16)), "prompt_len bounds must be positive integers"),
        (dict(prompt_len=(True, 16)), "prompt_len bounds must be positive integers"),
        (dict(concurrency=0), "concurrency must be a positive integer"),
        (dict(concurrency=2.5), "concurrency must be a positive integer"),
    ],
)
def test_traffic_shape_rejects_bad_values_saying_which(changes, message):
    fields = dict(prompt_len=(8, 2048), output_len=(8, 256), concurrency=32) | changes
    with pytest.raises(ValueError, match=message):
        TrafficShape(**fields)


def test_traffic_shape_from_dict():
    traffic = TrafficShape.from_dict({"prompt_len": [8, 2048], "output_len": [8, 256], "concurrency": 32})
    assert traffic == TRAFFIC
    assert traffic.prompt_len == (8, 2048)  # lists from JSON become tuples: hashable
    assert hash(traffic) == hash(TRAFFIC)
    assert TrafficShape(prompt_len=(5, 5), output_len=(1, 1), concurrency=1).prompt_len == (5, 5)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"prompt_len": [8, 64], "output_len": [8, 64]}, r"missing \['concurrency'\]"),
        ({"prompt_len": [8, 64], "output_len": [8, 64], "concurrency": 4, "rate": 2}, r"unknown \['rate'\]"),
        ([8, 64], "traffic must be an object"),
        ({"prompt_len": [64, 8], "output_len": [8, 64], "concurrency": 4}, "prompt_len min 64"),
    ],
)
def test_traffic_shape_from_dict_rejects(config, message):
    with pytest.raises(ValueError, match=message):
        TrafficShape.from_dict(config)


def test_sampled_requests_stay_in_bounds_and_fit_the_model():
    prompts, outputs = sample_requests(TRAFFIC, 1024, 500, seed=0)
    assert (prompts, outputs) == sample_requests(TRAFFIC, 1024, 500, seed=0)
    assert min(prompts) >= 8 and max(prompts) <= 1023 and min(outputs) >= 1
    assert all(p + o <= 1024 for p, o in zip(prompts, outputs, strict=True))
    # log-uniform: about as many prompts in 8..63 as in 256..2047 (before clamping to the model)
    short = sum(p < 64 for p in prompts)
    assert 150 < short < 250


def test_lighter_part_of_the_run_stops_replacing_requests():
    assert [load_at(8, arrival, 100) for arrival in (0, 59, 60, 79, 80, 99, 150)] == [8, 8, 4, 4, 2, 2, 2]
    assert load_at(1, 99, 100) == 1
