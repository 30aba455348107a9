"""Replies for the `fake_openai` server (tests/conftest.py): OpenAI completion bodies."""

from __future__ import annotations

from typing import Any


def completion(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI completion body with one choice."""
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    return {"id": "x", "object": kind, "created": 0, "model": "fake", "choices": [choice], "usage": usage}


def chat_reply(text: str) -> tuple[int, dict[str, Any]]:
    """A 200 chat completion whose assistant message is `text`."""
    message = {"role": "assistant", "content": text}
    return 200, completion("chat.completion", {"index": 0, "message": message, "finish_reason": "stop"})
