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
from typing import Any, Literal

from flywheel.environments.tool_context import ToolContext
from flywheel.environments.verify.hidden_tests import write_verifier_file

# The child saves its stdout, points fds 1 and 2 at /dev/null before importing the agent's code (what
# that code prints can neither fill the sandbox's output cap nor mix with the results), and writes
# the results line to the saved stdout.
_CHILD = """import json, os, sys
results_out = os.fdopen(os.dup(1), "w")
quiet = os.open(os.devnull, os.O_WRONLY)
os.dup2(quiet, 1)
os.dup2(quiet, 2)
sys.path.insert(0, os.getcwd())
{imports}
results = []
for source in {calls!r}:
    try:
        results.append(["ok", json.dumps(eval(source))])
    except BaseException as err:
        results.append(["raised", type(err).__name__])
results_out.write("\\n" + {marker!r} + json.dumps(results) + "\\n")
results_out.flush()
"""

_RAISED = object()  # A call that raised: equal to no expected value.


@dataclass(frozen=True)
class Check:
    """One call of the agent's code and what its plain result must be: `expected` exactly
    (`mode="equal"`), or any truthy or falsy value (`"truthy"`, `"falsy"`), as `assert f(x)` asks."""

    call: str
    expected: Any = None
    mode: Literal["equal", "truthy", "falsy"] = "equal"

    def holds(self, value: Any) -> bool:
        if self.mode == "equal":
            return plain_equal(value, self.expected)
        return bool(value) is (self.mode == "truthy")  # Plain data here: its truth is not the agent's to define.


def checks_from(lines: Iterable[str]) -> list[Check]:
    """Checks written as Python, as tasks show them (`f(x) == y`, `f(x) is True`, `f(x) and not
    f(y)`, optionally after `assert`): each side of an `and` is a check. Only a call of a name with
    literal arguments (optionally indexed by a literal) is accepted, so every comparison happens
    out here, never in the child where the agent's code could redefine it."""
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
        expected = _literal(node.comparators[0], line)
        return Check(_plain_call(node.left, line), json.loads(json.dumps(expected)))  # Tuples as JSON lists.
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return Check(_plain_call(node.operand, line), mode="falsy")
    return Check(_plain_call(node, line), mode="truthy")


def _plain_call(node: ast.expr, line: str) -> str:
    """`f(literal, ...)` or `f(literal, ...)[literal]` as source; anything else is refused."""
    call = node.value if isinstance(node, ast.Subscript) else node
    if isinstance(node, ast.Subscript):
        _literal(node.slice, line)
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
        raise ValueError(f"not a check (a call of a name): {line!r}")
    for argument in [*call.args, *(k.value for k in call.keywords)]:
        _literal(argument, line)
    return ast.unparse(node)


def _literal(node: ast.expr, line: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError as err:
        raise ValueError(f"not a literal in {line!r}: {ast.unparse(node)}") from err


def run_checks(ctx: ToolContext, imports: str, checks: list[Check], verify_dir: str, cwd: str, timeout: float) -> bool:
    """Whether every check's call, made in a child Python (`imports` first, `cwd` as the import
    root), returned exactly its expected value. Runs after the agent's processes are dead."""
    marker = f"results-{secrets.token_hex(16)}:"
    script = f"{verify_dir}/calls_{secrets.token_hex(8)}.py"
    if not write_verifier_file(
        ctx, script, _CHILD.format(imports=imports, calls=[c.call for c in checks], marker=marker)
    ):
        return False
    run = ctx.terminal(
        f"cd {shlex.quote(cwd)} && python -I {shlex.quote(f'{ctx.workspace}/{script}')}", timeout=timeout
    )
    lines = [line for line in run["output"].splitlines() if line.startswith(marker)]
    if run["exit_code"] != 0 or len(lines) != 1:
        return False
    try:
        results = json.loads(lines[0][len(marker) :])
        values = [json.loads(value) if status == "ok" else _RAISED for status, value in results]
    except (ValueError, TypeError):
        return False
    return len(values) == len(checks) and all(
        value is not _RAISED and check.holds(value) for value, check in zip(values, checks, strict=True)
    )


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
