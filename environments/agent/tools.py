"""Tools are plain typed callables; their JSON schema comes from the signature and docstring.

A tool's first parameter is the task's `ToolContext` (not shown to the model). Toolsets are
named lists of tools that an env enables with `enabled_toolsets`.

Arguments are checked strictly against the schema, as held-out tool-calling benchmarks score
them: a value of the wrong JSON type ("5" for an integer) or outside an enum is a tool error the
model sees (and the rollout records), never silently converted, so rollouts teach the types too.
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

from flywheel.environments.errors import AgentError, ToolCallError
from flywheel.environments.tool_context import ToolContext

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
    list: "array",
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
        required = self.parameters.get("required", [])
        # An optional argument sent as null means "not given": the tool's default applies.
        kwargs = {name: value for name, value in arguments.items() if value is not None or name in required}
        missing = [name for name in required if name not in kwargs]
        if missing:
            raise ToolCallError(f"{self.name}: missing required argument(s) {missing}")
        for name, value in kwargs.items():
            error = json_type_error(value, properties[name], f"argument '{name}'")
            if error:
                raise ToolCallError(f"{self.name}: {error}")
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
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _json_schema(options[0]) if options else {"type": "string"}
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (list, tuple):
        return {"type": "array", "items": _json_schema(args[0]) if args else {}}
    if origin is dict:
        return {"type": "object", "additionalProperties": _json_schema(args[1])} if args else {"type": "object"}
    return {"type": _JSON_TYPES.get(annotation, "string")}


def json_type(value: Any) -> str:
    """The JSON type name of a decoded JSON value (`bool` is boolean, never integer).

    >>> json_type(1), json_type(1.0), json_type("1"), json_type(True), json_type(None)
    ('integer', 'number', 'string', 'boolean', 'null')
    """
    if value is None:
        return "null"
    kinds = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"), (dict, "object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def json_type_error(value: Any, spec: dict[str, Any], name: str = "value") -> str | None:
    """Why `value` does not fit the JSON schema `spec` (type, enum, items, additionalProperties); None if it fits.

    An integer is also a number (1 fits "number"); nothing else converts: "1" is not an integer.

    >>> json_type_error("5", {"type": "integer"}, "argument 'n'")
    "argument 'n' should be integer, got string '5'"
    >>> json_type_error([1, 2], {"type": "array", "items": {"type": "integer"}}) is None
    True
    """
    kind, actual = spec.get("type"), json_type(value)
    if kind and kind != actual and not (kind == "number" and actual == "integer"):
        return f"{name} should be {kind}, got {actual} {value!r:.80}"
    if "enum" in spec and value not in spec["enum"]:
        return f"{name} should be one of {spec['enum']}, got {value!r:.80}"
    if isinstance(value, list) and "items" in spec:
        errors = (json_type_error(item, spec["items"], f"{name}[{i}]") for i, item in enumerate(value))
        return next((e for e in errors if e), None)
    if isinstance(value, dict) and "additionalProperties" in spec:
        errors = (json_type_error(v, spec["additionalProperties"], f"{name}[{k!r}]") for k, v in value.items())
        return next((e for e in errors if e), None)
    return None


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
def read_file(ctx: ToolContext, path: str, max_lines: int | None = None) -> str:
    """Read a text file from the workspace.

    Args:
        path: File path relative to the workspace.
        max_lines: Show only the first this many lines (all when omitted).
    """
    text = ctx.read_file(path)
    if max_lines is None:
        return text
    if max_lines < 1:
        raise ToolCallError(f"read_file: max_lines must be at least 1, got {max_lines}")
    return "".join(text.splitlines(keepends=True)[:max_lines])


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
def patch(ctx: ToolContext, path: str, old_string: str, new_string: str) -> str:
    """Replace one exact snippet of a workspace file: a targeted edit that leaves the rest as it was.

    Args:
        path: File path relative to the workspace.
        old_string: Text to replace; it must occur exactly once in the file.
        new_string: The text to put in its place.
    """
    if not old_string:
        raise ToolCallError("patch: old_string must not be empty")
    text = ctx.read_file(path)
    count = text.count(old_string)
    if count != 1:
        where = "does not occur" if count == 0 else f"occurs {count} times (add surrounding lines to make it unique)"
        raise ToolCallError(f"patch: old_string {where} in {path}")
    ctx.write_file(path, text.replace(old_string, new_string))
    return f"patched {path}"


@tool
def list_files(ctx: ToolContext, path: str = ".") -> str:
    """List the files under a folder of the workspace, recursively.

    Args:
        path: Folder relative to the workspace.
    """
    return "\n".join(ctx.list_files(path)) or "(empty)"


TOOLSETS: dict[str, list[Tool]] = {
    "terminal": [terminal],
    "file": [read_file, write_file, patch, list_files],
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
