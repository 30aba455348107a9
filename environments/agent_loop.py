"""`HermesAgentLoop`: the multi-turn tool-calling loop of one rollout.

Each turn asks the server for a reply, takes its native `tool_calls` or parses them from the
text, runs each call in the task's sandbox and appends the result as a `tool` message. Tool
failures (unknown tool, bad arguments, a failing command, a path outside the workspace) go back
to the model as tool messages and are recorded in `tool_errors`. Only infrastructure failures
(the inference server unreachable or erroring after retries) end the rollout, as `infra_error`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from environments.errors import AgentError, InfraError
from environments.tool_call_parsers import ParsedToolCall, get_parser
from environments.tool_context import ToolContext
from environments.tools import TOOLSETS, Tool

logger = logging.getLogger(__name__)


class ChatServer(Protocol):
    """Anything with atroposlib's `chat_completion(**openai_kwargs)` (ServerManager, a policy)."""

    async def chat_completion(self, **kwargs: Any) -> Any: ...


@dataclass
class ToolError:
    """A tool call that failed; the model saw the error as the tool's result."""

    turn: int
    tool_name: str
    arguments: Any
    error: str


@dataclass
class AgentResult:
    """What a rollout produced. Messages are OpenAI-style; tool-call arguments are dicts."""

    messages: list[dict[str, Any]]
    turns_used: int = 0
    finished_naturally: bool = False
    tool_errors: list[ToolError] = field(default_factory=list)
    infra_error: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0


class HermesAgentLoop:
    """Runs the agent until it stops calling tools, runs out of turns, or the infrastructure fails."""

    def __init__(
        self,
        server: ChatServer,
        tool_schemas: list[dict[str, Any]],
        valid_tool_names: set[str] | list[str],
        max_turns: int,
        task_id: str,
        temperature: float = 1.0,
        max_tokens: int | None = None,
        extra_body: dict[str, Any] | None = None,
        tool_call_parser: str = "hermes",
        tools: list[Tool] | None = None,
        inference_retries: int = 2,
    ) -> None:
        self.server = server
        self.tool_schemas = tool_schemas
        self.valid_tool_names = set(valid_tool_names)
        self.max_turns = max_turns
        self.task_id = task_id
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.extra_body = extra_body or {}
        self.parser = get_parser(tool_call_parser)
        known = {t.name: t for toolset in TOOLSETS.values() for t in toolset}
        known.update({t.name: t for t in tools or []})
        self.tools = {name: known[name] for name in self.valid_tool_names if name in known}
        self.inference_retries = inference_retries

    async def run(self, messages: list[dict[str, Any]]) -> AgentResult:
        """Run the loop on `messages` (system + user, usually); returns the whole conversation."""
        result = AgentResult(messages=[dict(m) for m in messages])
        ctx = ToolContext(self.task_id)
        for turn in range(self.max_turns):
            try:
                reply = await self._complete(result.messages)
            except InfraError as err:
                result.infra_error = str(err)
                return result
            result.turns_used = turn + 1
            usage = getattr(reply, "usage", None)
            result.completion_tokens += getattr(usage, "completion_tokens", 0) or 0
            result.prompt_tokens += getattr(usage, "prompt_tokens", 0) or 0
            content, calls, parse_errors = self._read_reply(reply)
            assistant: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                assistant["tool_calls"] = [call.as_message_entry() for call in calls]
            result.messages.append(assistant)
            for error in parse_errors:
                result.tool_errors.append(ToolError(turn, "<parse>", None, error))
            if not calls:
                if parse_errors:  # Tell the model its call was malformed and let it retry.
                    result.messages.append({"role": "user", "content": f"Tool call error: {parse_errors[0]}"})
                    continue
                result.finished_naturally = True
                return result
            for call in calls:
                text = await self._execute(ctx, call, turn, result)
                result.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
        return result

    async def _complete(self, messages: list[dict[str, Any]]) -> Any:
        kwargs: dict[str, Any] = {
            "messages": _for_api(messages),
            "temperature": self.temperature,
            "n": 1,
        }
        if self.tool_schemas:
            kwargs["tools"] = self.tool_schemas
        if self.max_tokens:
            kwargs["max_tokens"] = self.max_tokens
        if self.extra_body:
            kwargs["extra_body"] = self.extra_body
        last: Exception | None = None
        for attempt in range(self.inference_retries + 1):
            try:
                return await self.server.chat_completion(**kwargs)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # Transport, HTTP 5xx, timeouts: the server's classes vary.
                last = err
                logger.warning("inference failed for task %s (attempt %d): %s", self.task_id, attempt + 1, err)
                await asyncio.sleep(min(2.0, 0.25 * 2**attempt))
        raise InfraError(f"inference failed after {self.inference_retries + 1} attempts: {last}")

    def _read_reply(self, reply: Any) -> tuple[str, list[ParsedToolCall], list[str]]:
        """Content and tool calls, native if the server parsed them, else parsed from the text."""
        try:
            message = reply.choices[0].message
        except (AttributeError, IndexError, TypeError):
            return "", [], ["the server returned no choices"]
        text = message.content or ""
        native = getattr(message, "tool_calls", None) or []
        if native:
            calls, errors = [], []
            for entry in native:
                function = entry.function
                try:
                    arguments = json.loads(function.arguments) if function.arguments else {}
                except (json.JSONDecodeError, TypeError):
                    errors.append(f"arguments of '{function.name}' are not valid JSON")
                    continue
                calls.append(ParsedToolCall(function.name, arguments if isinstance(arguments, dict) else {}))
            return text, calls, errors
        parsed = self.parser.parse(text)
        return parsed.content, parsed.tool_calls, parsed.errors

    async def _execute(self, ctx: ToolContext, call: ParsedToolCall, turn: int, result: AgentResult) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            error = f"unknown tool '{call.name}'; available: {', '.join(sorted(self.tools))}"
            result.tool_errors.append(ToolError(turn, call.name, call.arguments, error))
            return f"Error: {error}"
        try:
            return await asyncio.to_thread(tool, ctx, call.arguments)
        except InfraError:
            raise
        except AgentError as err:
            result.tool_errors.append(ToolError(turn, call.name, call.arguments, str(err)))
            return f"Error: {err}"


def _for_api(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI wire format: tool-call arguments as JSON strings."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            message = {
                **message,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                    for c in message["tool_calls"]
                ],
            }
        out.append(message)
    return out
