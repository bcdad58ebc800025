"""The OpenAI API's rules for chat messages, which vLLM's request schema does not enforce: its catch-all
message type (any role, any fields) accepts what OpenAI refuses with a 400, such as an unknown role, a user
message without content, or a tool result without the call it answers, and the chat template then renders
it as something else or drops it. Checked before vLLM parses the request
(server.middleware.RequestChecks).
"""

from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# role -> fields a message of it must carry (OpenAI's "required" ones)
REQUIRED = {
    "system": ("content",),
    "developer": ("content",),
    "user": ("content",),
    "tool": ("content", "tool_call_id"),
    "function": ("name",),  # deprecated by OpenAI; its content may be null
}
# An assistant message needs content unless it calls a tool (or, the older way, a function).
ASSISTANT_ALTERNATIVES = ("content", "tool_calls", "function_call")


def problem(messages: Any) -> tuple[str, str] | None:
    """(message, param) of the first message OpenAI would refuse, or None. Shapes vLLM's own schema checks
    (messages not a list, a message not an object, wrong types) are left to it."""
    if not isinstance(messages, list):
        return None
    open_calls: set = set()  # tool call ids of the assistant message the next tool messages answer
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            continue
        where = f"messages[{index}]"
        role = message["role"]
        if role not in ROLES:
            supported = ", ".join(repr(name) for name in ROLES)
            return f"{where}.role: {role!r} is not a supported role; use one of {supported}", f"{where}.role"
        if role == "assistant":
            if all(message.get(field) is None for field in ASSISTANT_ALTERNATIVES):
                return f"{where}: an assistant message needs content or tool_calls", f"{where}.content"
        else:
            for field in REQUIRED[role]:
                if message.get(field) is None:
                    return f"{where}.{field} is required in a {role} message", f"{where}.{field}"
        if role == "tool":
            # (a tool_call_id of another type is vLLM's schema's to refuse)
            if isinstance(message["tool_call_id"], str) and message["tool_call_id"] not in open_calls:
                return (
                    f"{where}: a tool message must answer a tool call of the assistant message before it "
                    f"(no call {message['tool_call_id']!r} there)",
                    f"{where}.tool_call_id",
                )
        else:
            calls = message.get("tool_calls") if role == "assistant" else None
            calls = calls if isinstance(calls, list) else []
            call_ids = [call.get("id") for call in calls if isinstance(call, dict)]
            open_calls = {call_id for call_id in call_ids if isinstance(call_id, str)}
    return None
