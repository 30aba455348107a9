"""Tools: schemas come from signatures and docstrings; bad arguments become tool errors."""

from __future__ import annotations

import json

import pytest

from environments.errors import ToolCallError
from environments.tool_context import ToolContext
from environments.tools import TOOLSETS, resolve_toolsets, tool


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


def test_arguments_are_validated_and_coerced() -> None:
    ctx = object()
    assert demo(ctx, {"path": "x", "count": "3"}) == "x:3:None"  # type: ignore[arg-type]
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
    assert invert(object(), {"n": "4"}) == "0.25"  # type: ignore[arg-type]
    with pytest.raises(ToolCallError, match="invert: ZeroDivisionError: float division by zero"):
        invert(object(), {"n": 0})  # type: ignore[arg-type]


def test_file_and_terminal_tools_share_the_task_sandbox() -> None:
    ctx = ToolContext("tools-test")
    try:
        by_name = {t.name: t for t in resolve_toolsets(["terminal", "file"])}
        by_name["write_file"](ctx, {"path": "d/x.txt", "content": "hello"})
        out = json.loads(by_name["terminal"](ctx, {"command": "cat d/x.txt"}))
        assert out == {"exit_code": 0, "output": "hello"}
        assert "d/x.txt" in by_name["list_files"](ctx, {})
        assert ToolContext("tools-test").read_file("d/x.txt") == "hello"  # Same task id, same sandbox.
        with pytest.raises(ToolCallError):
            by_name["read_file"](ctx, {"path": "missing.txt"})
    finally:
        ctx.cleanup()


def test_unknown_toolset_lists_known() -> None:
    with pytest.raises(ValueError, match="terminal"):
        resolve_toolsets(["browser9000"])
    assert set(TOOLSETS) >= {"terminal", "file"}
