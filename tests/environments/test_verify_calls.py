"""Call-based checks: what task authors write parses into checks, each task's checks pass the correct
code and catch its bug, and the comparison is on plain data with exact types."""

from __future__ import annotations

from typing import Any

import pytest

from environments.tasks import long_horizon_tasks, swe_tasks
from environments.tool_context import ToolContext
from environments.verify_calls import Check, checks_from, plain_equal, run_checks
from environments.verify_tests import fresh_verify_dir


def test_checks_parse_from_the_forms_tasks_write() -> None:
    assert checks_from(["assert clamp(15, 0, 10) == 10", "is_even(4) is True"]) == [
        Check("clamp(15, 0, 10)", 10),
        Check("is_even(4)", True),
    ]
    assert checks_from(["assert is_prime(13) and not is_prime(15)"]) == [
        Check("is_prime(13)", True),
        Check("is_prime(15)", False),
    ]
    assert checks_from(["fizzbuzz(15)[-1] == 'FizzBuzz'", "pair() == (1, 2)"]) == [
        Check("fizzbuzz(15)[-1]", "FizzBuzz"),
        Check("pair()", [1, 2]),  # A tuple as JSON brings it back.
    ]
    for bad in ("clamp(1, 0, 2) < 3", "f(1) == g(1)", "x = f(1)", "f(1) or f(2)"):
        with pytest.raises(ValueError, match="not a check|not a literal"):
            checks_from([bad])


def _call_all(source: str, checks: list[Check]) -> list[bool]:
    """Each check against `source` run here (the task data's own consistency, no sandbox)."""
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    results = []
    for check in checks:
        try:
            results.append(plain_equal(eval(check.call, namespace), check.expected))
        except Exception:
            results.append(False)
    return results


def test_every_swe_functions_checks_pass_the_fix_and_catch_each_bug() -> None:
    for name, (correct, bugs, lines, _issue) in swe_tasks._FUNCTIONS.items():
        checks = checks_from(lines)
        assert all(_call_all(correct, checks)), name
        for category, buggy in bugs.items():
            assert not all(_call_all(buggy, checks)), (name, category)


def test_every_long_horizon_functions_checks_pass_its_source_and_fail_a_gutted_one() -> None:
    for functions in long_horizon_tasks._FUNCTIONS.values():
        for name, source, lines, test_body in functions:
            checks = checks_from(lines)
            assert all(_call_all(source, checks)), name
            assert not any(_call_all(f"def {name}(*a, **k):\n    return None\n", checks)), name
            assert all(_call_all(source, checks_from([test_body]))), name  # The example test the agent sees.


@pytest.mark.parametrize(
    ("actual", "expected", "equal"),
    [
        (3.0, 3, True),  # `average([2, 4]) == 3` holds for 3.0.
        (True, 1, False),  # A bool is not a number...
        (1, True, False),  # ...and a number is not a bool.
        ([1, [2.0]], [1, [2]], True),
        ([True], [1], False),
        ({"a": 2, "b": 1}, {"b": 1, "a": 2}, True),
        ({"a": 2}, {"a": 2, "b": 1}, False),
        ("1", 1, False),
        (None, None, True),
        (None, False, False),
        ([1, 2], {"1": 2}, False),
    ],
)
def test_plain_equal_compares_exact_types(actual: Any, expected: Any, equal: bool) -> None:
    assert plain_equal(actual, expected) is equal


def test_run_checks_calls_in_a_child_and_ignores_what_the_code_prints() -> None:
    ctx = ToolContext("verify-calls-test")
    try:
        ctx.write_file("pkg/__init__.py", "")
        noise = """print('results-0:[["ok", "2"]]')"""  # Looks like results, without the marker.
        module = f"def inc(x):\n    {noise}\n    return x + 1\n\n\ndef boom():\n    raise KeyError\n"
        ctx.write_file("pkg/core.py", module)
        verify_dir = fresh_verify_dir(ctx)
        assert verify_dir is not None
        imports = "from pkg.core import inc, boom"
        assert run_checks(ctx, imports, checks_from(["inc(1) == 2", "inc(-1) == 0"]), verify_dir, ".", timeout=30)
        assert not run_checks(ctx, imports, checks_from(["inc(1) == 3"]), verify_dir, ".", timeout=30)
        assert not run_checks(ctx, imports, checks_from(["inc(1) == 2", "boom() is None"]), verify_dir, ".", timeout=30)
        ctx.write_file("pkg/core.py", "import os\nos._exit(0)\n")  # Never reaches the calls.
        assert not run_checks(ctx, imports, checks_from(["inc(1) == 2"]), verify_dir, ".", timeout=30)
    finally:
        ctx.cleanup()
