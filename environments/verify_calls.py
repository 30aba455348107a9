"""Judge the agent's functions by calling them in a child process; compare the results out here.

A test process that imports the agent's code is the agent's process: one line in its package can
stub pytest's `Function.runtest`, and an object whose `__eq__` always returns True passes every
`==` a test asserts. So the child only calls the functions and prints their results as JSON after
a marker it was given; serialising keeps plain data only (an object that is not plain data fails
there, a subclass of int or str is printed as the value it holds), and the comparison runs in the
verifier's own process with exact types: a bool where a number is due fails, and so does an int
where a bool is due. An agent that knows this protocol could still print forged results from
inside the child; no generic trick can.
"""

from __future__ import annotations

import ast
import json
import secrets
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from environments.tool_context import ToolContext

_CHILD = """import json, os, sys
sys.path.insert(0, os.getcwd())
{imports}
results = []
for source in {calls!r}:
    try:
        results.append(["ok", json.dumps(eval(source))])
    except BaseException as err:
        results.append(["raised", type(err).__name__])
print("\\n" + {marker!r} + json.dumps(results), flush=True)
"""


_RAISED = object()  # A call that raised: equal to no expected value.


@dataclass(frozen=True)
class Check:
    """One call of the agent's code and the plain value it must return."""

    call: str
    expected: Any


def checks_from(lines: Iterable[str]) -> list[Check]:
    """Checks written as Python, as tasks show them (`f(x) == y`, `f(x) is True`, `f(x) and not
    f(y)`, optionally after `assert`): each side of an `and` is a check; a bare call must be True,
    a `not` call False. Any other form is a task author's error."""
    checks = []
    for line in lines:
        tree = ast.parse(line.strip()).body
        if len(tree) != 1 or not isinstance(tree[0], ast.Assert | ast.Expr):
            raise ValueError(f"not a check: {line!r}")
        test = tree[0].test if isinstance(tree[0], ast.Assert) else tree[0].value
        parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
        checks += [_check(part, line) for part in parts]
    return checks


def _check(node: ast.expr, line: str) -> Check:
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq | ast.Is):
        try:
            expected = ast.literal_eval(node.comparators[0])
        except ValueError as err:
            raise ValueError(f"the expected value is not a literal in {line!r}") from err
        return Check(ast.unparse(node.left), json.loads(json.dumps(expected)))  # Tuples as the lists JSON gives.
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return Check(ast.unparse(node.operand), False)
    if isinstance(node, ast.Call):
        return Check(ast.unparse(node), True)
    raise ValueError(f"not a check: {line!r}")


def run_checks(ctx: ToolContext, imports: str, checks: list[Check], verify_dir: str, cwd: str, timeout: float) -> bool:
    """Whether every check's call, made in a child Python (`imports` first, `cwd` as the import
    root), returned exactly its expected value. Runs after the agent's processes are dead."""
    marker = f"results-{secrets.token_hex(16)}:"
    script = f"{verify_dir}/calls_{secrets.token_hex(8)}.py"
    ctx.write_file(script, _CHILD.format(imports=imports, calls=[c.call for c in checks], marker=marker))
    run = ctx.terminal(f"cd {shlex.quote(cwd)} && python -I {ctx.workspace}/{script}", timeout=timeout)
    lines = [line for line in run["output"].splitlines() if line.startswith(marker)]
    if run["exit_code"] != 0 or len(lines) != 1:
        return False
    try:
        results = json.loads(lines[0][len(marker) :])
        values = [json.loads(value) if status == "ok" else _RAISED for status, value in results]
    except (ValueError, TypeError):
        return False
    return len(values) == len(checks) and all(plain_equal(v, c.expected) for v, c in zip(values, checks, strict=True))


def plain_equal(actual: Any, expected: Any) -> bool:
    """Equal as plain data with exact types, except that an int and a float of one value are equal
    (`average([2, 4]) == 3` holds for 3.0); a bool is never a number."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, int | float):
        return type(actual) in (int, float) and actual == expected
    if isinstance(expected, list):
        return (
            type(actual) is list
            and len(actual) == len(expected)
            and all(plain_equal(a, e) for a, e in zip(actual, expected, strict=True))
        )
    if isinstance(expected, dict):
        return (
            type(actual) is dict
            and actual.keys() == expected.keys()
            and all(plain_equal(actual[k], expected[k]) for k in expected)
        )
    return type(actual) is type(expected) and actual == expected
