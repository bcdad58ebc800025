"""Schema-driven fuzzing of the HTTP API: schemathesis generates requests from the OpenAPI schema the
server itself serves (valid and invalid bodies, odd types, boundary values) for the routes users call.
None may answer 5xx, and the server must still serve afterwards. Bounded: a fixed number of examples per
route, no shrinking."""

import collections
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.serving import API_KEY, MODEL_NAME, http

pytestmark = pytest.mark.slow

ROUTES = r"^/(v1/chat/completions|v1/completions|v1/models|tokenize|detokenize|v1/neuron/info)$"
EXAMPLES_PER_ROUTE = 100


def operations(base: str) -> list:
    schema = schemathesis.openapi.from_url(
        base + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}
    ).include(path_regex=ROUTES)
    return [result.ok() for result in schema.get_all_operations()]


def steer(case) -> None:
    """Keep generations short (the point is the request handling, not long outputs), and name the served
    model in about half of the requests so that valid bodies get past the model check."""
    if not isinstance(case.body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(case.body.get(field), int) and 16 < case.body[field] <= 10**6:
            case.body[field] = 16
    if "model" in case.body and len(json.dumps(case.body, default=str)) % 2 == 0:
        case.body["model"] = MODEL_NAME


def fuzz_operation(operation, statuses: collections.Counter, failures: list[str]) -> None:
    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: report the first failure as found
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=operation.as_strategy())
    def fuzz(case) -> None:
        steer(case)
        response = case.call(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
        statuses[(operation.label, response.status_code)] += 1
        if response.status_code >= 500:
            failures.append(
                f"{operation.label} -> {response.status_code}: {response.text[:300]}\n"
                f"  body: {json.dumps(case.body, default=str)[:600]}"
            )

    fuzz()


def test_no_request_gets_a_server_error(api_server):
    statuses: collections.Counter = collections.Counter()
    failures: list[str] = []
    found = operations(api_server.base)
    assert {op.label for op in found} >= {"POST /v1/chat/completions", "POST /v1/completions"}
    for operation in found:
        fuzz_operation(operation, statuses, failures)
    print("fuzzed (route, status) -> requests:", dict(sorted(statuses.items())))
    assert not failures, "\n".join(failures[:10])
    # Every route was exercised, with rejections and successes.
    assert sum(statuses.values()) >= len(found) * 10
    assert any(status == 200 for _, status in statuses) and any(400 <= status < 500 for _, status in statuses)


def test_server_still_serves_after_fuzzing(api_server):
    status, body = http(
        "POST",
        api_server.base + "/v1/completions",
        json.dumps({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode(),
        key=API_KEY,
    )
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1
    assert http("GET", api_server.base + "/health")[0] == 200
