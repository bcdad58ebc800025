"""The Grafana dashboard in docs/grafana is generated, current, and shows every plugin series."""

import importlib.util
import json
import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from vllm_neuron import metrics

GRAFANA = Path(__file__).resolve().parents[2] / "docs" / "grafana"


def load_builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dashboard_file_is_generated_from_the_builder():
    on_disk = json.loads((GRAFANA / "vllm-neuron.json").read_text())
    assert on_disk == load_builder().dashboard(), "run: python docs/grafana/build_dashboard.py"


def test_every_plugin_series_has_a_panel_and_every_query_names_a_real_series():
    dashboard = load_builder().dashboard()
    queries = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    ours = {m._name for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)}
    assert len(ours) >= 11
    for name in ours:
        assert name in queries, f"{name} has no panel"
    for used in set(re.findall(r"vllm_neuron:[a-z_]+", queries)):
        candidates = {used, re.sub(r"_(total|bucket|count|sum)$", "", used)}
        assert candidates & ours, f"panel queries unknown series {used}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
