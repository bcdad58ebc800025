"""The settings table (vllm_neuron/settings.py): the one list of the plugin's variables, flags and
--additional-config keys, what reads them, and docs/configuration.md's table written from it."""

import re
from pathlib import Path

import pytest

from vllm_neuron import envs, settings, settings_doc
from vllm_neuron.setting_types import Choice, Integer, IntList, Switch

ROOT = Path(__file__).parents[2]
CODE = ("vllm_neuron", "server", "worker", "kv_cache")


def test_configuration_doc_has_the_current_settings_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert settings_doc.with_table(doc) == doc, "docs/configuration.md is stale: run `make settings-doc`"


def test_every_variable_the_code_names_is_in_the_table():
    named = {
        name
        for folder in CODE
        for path in (ROOT / folder).rglob("*.py")
        for name in re.findall(r"VLLM_NEURON_[A-Z0-9_]*[A-Z0-9]", path.read_text())
    }
    assert named - set(settings.BY_ENV) == set()


def test_each_setting_is_read_where_the_table_says():
    for setting in settings.SETTINGS:
        source = (ROOT / setting.read_in).read_text()
        assert (setting.env and setting.env in source) or f'"{setting.key}"' in source, setting.read_in


def test_flags_set_variables_and_names_are_unique():
    assert all(setting.env for setting in settings.BY_FLAG.values())
    assert len(settings.BY_ENV) + sum(1 for s in settings.SETTINGS if not s.env) == len(settings.SETTINGS)
    assert len(settings.BY_KEY) == sum(1 for s in settings.SETTINGS if s.key)


@pytest.mark.parametrize(
    ("name", "raw", "value"),
    [
        ("VLLM_NEURON_DEVICE", " CPU ", "cpu"),
        ("VLLM_NEURON_TARGET", "", ""),
        ("VLLM_NEURON_STRICT_SHAPES", "1", True),
        ("VLLM_NEURON_COMPILE_WORKERS", "3", 3),
        ("VLLM_NEURON_KV_CACHE_FRACTION", "0.5", 0.5),
        ("VLLM_NEURON_PREFILL_BUCKETS", "64, 128,", (64, 128)),
        ("VLLM_NEURON_GRAPH_RESERVE_BYTES", "", None),
        ("VLLM_NEURON_DUMP_GRAPHS", " /tmp/Graphs ", "/tmp/Graphs"),
    ],
)
def test_variables_are_read_lazily_and_typed(monkeypatch, name, raw, value):
    monkeypatch.setenv(name, raw)
    assert getattr(envs, name) == value


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("VLLM_NEURON_DEVICE", "gpu", "VLLM_NEURON_DEVICE='gpu': use auto, neuron or cpu"),
        ("VLLM_NEURON_TARGET", "tpu", "use neuron or cpu"),
        ("VLLM_NEURON_STRICT_SHAPES", "maybe", "use 1 or 0"),
        ("VLLM_NEURON_COMPILE_WORKERS", "-1", "not a non-negative integer"),
        ("VLLM_NEURON_KV_CACHE_FRACTION", "1.5", "above 0 and below 1"),
        ("VLLM_NEURON_CONTEXT_BUCKETS", "128,lots", "comma-separated list of integers"),
    ],
)
def test_malformed_variables_say_what_they_take(monkeypatch, name, raw, message):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(envs, name)


def test_a_variable_wins_over_its_additional_config_key(monkeypatch):
    config = {"prefill_buckets": [32, 64], "graph_budget": 8}
    assert settings.additional(config, "prefill_buckets") == (32, 64)
    monkeypatch.setenv("VLLM_NEURON_PREFILL_BUCKETS", "16")
    assert settings.additional(config, "prefill_buckets") == (16,)
    assert settings.additional(config, "graph_budget") == 8
    assert settings.additional({}, "graph_budget") == 24  # the table's default
    assert settings.additional({}, "mixed_batch_buckets") is None  # derived by its reader


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        (Choice(("default", "auto")), "clever", 'must be "default" or "auto"'),
        (Integer(minimum=1), True, "must be a positive integer"),
        (IntList(hint=" ([] turns it off)"), [1, "2"], "must be a list of integers ([] turns it off)"),
        (Switch(), 1, "is not an --additional-config key"),
    ],
)
def test_additional_config_values_are_checked_by_their_type(kind, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        kind.check("key", value)
