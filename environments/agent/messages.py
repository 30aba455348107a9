"""Conversation messages in OpenAI format, and the dict view chat templates want.

Rollout messages follow the OpenAI wire format (docs/architecture.md): a tool call's
`function.arguments` is a JSON *string*, so `json.loads(arguments)` works on every message an env sees. Chat templates
(and TRL) want the arguments as dicts: `messages_with_dict_arguments` gives that view.
"""

from __future__ import annotations

import json
from typing import Any


def tool_call_arguments(tool_call: dict[str, Any]) -> dict[str, Any]:
    """The arguments of an OpenAI `tool_calls[]` entry as a dict ({} when absent or not an object).

    >>> tool_call_arguments({"function": {"name": "ls", "arguments": '{"path": "."}'}})
    {'path': '.'}
    """
    arguments = (tool_call.get("function") or {}).get("arguments") if isinstance(tool_call, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def _map_tool_calls(messages: list[dict[str, Any]], convert: Any) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                {**call, "function": {**call["function"], "arguments": convert(call)}} for call in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def messages_with_dict_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every tool call's arguments as a dict (for chat templates and TRL)."""
    return _map_tool_calls(messages, tool_call_arguments)


def messages_with_json_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` in OpenAI wire format: every tool call's arguments as a JSON string."""

    def as_json(call: dict[str, Any]) -> str:
        arguments = call["function"].get("arguments")
        return arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)

    return _map_tool_calls(messages, as_json)
