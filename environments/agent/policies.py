"""Scripted policies that stand in for the inference server: the oracle and test adversaries.

A policy answers `chat_completion(**kwargs)` like atroposlib's ServerManager. It plays a list
of actions, one per turn: `{"tool": name, "arguments": {...}}` becomes a tool call written in
the env's parser format (so parsing is exercised too), `{"calls": [...]}` several in one reply (a
`batch` of independent calls), `{"final": text}` ends the episode.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from flywheel.environments.tool_call_parsers import get_parser

Action = dict[str, Any]


class ScriptedPolicy:
    """Replays `actions`; the step is the number of assistant turns already in the conversation."""

    def __init__(self, actions: list[Action], tool_call_parser: str = "hermes") -> None:
        self.actions = actions
        self.parser = get_parser(tool_call_parser)

    async def chat_completion(self, **kwargs: Any) -> Any:
        step = sum(1 for m in kwargs.get("messages", []) if m.get("role") == "assistant")
        action = self.actions[step] if step < len(self.actions) else {"final": "Done."}
        if "final" in action:
            text = action["final"]
        else:
            calls = action.get("calls") or [action]
            text = self.parser.tool_calls_text([(c["tool"], c.get("arguments", {})) for c in calls])
        message = SimpleNamespace(content=text, tool_calls=None, role="assistant")
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")], usage=None)


def do_nothing() -> list[Action]:
    """Claims to be done immediately."""
    return [{"final": "Done."}]


def call(tool: str, **arguments: Any) -> Action:
    """One tool-call action (helper for oracles and adversaries)."""
    return {"tool": tool, "arguments": arguments}


def batch(*calls: Action) -> Action:
    """Several independent tool calls in one reply: one model turn (the loop runs them in order)."""
    return {"calls": list(calls)}


def final(text: str) -> Action:
    return {"final": text}
