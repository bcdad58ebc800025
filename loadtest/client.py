"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk (asyncio + httpx).

Failures are recorded, never raised, with a kind: `http_<status>`, `timeout`, `connect`, `transport`,
`stream_error` (an error object inside the stream), `bad_stream` (unparseable data), `no_tokens`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from loadtest.stats import RequestRecord
from loadtest.workload import RequestSpec

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000, without /v1
    model: str
    endpoint: str = CHAT
    api_key: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    temperature: float = 0.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(target: Target, spec: RequestSpec) -> dict[str, object]:
    body: dict[str, object] = {
        "model": target.model,
        "max_tokens": spec.max_tokens,
        "temperature": target.temperature,
        "stream": True,
        # The last chunk then carries the token counts, so tokens/s does not depend on chunking.
        "stream_options": {"include_usage": True},
    }
    if target.endpoint == CHAT:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(chunk: dict, chat: bool) -> str:
    """The generated text a stream chunk carries (chat: delta content or reasoning; completions: text)."""
    text = ""
    for choice in chunk.get("choices") or []:
        if chat:
            delta = choice.get("delta") or {}
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text += choice.get("text") or ""
    return text


async def send(client: httpx.AsyncClient, target: Target, spec: RequestSpec) -> RequestRecord:
    """Send one streamed request; time its token-bearing chunks."""
    chat = target.endpoint == CHAT
    record = RequestRecord(start=time.perf_counter(), end=0.0, prompt_tokens=spec.prompt_tokens or 0)
    usage_tokens: int | None = None
    try:
        async with client.stream(
            "POST", target.base_url + target.endpoint, json=request_body(target, spec), headers=target.headers
        ) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"http_{response.status_code}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        record.error = "bad_stream"
                        break
                    if "error" in chunk:
                        record.error = "stream_error"
                        break
                    if chunk_text(chunk, chat):
                        record.chunk_times.append(now)
                    usage = chunk.get("usage")
                    if usage:
                        usage_tokens = usage.get("completion_tokens")
                        record.prompt_tokens = usage.get("prompt_tokens") or record.prompt_tokens
    except httpx.TimeoutException:
        record.error = "timeout"
    except httpx.ConnectError:
        record.error = "connect"
    except httpx.TransportError:
        record.error = "transport"
    record.end = time.perf_counter()
    # Without a usage chunk (some servers ignore stream_options), each token-bearing chunk counts as one.
    record.output_tokens = usage_tokens if usage_tokens is not None else len(record.chunk_times)
    if record.error is None and not record.chunk_times:
        record.error = "no_tokens"
    return record


def make_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    # One connection per request in flight, so the client never queues requests the server should see.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0))
