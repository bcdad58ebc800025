"""Locust file for teams that load-test with Locust (`pip install locust`; not a project dependency).

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --users 32 --spawn-rate 4 \\
        --run-time 5m --headless

Each user sends streamed chat (or completions) requests built by loadtest.workload, and reports to Locust
the whole request ("POST /v1/chat/completions") and, as their own entries, the time to first token
("TTFT") and each inter-token gap ("ITL"). Settings come from the environment:
LOADTEST_MODEL (default: the first of /v1/models), LOADTEST_API_KEY, LOADTEST_ENDPOINT (chat | completions),
LOADTEST_INPUT_LEN, LOADTEST_OUTPUT_LEN (length specs as in `vllm-neuron loadtest`), LOADTEST_IGNORE_EOS=1.
"""

import itertools
import json
import os
import sys
import time
from pathlib import Path

from locust import HttpUser, between, events, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: loadtest is beside us
from loadtest.client import CHAT, COMPLETIONS, Target, chunk_text, request_body  # noqa: E402
from loadtest.workload import LengthDist, Workload  # noqa: E402

ENDPOINT = CHAT if os.environ.get("LOADTEST_ENDPOINT", "chat") == "chat" else COMPLETIONS
API_KEY = os.environ.get("LOADTEST_API_KEY") or os.environ.get("OPENAI_API_KEY")
WORKLOAD = Workload(
    LengthDist.parse(os.environ.get("LOADTEST_INPUT_LEN", "128")),
    LengthDist.parse(os.environ.get("LOADTEST_OUTPUT_LEN", "128")),
    chat=ENDPOINT == CHAT,
)
NEXT_INDEX = itertools.count()  # one sequence for all users: no two requests share a prompt


class OpenAIUser(HttpUser):
    wait_time = between(0, 0)  # closed loop: the next request as soon as the previous one ends

    def on_start(self) -> None:
        self.headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}
        model = os.environ.get("LOADTEST_MODEL")
        if not model:
            response = self.client.get("/v1/models", headers=self.headers, name="GET /v1/models")
            model = response.json()["data"][0]["id"]
        self.target = Target(
            base_url="",
            model=model,
            endpoint=ENDPOINT,
            api_key=API_KEY,
            ignore_eos=os.environ.get("LOADTEST_IGNORE_EOS") == "1",
        )

    @task
    def generate(self) -> None:
        spec = WORKLOAD.request(next(NEXT_INDEX))
        start = time.perf_counter()
        arrivals: list[float] = []
        with self.client.post(
            ENDPOINT,
            json=request_body(self.target, spec),
            headers=self.headers,
            stream=True,
            catch_response=True,
            name=f"POST {ENDPOINT}",
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}")
                return
            for line in response.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    response.failure(str(chunk["error"]))
                    return
                if chunk_text(chunk, ENDPOINT == CHAT):
                    arrivals.append(time.perf_counter())
            if not arrivals:
                response.failure("no tokens")
                return
            response.success()
        self._report("TTFT", arrivals[0] - start)
        for earlier, later in itertools.pairwise(arrivals):
            self._report("ITL", later - earlier)

    def _report(self, name: str, seconds: float) -> None:
        events.request.fire(
            request_type="STREAM",
            name=name,
            response_time=seconds * 1e3,
            response_length=0,
            exception=None,
            context={},
        )
