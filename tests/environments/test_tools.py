"""Tools: schemas come from signatures and docstrings; bad arguments (wrong JSON types included) become
tool errors."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest

from flywheel.environments.agent.tools import TOOLSETS, resolve_toolsets, tool
from flywheel.environments.errors import ToolCallError
from flywheel.environments.tool_context import ToolContext


@tool
def demo(ctx: ToolContext, path: str, count: int = 1, tags: list[str] | None = None) -> str:
    """Do a demo thing.

    Args:
        path: Where to do it.
        count: How often.
    """
    return f"{path}:{count}:{tags}"


def test_schema_from_signature_and_docstring() -> None:
    fn = demo.schema()["function"]
    assert fn["name"] == "demo" and fn["description"] == "Do a demo thing."
    props = fn["parameters"]["properties"]
    assert props["path"] == {"type": "string", "description": "Where to do it."}
    assert props["count"]["type"] == "integer" and props["tags"]["type"] == "array"
    assert fn["parameters"]["required"] == ["path"]


def test_arguments_are_validated_strictly() -> None:
    ctx = object()
    assert demo(ctx, {"path": "x", "count": 3, "tags": ["a"]}) == "x:3:['a']"  # type: ignore[arg-type]
    assert demo(ctx, {"path": "x", "count": None}) == "x:1:None"  # type: ignore[arg-type]  # null: the default.
    with pytest.raises(ToolCallError, match="demo: argument 'count' should be integer, got string '3'"):
        demo(ctx, {"path": "x", "count": "3"})  # type: ignore[arg-type]
    with pytest.raises(ToolCallError, match=r"argument 'tags'\[1\] should be string, got integer 2"):
        demo(ctx, {"path": "x", "tags": ["a", 2]})  # type: ignore[arg-type]
    with pytest.raises(ToolCallError, match="argument 'path' should be string, got null"):
        demo(ctx, {"path": None})  # type: ignore[arg-type]
    with pytest.raises(ToolCallError, match="missing required"):
        demo(ctx, {})  # type: ignore[arg-type]
    with pytest.raises(ToolCallError, match="unknown argument"):
        demo(ctx, {"path": "x", "bogus": 1})  # type: ignore[arg-type]
    with pytest.raises(ToolCallError, match="should be integer"):
        demo(ctx, {"path": "x", "count": "many"})  # type: ignore[arg-type]
    with pytest.raises(ToolCallError, match="JSON object"):
        demo(ctx, ["x"])  # type: ignore[arg-type]


@tool
def invert(ctx: ToolContext, n: float) -> str:
    """One over `n` (fails on 0 with a ZeroDivisionError, not a ToolCallError).

    Args:
        n: The number.
    """
    return str(1 / n)


@pytest.mark.parametrize("count", [float("inf"), float("-inf"), float("nan"), "1e999"])
def test_numbers_no_integer_can_hold_are_argument_errors(count: object) -> None:
    with pytest.raises(ToolCallError, match="'count' should be integer"):
        demo(object(), {"path": "x", "count": count})  # type: ignore[arg-type]


def test_any_exception_of_a_tool_is_a_tool_error() -> None:
    assert invert(object(), {"n": 4}) == "0.25"  # type: ignore[arg-type]  # An integer is a number.
    with pytest.raises(ToolCallError, match="invert: ZeroDivisionError: float division by zero"):
        invert(object(), {"n": 0.0})  # type: ignore[arg-type]


@tool
def find(
    ctx: ToolContext,
    sort: Literal["price_asc", "price_desc"],
    max_price: float | None = None,
    in_stock: bool = False,
    ids: list[int] | None = None,
    level: Literal[1, 2] = 1,
) -> str:
    """Find things.

    Args:
        sort: Order of the results.
    """
    return json.dumps([sort, max_price, in_stock, ids, level])


def test_schema_of_literal_list_bool_and_float() -> None:
    props = find.parameters["properties"]
    assert props["sort"] == {
        "type": "string",
        "enum": ["price_asc", "price_desc"],
        "description": "Order of the results.",
    }
    assert props["max_price"] == {"type": "number"} and props["in_stock"] == {"type": "boolean"}
    assert props["ids"] == {"type": "array", "items": {"type": "integer"}}
    assert props["level"] == {"type": "integer", "enum": [1, 2]}
    assert find.parameters["required"] == ["sort"]


def test_typed_arguments_are_checked() -> None:
    ctx = object()
    typed = {"sort": "price_asc", "max_price": 9.5, "in_stock": True, "ids": [3, 4], "level": 2}
    assert json.loads(find(ctx, typed)) == ["price_asc", 9.5, True, [3, 4], 2]  # type: ignore[arg-type]
    assert json.loads(find(ctx, {"sort": "price_desc", "max_price": 9})) == ["price_desc", 9, False, None, 1]  # type: ignore[arg-type]
    wrong = {
        "max_price": ("9.5", "should be number, got string '9.5'"),
        "in_stock": ("true", "should be boolean, got string 'true'"),
        "ids": ("[3]", "should be array, got string '[3]'"),
        "level": (True, "should be integer, got boolean True"),
    }
    for name, (value, message) in wrong.items():
        with pytest.raises(ToolCallError, match=re.escape(f"find: argument '{name}' {message}")):
            find(ctx, {"sort": "price_asc", name: value})  # type: ignore[arg-type]


def test_a_value_outside_the_enum_is_a_clear_tool_error() -> None:
    with pytest.raises(ToolCallError) as err:
        find(object(), {"sort": "cheapest"})  # type: ignore[arg-type]
    assert str(err.value) == "find: argument 'sort' should be one of ['price_asc', 'price_desc'], got 'cheapest'"
    with pytest.raises(ToolCallError, match=r"'level' should be one of \[1, 2\], got 3"):
        find(object(), {"sort": "price_asc", "level": 3})  # type: ignore[arg-type]


def test_file_and_terminal_tools_share_the_task_sandbox() -> None:
    ctx = ToolContext("tools-test")
    try:
        by_name = {t.name: t for t in resolve_toolsets(["terminal", "file"])}
        by_name["write_file"](ctx, {"path": "d/x.txt", "content": "hello"})
        out = json.loads(by_name["terminal"](ctx, {"command": "cat d/x.txt"}))
        assert out == {"exit_code": 0, "output": "hello"}
        assert "d/x.txt" in by_name["list_files"](ctx, {})
        assert ToolContext("tools-test").read_file("d/x.txt") == "hello"  # Same task id, same sandbox.
        by_name["write_file"](ctx, {"path": "lines.txt", "content": "a\nb\nc\n"})
        assert by_name["read_file"](ctx, {"path": "lines.txt", "max_lines": 2}) == "a\nb\n"
        with pytest.raises(ToolCallError, match="max_lines must be at least 1"):
            by_name["read_file"](ctx, {"path": "lines.txt", "max_lines": 0})
        with pytest.raises(ToolCallError):
            by_name["read_file"](ctx, {"path": "missing.txt"})
    finally:
        ctx.cleanup()


def test_unknown_toolset_lists_known() -> None:
    with pytest.raises(ValueError, match="terminal"):
        resolve_toolsets(["browser9000"])
    assert set(TOOLSETS) >= {"terminal", "file"}


def test_patch_replaces_one_unique_snippet_and_refuses_anything_else() -> None:
    ctx = ToolContext("patch-test")
    try:
        patch = {t.name: t for t in resolve_toolsets(["file"])}["patch"]
        ctx.write_file("m.py", "def f(n):\n    return n - 1\n\n\ndef g(n):\n    return n\n")
        assert patch(ctx, {"path": "m.py", "old_string": "n - 1", "new_string": "n + 1"}) == "patched m.py"
        assert ctx.read_file("m.py") == "def f(n):\n    return n + 1\n\n\ndef g(n):\n    return n\n"
        before = ctx.read_file("m.py")
        for old, message in [("n * 2", "does not occur"), ("return n", "occurs 2 times"), ("", "must not be empty")]:
            with pytest.raises(ToolCallError, match=message):
                patch(ctx, {"path": "m.py", "old_string": old, "new_string": "x"})
        assert ctx.read_file("m.py") == before  # A refused patch leaves the file as it was.
        with pytest.raises(ToolCallError):  # The sandbox's path rules hold: no way out of the workspace.
            patch(ctx, {"path": "../../etc/hostname", "old_string": "a", "new_string": "b"})
    finally:
        ctx.cleanup()
