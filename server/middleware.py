"""ASGI middleware `vllm-neuron serve` adds to vLLM's app (through vLLM's own --middleware option)."""

import functools
import json

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from vllm import envs as vllm_envs

from server import admission, chat_messages, lifecycle, sampling_checks
from vllm_neuron import envs, metrics
from vllm_neuron.upstream import vllm_server


class RequestSizeLimit:
    """Refuse request bodies above VLLM_NEURON_MAX_REQUEST_BYTES with a 413 OpenAI-style error before the
    app reads them: by their Content-Length, or while a chunked body streams in."""

    def __init__(self, app) -> None:
        self.app = app
        self.limit = envs.VLLM_NEURON_MAX_REQUEST_BYTES

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.limit <= 0:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return

        if declared is None and scope["method"] in ("POST", "PUT", "PATCH"):
            # A chunked body: read it here, up to the limit, and hand the app a replay of it.
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    break
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.limit:
                    await self._refuse(send)
                    return
                more = message.get("more_body", False)
            receive = _replay(b"".join(chunks), receive)
        await self.app(scope, receive, send)

    async def _refuse(self, send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"request body larger than {self.limit} bytes "
                    "(the server's --max-request-bytes)",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 413,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive):
    """An ASGI receive that yields the buffered body once, then whatever the client sends next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


class RequestChecks:
    """Refuse with a 400 OpenAI-style error, naming the parameter, what vLLM's schema lets through and then
    serves wrong or fails on: chat messages the OpenAI API refuses (server/chat_messages.py), and sampling
    parameters vLLM's serving code fails on (server/sampling_checks.py). Requests without a valid API key
    pass on, to get their 401 from vLLM."""

    CHAT = "/v1/chat/completions"
    PATHS = (CHAT, "/v1/completions")

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in self.PATHS:
            await self.app(scope, receive, send)
            return
        body, receive = await _read_body(receive)
        try:
            request = json.loads(body)
        except ValueError:
            request = None  # vLLM answers malformed JSON itself
        found = None
        if isinstance(request, dict):
            found = chat_messages.problem(request.get("messages")) if path == self.CHAT else None
            found = found or sampling_checks.problem(request)
        if found is not None and _authorized(scope):
            message, param = found
            error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
            await JSONResponse(content={"error": error}, status_code=400)(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _read_body(receive) -> tuple[bytes, object]:
    """The whole request body, and a receive that gives it to the app again."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    return body, _replay(body, receive)


class ApiKeyOnEveryRoute:
    """With --api-key (or VLLM_API_KEY), require the key on every route but /health and /metrics. vLLM's own
    check covers /v1 and a few other prefixes only, which leaves /tokenize, /invocations, /openapi.json and
    the like open."""

    OPEN_PATHS = ("/health", "/metrics")

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or self._open(scope):
            await self.app(scope, receive, send)
            return
        if not _authorized(scope):
            await JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _open(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        # vLLM's AuthenticationMiddleware checks its guarded prefixes itself.
        return path in self.OPEN_PATHS or path.startswith(_GUARDED_BY_VLLM)


def _authorized(scope) -> bool:
    """The request carries the server's API key, or the server has none."""
    args = scope["app"].state.args
    tokens = tuple(key for key in (args.api_key or [vllm_envs.VLLM_API_KEY]) if key)
    return not tokens or _verifier(tokens)(Headers(scope=scope))


_GUARDED_BY_VLLM = vllm_server.api_key_guarded_prefixes()


@functools.cache
def _verifier(tokens: tuple[str, ...]):
    return vllm_server.api_key_verifier(list(tokens))


class HealthWhileDraining:
    """/health answers 503 {"status": "draining"} once a SIGTERM has started the drain. At the app's lifespan
    start (before vLLM's HTTP server listens) it runs `server.lifecycle.app_starting`."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            lifecycle.app_starting(scope["app"])
        elif scope["type"] == "http" and self._health(scope) and lifecycle.draining(scope["app"]):
            await JSONResponse(content={"status": "draining"}, status_code=503)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _health(scope) -> bool:
        return scope["path"].endswith("/health")


class RetryAfterOn429:
    """A 429 (the admission bound, server/admission.py) tells the client when to retry: Retry-After."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_retry_after(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 429:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    headers.append((b"retry-after", str(admission.RETRY_AFTER_SECONDS).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)


class ProcessSeriesOnScrape:
    """Each GET /metrics first samples the API server's own resident memory, file descriptors and threads
    (vllm_neuron:process_*{process="api"}; the engine process samples its own while it serves)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") == "GET" and scope["path"].endswith("/metrics"):
            metrics.sample_process("api")
        await self.app(scope, receive, send)
