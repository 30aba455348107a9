"""Tools are plain typed callables; their JSON schema comes from the signature and docstring.

A tool's first parameter is the task's `ToolContext` (not shown to the model). Toolsets are
named lists of tools that an env enables with `enabled_toolsets`.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from environments.errors import AgentError, ToolCallError
from environments.tool_context import ToolContext

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
}
_MAX_RESULT_CHARS = 8000


@dataclass(frozen=True)
class Tool:
    """A callable the agent may invoke, with the JSON schema the model sees."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] = field(repr=False)

    def schema(self) -> dict[str, Any]:
        """OpenAI `tools=` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def __call__(self, ctx: ToolContext, arguments: dict[str, Any]) -> str:
        """Validate `arguments` against the schema, run the tool, and return its text result."""
        if not isinstance(arguments, dict):
            raise ToolCallError(f"{self.name}: arguments must be a JSON object, got {type(arguments).__name__}")
        properties = self.parameters["properties"]
        unknown = set(arguments) - set(properties)
        if unknown:
            raise ToolCallError(f"{self.name}: unknown argument(s) {sorted(unknown)}; expected {sorted(properties)}")
        missing = [name for name in self.parameters.get("required", []) if name not in arguments]
        if missing:
            raise ToolCallError(f"{self.name}: missing required argument(s) {missing}")
        kwargs = {name: _coerce(self.name, name, value, properties[name]) for name, value in arguments.items()}
        try:
            result = self.fn(ctx, **kwargs)
        except AgentError:
            raise  # Already a tool error, or an InfraError that must stop the rollout.
        except Exception as err:  # Whatever the arguments provoked, the model sees it as the tool's error.
            raise ToolCallError(f"{self.name}: {type(err).__name__}: {err}") from err
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        if len(text) > _MAX_RESULT_CHARS:
            text = text[:_MAX_RESULT_CHARS] + f"\n[truncated {len(text) - _MAX_RESULT_CHARS} characters]"
        return text


def tool(fn: Callable[..., Any]) -> Tool:
    """Make a `Tool` from `fn(ctx, ...)`: types from annotations, texts from the docstring."""
    hints = typing.get_type_hints(fn)
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    arg_docs = dict(re.findall(r"^\s*(\w+):\s*(.+)$", doc.split("Args:", 1)[1], re.M)) if "Args:" in doc else {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for index, (name, param) in enumerate(inspect.signature(fn).parameters.items()):
        if index == 0:
            continue  # The ToolContext.
        spec = _json_schema(hints.get(name, str))
        if name in arg_docs:
            spec["description"] = arg_docs[name].strip()
        properties[name] = spec
        if param.default is inspect.Parameter.empty:
            required.append(name)
    parameters = {"type": "object", "properties": properties, "required": required}
    made = Tool(name=fn.__name__, description=summary, parameters=parameters, fn=fn)
    _DEFINED[made.name] = made
    return made


_DEFINED: dict[str, Tool] = {}


def defined_tools() -> dict[str, Tool]:
    """Every tool made with `@tool` so far, by name: a loop given only tool *names* finds them here."""
    return dict(_DEFINED)


def _json_schema(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_schema(options[0]) if options else {"type": "string"}
    if origin in (list, tuple):
        args = typing.get_args(annotation)
        return {"type": "array", "items": _json_schema(args[0]) if args else {}}
    if origin is dict:
        return {"type": "object"}
    return {"type": _JSON_TYPES.get(annotation, "string")}


def _coerce(tool_name: str, name: str, value: Any, spec: dict[str, Any]) -> Any:
    """Accept what small models send (numbers as strings, etc.) when it is unambiguous."""
    kind = spec.get("type")
    try:
        if kind == "string" and not isinstance(value, str):
            return value if value is None else json.dumps(value) if isinstance(value, dict | list) else str(value)
        if kind == "integer" and not isinstance(value, bool):
            return int(value)
        if kind == "number" and not isinstance(value, bool):
            return float(value)
        if kind == "boolean" and isinstance(value, str):
            return value.strip().lower() in ("true", "1", "yes")
        if kind == "object" and isinstance(value, str):
            return json.loads(value)
        if kind == "array" and not isinstance(value, list):
            return json.loads(value) if isinstance(value, str) else [value]
    except (TypeError, ValueError, OverflowError, RecursionError) as err:  # int(inf), int(nan), deep JSON.
        raise ToolCallError(f"{tool_name}: argument '{name}' should be {kind}, got {value!r:.80}") from err
    return value


# -- the built-in toolsets -----------------------------------------------------------------------


@tool
def terminal(ctx: ToolContext, command: str, timeout: int = 30) -> str:
    """Run a bash command in the task's workspace and return its exit code and output.

    Args:
        command: The shell command to run.
        timeout: Seconds before the command is killed.
    """
    return json.dumps(ctx.terminal(command, timeout))


@tool
def read_file(ctx: ToolContext, path: str) -> str:
    """Read a text file from the workspace.

    Args:
        path: File path relative to the workspace.
    """
    return ctx.read_file(path)


@tool
def write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Create or overwrite a text file in the workspace (parent folders are created).

    Args:
        path: File path relative to the workspace.
        content: The full new content of the file.
    """
    ctx.write_file(path, content)
    return f"wrote {len(content)} characters to {path}"


@tool
def list_files(ctx: ToolContext, path: str = ".") -> str:
    """List the files under a folder of the workspace, recursively.

    Args:
        path: Folder relative to the workspace.
    """
    return "\n".join(ctx.list_files(path)) or "(empty)"


TOOLSETS: dict[str, list[Tool]] = {
    "terminal": [terminal],
    "file": [read_file, write_file, list_files],
}


def register_toolset(name: str, tools: list[Tool]) -> None:
    """Add (or replace) a named toolset, e.g. an environment's own tools."""
    TOOLSETS[name] = list(tools)


def resolve_toolsets(names: list[str]) -> list[Tool]:
    """The tools of the named toolsets, each once, in order."""
    unknown = [name for name in names if name not in TOOLSETS]
    if unknown:
        raise ValueError(f"unknown toolset(s) {unknown}; known: {sorted(TOOLSETS)}")
    seen: dict[str, Tool] = {}
    for name in names:
        for item in TOOLSETS[name]:
            seen.setdefault(item.name, item)
    return list(seen.values())
