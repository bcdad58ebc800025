"""The architecture matrix in CI: every case of tests/architectures.py is served equal to HF with all its
graphs lowered, or refused with the reason it names; every feature a case proves is exercised; and
docs/models.md is what this run renders."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.architectures import ARCHITECTURES, Architecture
from tests.model_matrix import FRESH_PREFILL_CASES, CaseResult, render

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Two processes, one per core of the CI machine, each with one compute thread.
SHARDS = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, CaseResult]:
    folder = tmp_path_factory.mktemp("matrix")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    shards = []
    for index in range(SHARDS):
        out = folder / f"shard-{index}.json"
        command = [
            sys.executable,
            "-m",
            "tests.model_matrix",
            "--shard",
            f"{index}/{SHARDS}",
            "--json",
            str(out),
        ]
        log = open(folder / f"shard-{index}.log", "w")  # noqa: SIM115 - closed below
        shards.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log), out, log))
    found: dict[str, CaseResult] = {}
    for process, out, log in shards:
        code = process.wait(timeout=1200)
        log.close()
        assert code == 0, Path(log.name).read_text()[-3000:]
        found |= {r["name"]: CaseResult(**r) for r in json.loads(out.read_text())}
    return found


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda arch: arch.name)
def test_case(results, arch: Architecture):
    result = results[arch.name]
    if arch.refusal:
        assert result.status == "refused" and arch.refusal in result.reason, result
    else:
        assert result.status == "served", result.reason
        assert result.lowered == result.graphs > 0
        assert result.cache_problems == []
    assert result.features_exercised == dict.fromkeys(arch.feature_off, True), "a feature_off changes nothing"


def test_docs_models_is_this_run(results):
    ordered = [results[arch.name] for arch in ARCHITECTURES]
    assert (ROOT / "docs" / "models.md").read_text() == render(ordered), "stale: run `make models-doc`"


def test_the_fresh_prefill_cases_are_served_cases():
    served = {arch.name for arch in ARCHITECTURES if not arch.refusal}
    assert not FRESH_PREFILL_CASES - served, "not served cases"
