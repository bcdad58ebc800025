"""The soak (`vllm-neuron soak`, loadtest/soak.py) in its short variant against the shared test server:
mixed traffic with cancellations, n > 1, long prompts and bursts past the admission bound, then its checks
(no 5xx, no growth after the warm-up share, every KV block free, no recompile). The long variant's figures
are in benchmarks/results/soak.md."""

import json
import subprocess
import sys

import pytest

from tests.serving import API_KEY

pytestmark = pytest.mark.slow


def test_a_short_soak_passes_its_checks(api_server, tmp_path):
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "server.cli", "soak", "--base-url", api_server.base]
    command += ["--api-key", API_KEY, "--minutes", "0.5", "--burst-every", "10", "--sample-every", "2"]
    command += ["--settle", "0.3"]
    command += ["--max-tokens", "16", "--json-out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    requests = result["requests"]
    assert requests["ok"] >= 10 and requests.get("429", 0) >= 1 and requests.get("cancelled", 0) >= 1
    assert not result["failures"]
    processes = {key.split("_", 1)[1] for key in result["samples"][-1] if key.startswith("rss_")}
    assert processes == {"api", "engine"}
    assert "| start |" in done.stdout and "result: PASS" in done.stdout
