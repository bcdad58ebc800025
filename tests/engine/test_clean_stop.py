"""Stopping an engine while staged readiness still compiles in the background, as Kubernetes stops a pod
during a rollout: a server's SIGTERM and the end of an LLM script exit 0, with no abort in any process (a
compile thread left running into the interpreter's exit aborts it: worker/compiles/background.py), and the
compiles are cancelled, not waited for."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENGINE_KWARGS
from tests.helpers import random_prompt
from tests.serving import ServerProcess, complete, http

# vLLM kills an engine process 5 s after its SIGTERM: the exit is timed, so no other worker's engines share
# the host meanwhile.
pytestmark = pytest.mark.alone

# The stablehlo backend: a background compile is then mostly dynamo's tracing and the lowering, in and out of
# torch's ops, where a thread left running aborts the exit and where cancelling stops it; under xla
# most of a compile is XLA's own, which nothing cancels.
STAGED = {"VLLM_NEURON_READINESS": "staged", "VLLM_NEURON_COMPILE_BACKEND": "stablehlo"}
# What a process that aborts (std::terminate, SIGABRT) leaves in its output.
ABORT = re.compile(r"terminate called|core dumped|Fatal Python error")
# BackgroundCompiler.shutdown's line once the compiles stopped with graphs still uncompiled.
STOPPED = re.compile(r"Background compiles stopped, ([1-9]\d*) graphs left uncompiled")


def check_clean(output: str) -> None:
    assert not ABORT.search(output), output[-5000:]
    assert "force killing" not in output, output[-5000:]  # vLLM killed an engine that did not exit in time
    assert STOPPED.search(output), output[-5000:]  # stopped during the compiles, which were cancelled


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_an_llm_script_that_ends_during_background_compiles_exits_0(tiny_model_dir, tmp_path, engine_process):
    """The script ends right after its first generation, without shutting the engine down."""
    env = {
        **os.environ,
        **STAGED,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if engine_process else "0",
        "VLLM_NEURON_CACHE_ROOT": str(tmp_path / "cache"),  # every graph compiles, none is loaded
    }
    request = {
        "model": str(tiny_model_dir),
        "engine": ENGINE_KWARGS,
        "prompts": [random_prompt(5, seed=1)],
        "max_tokens": 4,
        "natural_exit": True,
    }
    script = Path(__file__).parents[1] / "generate_in_subprocess.py"
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(request)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    (result,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    progress = json.loads(result.removeprefix("RESULT "))["compile_progress"]
    assert progress["readiness"] == "staged" and progress["graphs_pending"] > 0, progress
    check_clean(output)


@pytest.mark.slow
def test_a_server_stopped_by_sigterm_during_background_compiles_exits_0(tiny_model_dir, tmp_path):
    server = ServerProcess(
        tiny_model_dir,
        tmp_path / "server.log",
        env=STAGED | {"VLLM_NEURON_CACHE_ROOT": str(tmp_path / "cache")},
    )
    try:
        server.wait_healthy()
        complete(server, random_prompt(5, seed=2), 4)
        progress = json.loads(http("GET", server.base + "/v1/neuron/info")[1])["compile"]
        assert progress["graphs_pending"] > 0, progress
        assert server.stop(timeout=60) == 0, server.log()[-5000:]
    finally:
        if server.process.poll() is None:
            server.stop()
    check_clean(server.log())
