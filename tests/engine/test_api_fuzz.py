"""Schema-driven fuzzing of the HTTP API: schemathesis generates requests from the OpenAPI schema the
server itself serves (valid and invalid bodies, odd types, boundary values) for the routes users call.
None may answer 5xx, and the server must still serve afterwards. Bounded: a fixed number of examples per
route, no shrinking."""

import collections
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

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


# ---- chat message shapes -------------------------------------------------------------------------------
# The OpenAPI schema says little of a message (vLLM's catch-all message type takes any role and any fields),
# so the shapes come from a strategy, and the OpenAI API's own rules say which it accepts.

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(
            ["system", "developer", "user", "assistant", "tool", "function", "wizard", "ipython"]
        )
    },
    optional={
        "content": st.one_of(
            st.none(),
            st.text(max_size=12),
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2
            ),
        ),
        "tool_call_id": st.sampled_from(["call_1", "call_2"]),
        "tool_calls": st.just([TOOL_CALL]),
        "name": st.sampled_from(["lookup", "alice"]),
    },
)


# Conversations OpenAI accepts, so that many lists are valid: a valid list is rare among random ones.
VALID_CONVERSATION = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant"]),
            "content": st.text(max_size=12),
        }
    ),
    min_size=1,
    max_size=3,
)


def openai_accepts(messages: list[dict]) -> bool:
    """The OpenAI API's rules for a messages list (its reference, and the 400s it answers)."""
    required = {"system": ["content"], "developer": ["content"], "user": ["content"], "function": ["name"]}
    required["tool"] = ["content", "tool_call_id"]
    answerable: list[str] = []  # tool call ids the next tool message may answer
    for message in messages:
        role = message["role"]
        if role == "assistant":
            if message.get("content") is None and message.get("tool_calls") is None:
                return False
        elif role not in required or any(message.get(field) is None for field in required[role]):
            return False
        if role == "tool":
            if message["tool_call_id"] not in answerable:
                return False
        else:
            answerable = (
                [call["id"] for call in message.get("tool_calls") or []] if role == "assistant" else []
            )
    return True


def test_chat_messages_get_200_exactly_when_openai_accepts_them(api_server):
    outcomes: collections.Counter = collections.Counter()
    wrong: list[str] = []

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(messages=st.one_of(VALID_CONVERSATION, st.lists(MESSAGE, min_size=1, max_size=4)))
    def check(messages) -> None:
        body = json.dumps({"model": MODEL_NAME, "messages": messages, "max_tokens": 1}).encode()
        status, answer = http("POST", api_server.base + "/v1/chat/completions", body, key=API_KEY)
        accepted = openai_accepts(messages)
        outcomes[(accepted, status)] += 1
        if status != (200 if accepted else 400) or (
            status == 400 and not json.loads(answer)["error"]["message"]
        ):
            wrong.append(
                f"{status} for {'valid' if accepted else 'invalid'} {json.dumps(messages)}: {answer[:200]}"
            )

    check()
    print("(OpenAI accepts, status) -> requests:", dict(outcomes))
    assert not wrong, "\n".join(wrong[:10])
    assert outcomes[(True, 200)] >= 10 and outcomes[(False, 400)] >= 10


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_beam_search_refuses_a_length_penalty_vllm_cannot_score(api_server, route):
    """Found by the fuzzing above: vLLM 0.32 ranks finished beams by cumulative logprob / seq_len **
    length_penalty, which underflows to 0 (ZeroDivisionError) or overflows far from 0: a 500 before the
    check (server/sampling_checks.py)."""
    if route == "/v1/completions":
        prompt = {"prompt": "Hello"}
    else:
        prompt = {"messages": [{"role": "user", "content": "Hello"}]}
    for penalty, expected in ((-2000, 400), (2000.0, 400), (1.5, 200)):
        body = {
            "model": MODEL_NAME,
            "max_tokens": 3,
            "use_beam_search": True,
            "n": 2,
            "length_penalty": penalty,
        }
        status, answer = http(
            "POST", api_server.base + route, json.dumps(body | prompt).encode(), key=API_KEY
        )
        assert status == expected, (penalty, answer[:300])
        if status == 400:
            error = json.loads(answer)["error"]
            assert error["param"] == "length_penalty" and "from -40 to 40" in error["message"], error


def test_server_still_serves_after_fuzzing(api_server):
    status, body = http(
        "POST",
        api_server.base + "/v1/completions",
        json.dumps({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode(),
        key=API_KEY,
    )
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1
    assert http("GET", api_server.base + "/health")[0] == 200
