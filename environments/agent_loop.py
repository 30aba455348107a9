"""`HermesAgentLoop`: the multi-turn tool-calling loop of one rollout.

Each turn asks the server for a reply, takes its native `tool_calls` or parses them from the
text, runs each call in the task's sandbox and appends the result as a `tool` message. Tool
failures (unknown tool, bad arguments, a failing command, a path outside the workspace, any
exception a tool raises) go back to the model as tool messages and are recorded in `tool_errors`.
Only infrastructure failures (`InfraError`: the inference server unreachable after retries, the
sandbox broken) end the rollout, as `infra_error`; `run` never raises.

A reply the model wrote is the model's, whatever it contains. Servers that parse tool calls
themselves can choke on a malformed one: `transformers serve` answers an opaque HTTP 500 (its
response parser raises; the body says only "Internal Server Error"), other servers an error whose
body names the parse failure. Neither is infra: a body that names a tool-call parse failure
becomes a tool parse error the model sees; after any other HTTP error the loop asks the server's
raw `completion` endpoint for the same prompt (rendered by `render_prompt`, the trainer's chat
template) and parses that text itself. Only when that also fails is the server at fault.

A loop that cannot progress ends early: when `max_repeated_replies` replies in a row make the same
tool calls and get the same results, nothing the next turn sees has changed but the length of the
conversation, so the episode stops there (`stuck`) and is verified as it stands.

No reply can break what comes after the loop: at most `max_tool_calls_per_reply` calls of a reply
run (the rest are reported to the model as an error), and every string that enters the
conversation is `sanitize`d, so tokenisers and UTF-8 JSONL writers accept it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

from flywheel.environments.agent.messages import messages_with_json_arguments
from flywheel.environments.agent.tools import TOOLSETS, Tool, defined_tools
from flywheel.environments.errors import AgentError, ContextFull, InfraError, ToolParseError
from flywheel.environments.tool_call_parsers import ParsedToolCall, get_parser
from flywheel.environments.tool_context import ToolContext

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOOL_CALLS_PER_REPLY = 8
DEFAULT_MAX_REPEATED_REPLIES = 3
_MAX_ARGUMENT_DEPTH = 32
_SURROGATES = re.compile(r"[\ud800-\udfff]")
# What servers say when *they* failed to parse the model's tool call (transformers' response
# parser: "json parser could not parse region as JSON"; others name the tool call).
_SERVER_PARSE_ERROR = re.compile(r"could not parse region|tool.?call.{0,60}pars|pars\w*.{0,60}tool.?call", re.I | re.S)
# A request longer than the model's context, in the words of `transformers serve` ("The prompt has N
# tokens, but the model takes at most M") and of vLLM ("This model's maximum context length is M",
# "is longer than the maximum model length of M").
_CONTEXT_FULL = re.compile(r"model takes at most \d+|maximum context length|maximum model length", re.I)


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
    """What a rollout produced (the step contract's trajectory, docs/architecture.md).

    `messages` are OpenAI format: a tool call's `function.arguments` is a JSON string
    (`flywheel.environments.agent.messages.tool_call_arguments` gives the dict). The env fills in
    `task_completed` (its verifier's verdict; None when it has none) and `key_decisions_hit`
    (share of its declared key decisions the agent made) before `compute_reward` runs, so a
    reward function can read them, as in the reward template in docs/architecture.md.
    """

    messages: list[dict[str, Any]]
    turns_used: int = 0
    finished_naturally: bool = False
    stuck: bool = False
    context_full: bool = False  # The conversation outgrew the model's context: the episode ended there.
    tool_errors: list[ToolError] = field(default_factory=list)
    infra_error: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    task_completed: bool | None = None
    verify_error: str | None = None  # Why the verifier could not judge the agent's output (the task failed).
    key_decisions_hit: float = 0.0

    @property
    def num_steps(self) -> int:
        """Model calls the rollout used."""
        return self.turns_used

    @property
    def num_tool_errors(self) -> int:
        return len(self.tool_errors)

    def record_tool_error(self, turn: int, tool_name: str, arguments: Any, error: str) -> None:
        self.tool_errors.append(ToolError(turn, tool_name, arguments, error))


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
        max_tool_calls_per_reply: int = DEFAULT_MAX_TOOL_CALLS_PER_REPLY,
        max_repeated_replies: int | None = DEFAULT_MAX_REPEATED_REPLIES,
        render_prompt: Callable[[list[dict[str, Any]]], str] | None = None,
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
        known = defined_tools() | {t.name: t for toolset in TOOLSETS.values() for t in toolset}
        known.update({t.name: t for t in tools or []})
        self.tools = {name: known[name] for name in self.valid_tool_names if name in known}
        self.inference_retries = inference_retries
        self.max_tool_calls_per_reply = max_tool_calls_per_reply
        self.max_repeated_replies = max_repeated_replies
        self.render_prompt = render_prompt

    async def run(self, messages: list[dict[str, Any]]) -> AgentResult:
        """Run the loop on `messages` (system + user, usually); returns the whole conversation.

        Never raises: a batch of rollouts must survive any one of them. Infrastructure failures,
        and bugs of ours, are recorded as `infra_error` (the rollout is then dropped, not scored).
        """
        result = AgentResult(messages=[sanitize(dict(m)) for m in messages_with_json_arguments(messages)])
        try:
            await self._turns(result)
        except InfraError as err:
            result.infra_error = sanitize(str(err))
        except Exception as err:  # A bug of ours, not the model's fault: count it as infra, keep the batch.
            logger.exception("agent loop failed for task %s", self.task_id)
            result.infra_error = sanitize(f"agent loop failed: {type(err).__name__}: {err}")
        return result

    async def _turns(self, result: AgentResult) -> None:
        ctx = ToolContext(self.task_id)
        prepare = getattr(self.server, "prepare_workspace", None)  # An env's server: the task's files.
        if prepare is not None and "item" not in ctx.state:
            await asyncio.to_thread(prepare, ctx, result.messages)
        repeats: list[str] = []  # The same calls with the same results, one entry per reply in a row.
        for turn in range(self.max_turns):
            try:
                reply = await self._complete(result.messages)
            except ContextFull:  # Like running out of turns: the episode ends, the verifier judges it.
                result.context_full = True
                return
            except ToolParseError as err:  # The server choked on the model's tool call: the model's reply.
                result.turns_used = turn + 1
                error = sanitize(str(err))
                result.messages.append({"role": "assistant", "content": ""})
                result.record_tool_error(turn, "<parse>", None, error)
                result.messages.append({"role": "user", "content": f"Tool call error: {error}"})
                continue
            result.turns_used = turn + 1
            usage = getattr(reply, "usage", None)
            result.completion_tokens += getattr(usage, "completion_tokens", 0) or 0
            result.prompt_tokens += getattr(usage, "prompt_tokens", 0) or 0
            content, calls, parse_errors = sanitize(self._read_reply(reply))
            parse_errors = capped_parse_errors(parse_errors, self.max_tool_calls_per_reply)
            dropped = len(calls) - self.max_tool_calls_per_reply
            calls = calls[: self.max_tool_calls_per_reply]
            assistant: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                assistant["tool_calls"] = [call.as_message_entry() for call in calls]
            result.messages.append(assistant)
            for error in parse_errors:
                result.record_tool_error(turn, "<parse>", None, error)
            if dropped > 0:
                error = (
                    f"only {self.max_tool_calls_per_reply} tool calls per reply are run; this reply had "
                    f"{len(calls) + dropped}, so the last {dropped} did not run"
                )
                result.record_tool_error(turn, "<too many calls>", None, error)
                parse_errors = [error, *parse_errors]
            before = len(result.messages)
            if await self._act(ctx, turn, content, calls, parse_errors, result):
                return
            if self._stuck(repeats, calls, result.messages[before:]):
                result.stuck = True
                return

    def _stuck(self, repeats: list[str], calls: list[ParsedToolCall], answers: list[dict[str, Any]]) -> bool:
        """Whether the last `max_repeated_replies` replies made the same calls and got the same `answers`
        (the messages the reply's calls brought back)."""
        if not self.max_repeated_replies or not calls:
            repeats.clear()
            return False
        said = [[c.name, c.arguments] for c in calls] + [m.get("content") for m in answers]
        outcome = json.dumps(said, sort_keys=True, default=str)
        if repeats and repeats[-1] != outcome:
            repeats.clear()
        repeats.append(outcome)
        return len(repeats) >= self.max_repeated_replies

    async def _act(
        self,
        ctx: ToolContext,
        turn: int,
        content: str,
        calls: list[ParsedToolCall],
        parse_errors: list[str],
        result: AgentResult,
    ) -> bool:
        """Carry out one reply (already appended to `result.messages`); True when the episode is over.

        Runs each tool call in the sandbox and appends its result as a `tool` message; a reply
        with no calls and no parse errors is the final answer.
        """
        if not calls and not parse_errors:
            result.finished_naturally = True
            return True
        for call in calls:
            text = await self._execute(ctx, call, turn, result)
            result.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
        if parse_errors:  # Tell the model what went wrong with its calls and let it retry.
            result.messages.append({"role": "user", "content": f"Tool call error: {parse_errors[0]}"})
        return False

    async def _complete(self, messages: list[dict[str, Any]]) -> Any:
        """The server's reply; `ToolParseError` if the server could not parse the model's tool call,
        `ContextFull` if the conversation no longer fits the model's context.

        Raises `InfraError` only when the server is down, times out, or fails a well-formed request
        on both its chat and (with `render_prompt`) its raw completion endpoint.
        """
        kwargs: dict[str, Any] = {
            "messages": messages_with_json_arguments(messages),
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
            except (asyncio.CancelledError, ContextFull):
                raise
            except Exception as err:  # Transport, HTTP 5xx, timeouts: the server's classes vary.
                last = _root_cause(err)
            detail = _http_error_detail(last)
            if detail is not None and _CONTEXT_FULL.search(detail):  # The model's own doing, not infra's.
                raise ContextFull(detail[:500])
            if detail is not None and _SERVER_PARSE_ERROR.search(detail):
                raise ToolParseError(f"the server could not parse your tool call: {detail[:500]}")
            if detail is not None and self.render_prompt is not None and hasattr(self.server, "completion"):
                raw = await self._complete_raw(messages, kwargs)
                if raw is not None:
                    return raw
            logger.warning("inference failed for task %s (attempt %d): %s", self.task_id, attempt + 1, last)
            await asyncio.sleep(min(2.0, 0.25 * 2**attempt))
        raise InfraError(f"inference failed after {self.inference_retries + 1} attempts: {last}")

    async def _complete_raw(self, messages: list[dict[str, Any]], chat_kwargs: dict[str, Any]) -> Any:
        """The same request on the raw completion endpoint, as a chat-shaped reply; None if it fails too.

        A server that answers this after failing the chat request is up: the chat failure was its
        handling of the model's output (server-side tool parsing), and the raw text is the reply.
        """
        assert self.render_prompt is not None
        kwargs = {k: v for k, v in chat_kwargs.items() if k not in ("messages", "tools")}
        try:
            reply = await self.server.completion(prompt=self.render_prompt(messages), **kwargs)  # type: ignore[attr-defined]
            text = reply.choices[0].text
        except asyncio.CancelledError:
            raise
        except Exception as err:
            logger.warning("raw completion failed for task %s too: %s", self.task_id, _root_cause(err))
            return None
        message = SimpleNamespace(role="assistant", content=text if isinstance(text, str) else "", tool_calls=None)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)], usage=getattr(reply, "usage", None))

    def _read_reply(self, reply: Any) -> tuple[str, list[ParsedToolCall], list[str]]:
        """Content and tool calls, native if the server parsed them, else parsed from the text.

        Calls whose arguments nest deeper than `_MAX_ARGUMENT_DEPTH` become errors: no tool needs
        them, and they would exhaust the recursion of whatever walks the conversation later.
        """
        try:
            message = reply.choices[0].message
        except (AttributeError, IndexError, TypeError):
            return "", [], ["the server returned no choices"]
        text = message.content if isinstance(message.content, str) else ""
        native = getattr(message, "tool_calls", None) or []
        if native:
            calls, errors = self._read_native(native)
        else:
            try:
                parsed = self.parser.parse(text)
            except Exception as err:  # Parsers should never raise; a registered one might.
                return text, [], [f"could not parse the reply: {type(err).__name__}: {err}"]
            text, calls, errors = parsed.content, parsed.tool_calls, parsed.errors
        kept = []
        for call in calls:
            if _nests_deeper(call.arguments, _MAX_ARGUMENT_DEPTH):
                errors.append(f"arguments of '{call.name:.80}' nest deeper than {_MAX_ARGUMENT_DEPTH} levels")
            else:
                kept.append(call)
        return text, kept, errors

    @staticmethod
    def _read_native(native: list[Any]) -> tuple[list[ParsedToolCall], list[str]]:
        """Calls the server parsed itself (OpenAI `tool_calls`, arguments as a JSON string)."""
        calls, errors = [], []
        for entry in native:
            name = getattr(getattr(entry, "function", None), "name", None)
            arguments = getattr(getattr(entry, "function", None), "arguments", None)
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else None
                except (ValueError, RecursionError):
                    errors.append(f"arguments of '{name!s:.80}' are not valid JSON")
                    continue
            if not isinstance(name, str) or not isinstance(arguments, dict | None):
                errors.append("a tool call needs a function name and a JSON object of arguments")
                continue
            calls.append(ParsedToolCall(name, arguments or {}))
        return calls, errors

    async def _execute(self, ctx: ToolContext, call: ParsedToolCall, turn: int, result: AgentResult) -> str:
        """The tool's text result, or `Error: ...` (recorded in `tool_errors`) for anything but infra."""
        tool = self.tools.get(call.name)
        if tool is None:
            error = f"unknown tool '{call.name:.80}'; available: {', '.join(sorted(self.tools))}"
        else:
            try:  # A `Tool` turns whatever its arguments provoke into a ToolCallError.
                return sanitize(await asyncio.to_thread(tool, ctx, call.arguments))
            except InfraError:
                raise
            except AgentError as err:
                error = sanitize(str(err))
        result.record_tool_error(turn, call.name, call.arguments, error)
        return f"Error: {error}"


def capped_parse_errors(errors: list[str], cap: int) -> list[str]:
    """At most `cap` parse errors of one reply, then one line counting the rest: a reply of 100,000
    unparsable calls is one model mistake, not 100,000 records (and a 10 MB rollout line)."""
    if len(errors) <= cap:
        return errors
    return [*errors[:cap], f"... and {len(errors) - cap} more tool calls in this reply could not be parsed"]


def sanitize(value: Any) -> Any:
    """`value` with every lone surrogate (a `"\\ud800"` escape in model JSON) replaced by U+FFFD.

    Such strings cannot be encoded as UTF-8, so they would break the tokeniser and JSONL files.
    Walks dicts, lists, tuples and `ParsedToolCall`s; other values pass as they are.
    """
    if isinstance(value, str):
        return _SURROGATES.sub("\ufffd", value)
    if isinstance(value, dict):
        return {sanitize(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(sanitize(v) for v in value)
    if isinstance(value, ParsedToolCall):
        return ParsedToolCall(sanitize(value.name), sanitize(value.arguments), value.id)
    return value


def _nests_deeper(value: Any, levels: int) -> bool:
    """Whether `value` has containers nested more than `levels` deep (stops looking past that)."""
    if not isinstance(value, dict | list):
        return False
    if levels == 0:
        return True
    return any(_nests_deeper(item, levels - 1) for item in (value.values() if isinstance(value, dict) else value))


def _root_cause(err: Exception) -> Exception:
    """The error under retry wrappers (atroposlib's tenacity `RetryError` holds it in `last_attempt`)."""
    for _ in range(8):
        attempt = getattr(err, "last_attempt", None)
        inner = attempt.exception() if attempt is not None and hasattr(attempt, "exception") else None
        if not isinstance(inner, Exception):
            break
        err = inner
    return err


def _http_error_detail(err: Exception | None) -> str | None:
    """`status: message body` when the server answered with an HTTP error, else None (down, timed out)."""
    status = getattr(err, "status_code", None)
    if not isinstance(status, int) or status < 400:
        return None
    body = getattr(err, "body", None)
    return f"{status}: {getattr(err, 'message', err)} {json.dumps(body, default=str) if body is not None else ''}"
