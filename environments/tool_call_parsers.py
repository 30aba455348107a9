"""Raw model text -> content + tool calls, for servers that do not parse tool calls themselves.

Registry names follow vLLM's `--tool-call-parser`: `hermes`, `qwen` (Hermes tags, Qwen2.5),
`mistral` (`[TOOL_CALLS] [...]`) and `llama3_json` (a bare JSON object). A parser never raises:
malformed calls come back in `errors`, which the agent loop reports to the model as a tool error.
Each parser can also render tool schemas into a system prompt, for chat templates that ignore
`tools=` (SmolLM2's own, for example).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ParsedToolCall:
    """One tool call: the function name and its arguments as a dict."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")

    def as_message_entry(self) -> dict[str, Any]:
        """The OpenAI `tool_calls[]` entry: arguments as a JSON string, as the wire format has them."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass
class ParsedResponse:
    """The parts of one model reply."""

    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ToolCallParser:
    """Base class; subclasses set `name` and implement `parse` and `tool_call_text`."""

    name: ClassVar[str] = ""

    def parse(self, text: str) -> ParsedResponse:
        raise NotImplementedError

    def tool_call_text(self, name: str, arguments: dict[str, Any]) -> str:
        """How this format writes one call (used by scripted policies and prompts)."""
        raise NotImplementedError

    def tool_calls_text(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """How this format writes several calls in one reply (an oracle's batch): one per line."""
        return "\n".join(self.tool_call_text(name, arguments) for name, arguments in calls)

    def render_tools_prompt(self, tool_schemas: list[dict[str, Any]]) -> str:
        """System-prompt text describing the tools and the call format."""
        listing = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in tool_schemas)
        example = self.tool_call_text("tool_name", {"argument": "value"})
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\nFor each function call, reply exactly like this:\n{example}"
        )


def _call_from_obj(obj: Any, errors: list[str], arguments_key: str = "arguments") -> ParsedToolCall | None:
    if not isinstance(obj, dict):
        errors.append(f"a tool call must be a JSON object, not {type(obj).__name__}")
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        errors.append(f"tool call has no function name (its keys: {', '.join(map(str, list(obj)[:8]))})")
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):  # Bad JSON, an int of over 4,300 digits, deep nesting.
            errors.append(f"arguments of '{name:.80}' are not valid JSON: {arguments[:80]}")
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        errors.append(f"arguments of '{name:.80}' must be a JSON object")
        return None
    return ParsedToolCall(name=name, arguments=arguments)


def _loads(text: str) -> Any:
    """json.loads that also accepts a trailing extra brace or surrounding whitespace (common slips)."""
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        decoder = json.JSONDecoder()
        obj, _ = decoder.raw_decode(text)
        return obj


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5)."""

    name = "hermes"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> ParsedResponse:
        text = text if isinstance(text, str) else ""
        if "<tool_call>" not in text:
            return ParsedResponse(content=text.strip())
        errors: list[str] = []
        calls = []
        for raw in self._block.findall(text):
            try:
                obj = _loads(raw)
            except (json.JSONDecodeError, ValueError, RecursionError):
                errors.append(f"could not parse tool call JSON: {raw.strip()[:80]}")
                continue
            call = _call_from_obj(obj, errors)
            if call is not None:
                calls.append(call)
        content = text.split("<tool_call>", 1)[0].strip()
        return ParsedResponse(content=content, tool_calls=calls, errors=errors)

    def tool_call_text(self, name: str, arguments: dict[str, Any]) -> str:
        payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{payload}\n</tool_call>"


class QwenParser(HermesParser):
    """Qwen2.5 uses the Hermes tags verbatim."""

    name = "qwen"


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`."""

    name = "mistral"
    _marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedResponse:
        text = text if isinstance(text, str) else ""
        if self._marker not in text:
            return ParsedResponse(content=text.strip())
        content, _, payload = text.partition(self._marker)
        errors: list[str] = []
        try:
            obj = _loads(payload)
        except (json.JSONDecodeError, ValueError, RecursionError):
            return ParsedResponse(content=content.strip(), errors=[f"could not parse tool calls: {payload[:80]}"])
        items = obj if isinstance(obj, list) else [obj]
        calls = [c for c in (_call_from_obj(item, errors) for item in items) if c is not None]
        return ParsedResponse(content=content.strip(), tool_calls=calls, errors=errors)

    def tool_call_text(self, name: str, arguments: dict[str, Any]) -> str:
        return self.tool_calls_text([(name, arguments)])

    def tool_calls_text(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        listing = [{"name": name, "arguments": arguments} for name, arguments in calls]
        return f"{self._marker} {json.dumps(listing, ensure_ascii=False)}"


class Llama3JsonParser(ToolCallParser):
    """A reply that is (after an optional `<|python_tag|>`) one JSON object with name + parameters."""

    name = "llama3_json"

    def parse(self, text: str) -> ParsedResponse:
        text = text if isinstance(text, str) else ""
        body = text.replace("<|python_tag|>", "").strip()
        if not body.startswith("{"):
            return ParsedResponse(content=text.strip())
        errors: list[str] = []
        calls = []
        decoder, index = json.JSONDecoder(), 0
        while body[index:].strip("; \t\r\n}"):  # Objects separated by ";" (a stray closing brace is a slip).
            index += len(body[index:]) - len(body[index:].lstrip("; \t\r\n"))
            try:
                obj, index = decoder.raw_decode(body, index)
            except (json.JSONDecodeError, ValueError, RecursionError):
                errors.append(f"could not parse tool call JSON: {body[index : index + 80]}")
                break
            if isinstance(obj, dict) and "name" not in obj:
                return ParsedResponse(content=text.strip())  # Plain JSON content, not a call.
            call = _call_from_obj(obj, errors, arguments_key="parameters")
            if call is not None:
                calls.append(call)
        return ParsedResponse(content="", tool_calls=calls, errors=errors)

    def tool_call_text(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def tool_calls_text(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "; ".join(self.tool_call_text(name, arguments) for name, arguments in calls)


PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesParser, QwenParser, MistralParser, Llama3JsonParser)
}


def register_parser(parser: type[ToolCallParser]) -> type[ToolCallParser]:
    """Class decorator that adds a parser to the registry under its `name`."""
    PARSERS[parser.name] = parser
    return parser


def get_parser(name: str) -> ToolCallParser:
    """A parser instance by registry name; an unknown name lists the known ones."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool_call_parser '{name}'; known: {', '.join(sorted(PARSERS))}") from None
