"""The load generator end to end: the `vllm-neuron loadtest` console script against a real `vllm-neuron
serve` on 127.0.0.1 (the session's api_server), its exit code checked (0: done, 1: every request failed), and
read back from its JSON report."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving import API_KEY, MODEL_NAME

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = Path(sys.executable).with_name("vllm-neuron")  # the package's, installed beside python


def loadtest(base_url: str, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    json_out = out / "run.json"
    command = [str(CONSOLE_SCRIPT), "loadtest", "--base-url", base_url, "--model", MODEL_NAME]
    command += ["--json-out", str(json_out), "--no-progress", *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert json_out.exists(), done.stdout + done.stderr
    return done, json.loads(json_out.read_text())


def test_chat_run_reports_latencies_and_our_metrics(api_server, tmp_path):
    done, doc = loadtest(
        api_server.base,
        tmp_path,
        *("--api-key", API_KEY, "--endpoint", "chat", "--concurrency", "4", "--requests", "12"),
        *("--warmup", "2", "--input-len", "uniform:8:60", "--output-len", "16", "--ignore-eos"),
        *("--metrics-interval", "0.2", "--plot-dir", str(tmp_path / "plots")),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "usage: vllm-neuron" not in done.stdout + done.stderr
    assert doc["target"]["ours"] and doc["target"]["neuron_info"]["device_mode"] == "cpu"
    (level,) = doc["levels"]
    assert (level["concurrency"], level["requests"], level["completed"], level["errors"]) == (4, 12, 12, {})
    assert level["output_tokens"] == 12 * 16  # ignore_eos: exactly max_tokens each, counted by usage
    assert level["ttft_ms"]["count"] == 12 and level["ttft_ms"]["p50"] > 0
    assert level["itl_ms"]["count"] > 0 and level["itl_ms"]["p99"] >= level["itl_ms"]["p50"] > 0
    assert level["e2e_ms"]["p90"] >= level["ttft_ms"]["p90"]
    assert level["output_tokens_per_s"] > 0 and level["requests_per_s"] > 0
    server = level["server"]
    assert server["plugin_series"] and server["unexpected_recompiles"] == 0
    assert set(server["padding_efficiency"]) == {"prefill", "decode"}
    assert all(0 < value <= 1 for value in server["padding_efficiency"].values())
    # The server counted the same tokens the client did (warm-up is outside the measured window).
    assert server["generation_tokens"] == 12 * 16
    assert "concurrency 4" in done.stdout and "padding efficiency" in done.stdout
    assert (tmp_path / "plots" / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_poisson_completions_and_refused_key(api_server, tmp_path):
    done, doc = loadtest(
        api_server.base,
        tmp_path,
        *("--api-key", API_KEY, "--endpoint", "completions", "--rate", "8", "--requests", "6"),
        *("--warmup", "0", "--prompt-kind", "token-ids", "--token-id-range", "10:400"),
        *("--input-len", "24", "--output-len", "8", "--ignore-eos"),
        *("--instance", "trn2.48xlarge", "--chips", "1"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (level,) = doc["levels"]
    assert (level["rate"], level["completed"], level["prompt_tokens"]) == (8.0, 6, 6 * 24)
    assert level["output_tokens"] == 6 * 8
    assert "p99" in level["send_late_ms"]
    # One of trn2.48xlarge's 16 chips: 1/16 of its hourly price, over the level's wall time, per token.
    price = doc["config"]["price"]["dollars_per_hour"]
    assert price == pytest.approx(35.7608 / 16)
    for key, tokens in (("output", 6 * 8), ("prompt", 6 * 24)):
        expected = price / 3600 * level["wall_s"] / tokens * 1e6
        assert level[f"dollars_per_million_{key}_tokens"] == pytest.approx(expected)
    assert "$/M out" in done.stdout and "1 of trn2.48xlarge's 16 chips" in done.stdout

    done, doc = loadtest(
        api_server.base, tmp_path, "--api-key", "wrong-key", "--requests", "3", "--warmup", "0"
    )
    assert done.returncode == 1  # every request failed
    assert doc["levels"][0]["errors"] == {"http_401": 3}
