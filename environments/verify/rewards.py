"""Reward helpers: plain functions, each with a runnable example.

Rewards judge the final state through the verifier, never the model's claims.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)


def multi_signal_reward(correctness: float, tool_use: float, efficiency: float) -> float:
    """0.6 correctness + 0.2 tool use + 0.2 efficiency, clamped to [0, 1].

    >>> multi_signal_reward(1.0, 1.0, 0.5)
    0.9
    >>> multi_signal_reward(2.0, 1.0, 1.0)
    1.0
    """
    return round(min(1.0, max(0.0, 0.6 * correctness + 0.2 * tool_use + 0.2 * efficiency)), 6)


def efficiency(steps: int, budget: int) -> float:
    """1.0 within the step budget, then linearly down to 0.0 at twice the budget.

    >>> efficiency(10, 20), efficiency(30, 20), efficiency(50, 20)
    (1.0, 0.5, 0.0)
    """
    if steps <= budget:
        return 1.0
    return max(0.0, 1.0 - (steps - budget) / budget)


def keyword_overlap(answer: str, reference: str) -> float:
    """Share of the reference's words (3+ letters) that appear in the answer.

    >>> keyword_overlap("Paris is the capital of France", "capital: Paris")
    1.0
    >>> keyword_overlap("no idea", "capital: Paris")
    0.0
    """
    words = set(re.findall(r"[a-z0-9]{3,}", reference.lower()))
    if not words:
        return 0.0
    found = set(re.findall(r"[a-z0-9]{3,}", answer.lower()))
    return len(words & found) / len(words)


JUDGE_TIMEOUT_S = 60.0


async def judge_verdict(server: Any, question: str, answer: str, reference: str) -> float:
    """Ask `server` for a JSON verdict `{"score": 0-10, "reason": "..."}` on `answer`; in [0, 1].

    Falls back to `keyword_overlap` when the judge call fails, times out, or its reply holds no
    JSON object with a numeric `score`, so a flaky judge never turns into a zero reward.
    """
    prompt = (
        "Grade the answer against the reference. Reply with a JSON object only: "
        '{"score": <integer 0-10>, "reason": "<one sentence>"}.\n'
        f"Question: {question}\nReference: {reference}\nAnswer: {answer}"
    )
    try:
        reply = await asyncio.wait_for(
            server.chat_completion(
                messages=[
                    {"role": "system", "content": "You are a strict grader."},
                    {"role": "user", "content": prompt},
                ],
                temperature=0.0,
                max_tokens=96,
                n=1,
            ),
            JUDGE_TIMEOUT_S,
        )
        score = parse_verdict(reply.choices[0].message.content or "")
        if score is not None:
            return score
        logger.warning("LLM judge gave no JSON verdict, using keyword overlap")
    except Exception as err:  # The judge is optional; its failures must not crash scoring.
        logger.warning("LLM judge failed, using keyword overlap: %s", err)
    return keyword_overlap(answer, reference)


def parse_verdict(text: str) -> float | None:
    """The `score` (0-10) of the first JSON object in `text`, scaled to [0, 1]; None if there is none.

    >>> parse_verdict('Verdict: {"score": 7, "reason": "close"}')
    0.7
    >>> parse_verdict("8/10") is None
    True
    """
    start = text.find("{")
    while start != -1:
        try:
            verdict, _ = json.JSONDecoder().raw_decode(text, start)
        except ValueError:
            start = text.find("{", start + 1)
            continue
        score = verdict.get("score") if isinstance(verdict, dict) else None
        if isinstance(score, int | float) and not isinstance(score, bool):
            return min(1.0, max(0.0, float(score) / 10.0))
        return None
    return None


def final_answer(messages: list[dict[str, Any]]) -> str:
    """The last assistant message with text content (the agent's final answer).

    >>> final_answer([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "x"},
    ...               {"role": "assistant", "content": "b"}])
    'b'
    """
    for message in reversed(messages):
        if message.get("role") == "assistant" and message.get("content"):
            return message["content"]
    return ""


def tools_used(messages: list[dict[str, Any]]) -> list[str]:
    """Names of the tools the agent called, in order.

    >>> tools_used([{"role": "assistant", "tool_calls": [{"function": {"name": "ls"}}]}])
    ['ls']
    """
    return [
        call.get("function", {}).get("name", "")
        for message in messages
        if message.get("role") == "assistant"
        for call in message.get("tool_calls") or []
    ]
