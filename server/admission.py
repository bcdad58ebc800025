"""Admission control: past a bound on the requests in flight the server answers 429 at once, instead of
queueing without bound (every client's time to first token growing, and clients timing out on work the server
still does).

The bound is vLLM's own (`--max-num-queued-reqs`: requests waiting or running, a request with n > 1
counting n; and `--max-num-queued-tokens` on prompt tokens still in prefill, off unless set), checked by vLLM
in the API process before a response starts, and counted by vLLM on /metrics
(`vllm:admission_rejections_total{reason}`).
The plugin makes it finite by default (vllm_neuron.config.default_max_requests_in_flight: running plus
twice as many waiting) and answers 429 with Retry-After (server.middleware.RetryAfterOn429), in OpenAI's
error shape, where vLLM would answer 503: a load balancer or an OpenAI client then retries after a pause
rather than treat the server as broken. A client that disconnects while its request waits frees its place at
once (vLLM aborts the request on disconnect).
"""

from http import HTTPStatus

from vllm.exceptions import GracefulHTTPError, MaxQueuedTokensError, QueueOverflowError

from vllm_neuron.upstream import vllm_server

# What a refused client is told to wait: about a decode step's worth of turnover at full load.
RETRY_AFTER_SECONDS = 1


class Overloaded(GracefulHTTPError):
    """A request past the admission bound: 429."""

    def __init__(self, bound: str) -> None:
        super().__init__(
            f"the server is at capacity ({bound}); retry after {RETRY_AFTER_SECONDS} s or on another replica",
            HTTPStatus.TOO_MANY_REQUESTS,
        )


def answer_overload_with_429(engine_client) -> None:
    """Wrap the engine client's admission check (vLLM's `EngineClient.check_admission`, which every
    generation endpoint calls before its response starts) so that its overload errors become 429s."""
    scheduler = engine_client.vllm_config.scheduler_config
    max_requests, max_tokens = scheduler.max_num_queued_reqs, scheduler.max_num_queued_tokens

    def check_admission(check, n: int, request_id: str | None) -> None:
        if request_id is not None:
            # vLLM checks again as the request enters the engine; a stream's 200 has gone out by then, so a
            # refusal would reach its client as an error event after a 200. The door's check (without a
            # request id) decides; the overshoot is the few requests between the two.
            return
        try:
            check(n)
        except QueueOverflowError:
            raise Overloaded(f"{max_requests} requests in flight, --max-num-queued-reqs") from None
        except MaxQueuedTokensError:
            raise Overloaded(f"{max_tokens} prompt tokens waiting, --max-num-queued-tokens") from None

    vllm_server.wrap_admission_check(engine_client, check_admission)


def in_flight(engine_client) -> dict[str, int | None]:
    """The bound and what it counts now (for /v1/neuron/info)."""
    scheduler = engine_client.vllm_config.scheduler_config
    return {
        "max_requests_in_flight": scheduler.max_num_queued_reqs,
        "requests_in_flight": engine_client.get_num_unfinished_requests(),
        "max_queued_prompt_tokens": scheduler.max_num_queued_tokens,
        "queued_prompt_tokens": engine_client.get_num_queued_tokens(),
        "retry_after_seconds": RETRY_AFTER_SECONDS,
    }
