"""Call-based checks: what task authors write parses into checks, each task's checks pass the correct
code and catch its bug, and the comparison is on plain data with exact types."""

from __future__ import annotations

import inspect
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flywheel.environments.long_horizon import mutant_source
from flywheel.environments.sandbox.box import LocalSandbox
from flywheel.environments.tasks import long_horizon_tasks, swe_tasks
from flywheel.environments.tool_context import ToolContext
from flywheel.environments.verify.calls import Check, checks_from, plain_equal, run_checks
from flywheel.environments.verify.hidden_tests import fresh_verify_dir


def test_checks_parse_from_the_forms_tasks_write() -> None:
    assert checks_from(["assert clamp(15, 0, 10) == 10", "is_even(4) is True"]) == [
        Check("clamp(15, 0, 10)", 10),
        Check("is_even(4)", True),
    ]
    assert checks_from(["assert is_prime(13) and not is_prime(15)"]) == [
        Check("is_prime(13)", mode="truthy"),
        Check("is_prime(15)", mode="falsy"),
    ]
    assert checks_from(["fizzbuzz(15)[-1] == 'FizzBuzz'", "pair(k=1) == (1, 2)"]) == [
        Check("fizzbuzz(15)[-1]", "FizzBuzz"),
        Check("pair(k=1)", [1, 2]),  # A tuple as JSON brings it back.
    ]
    # Every comparison must happen out here: nothing the agent's code could redefine in the child.
    for bad in (
        "clamp(1, 0, 2) < 3",
        "f(1) == g(1)",
        "x = f(1)",
        "f(1) or f(2)",
        "not f(1) == 2",
        "isinstance(f(1), int)",
        "len(f(1)) == 2",
        "f(1).real == 1",
    ):
        with pytest.raises(ValueError, match="not a check|not a literal"):
            checks_from([bad])


def _call_all(source: str, checks: list[Check]) -> list[bool]:
    """Each check against `source` run here (the task data's own consistency, no sandbox)."""
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    results = []
    for check in checks:
        try:
            results.append(check.holds(eval(check.call, namespace)))
        except Exception:
            results.append(False)
    return results


def test_every_swe_functions_checks_pass_the_fix_and_catch_each_bug() -> None:
    for name, (correct, bugs, lines, _issue) in swe_tasks._FUNCTIONS.items():
        checks = checks_from(lines)
        assert all(_call_all(correct, checks)), name
        for category, buggy in bugs.items():
            assert not all(_call_all(buggy, checks)), (name, category)


def test_every_long_horizon_functions_checks_pass_its_source_and_fail_its_mutant() -> None:
    for functions in long_horizon_tasks._FUNCTIONS.values():
        for name, source, lines, test_body in functions:
            checks = checks_from(lines)
            assert all(_call_all(source, checks)), name
            assert not all(_call_all(f"def {name}(*a, **k):\n    return None\n", checks)), name
            example = checks_from([test_body])  # The example test the agent sees.
            assert all(_call_all(source, example)), name
            # The mutant the agent's own tests must catch: same name and parameters, every answer wrong.
            mutant = mutant_source(source, name)
            assert not any(_call_all(mutant, [*checks, *example])), name
            assert f"def {name}({', '.join(_parameters(source, name))}):" in mutant


def _parameters(source: str, name: str) -> list[str]:
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    return list(inspect.signature(namespace[name]).parameters)


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


def test_run_checks_calls_in_a_child_and_ignores_what_the_code_prints(tmp_path: Path) -> None:
    root = tmp_path / "sandbox root"  # A space in the workspace's path: every command quotes it.
    ctx = ToolContext("verify-calls-test", factory=lambda task_id: LocalSandbox(task_id, root=root))
    try:
        ctx.write_file("pkg/__init__.py", "")
        noise = """print('results-0:[["ok", "2"]]' * 1000)"""  # Past the sandbox's output cap, marker-less.
        module = f"def inc(x):\n    {noise}\n    return x + 1\n\n\ndef boom():\n    raise KeyError\n"
        ctx.write_file("pkg/core.py", module)
        verify_dir = fresh_verify_dir(ctx)
        assert verify_dir is not None
        imports = "from pkg.core import inc, boom"
        assert run_checks(ctx, imports, checks_from(["inc(1) == 2", "inc(-1) == 0"]), verify_dir, ".", timeout=30)
        assert run_checks(ctx, imports, checks_from(["inc(0) and not inc(-1)"]), verify_dir, ".", timeout=30)
        assert not run_checks(ctx, imports, checks_from(["inc(1) == 3"]), verify_dir, ".", timeout=30)
        assert not run_checks(ctx, imports, checks_from(["inc(1) == 2", "boom() is None"]), verify_dir, ".", timeout=30)
        assert not run_checks(ctx, imports, checks_from(["not boom()"]), verify_dir, ".", timeout=30)
        ctx.write_file("pkg/core.py", "import os\nos._exit(0)\n")  # Never reaches the calls.
        assert not run_checks(ctx, imports, checks_from(["inc(1) == 2"]), verify_dir, ".", timeout=30)
    finally:
        ctx.cleanup()


HONEST = "from lib.core import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"
TESTS_THAT_PIN_NOTHING = {
    "asserts_nothing": "from lib.core import add\n\n\ndef test_add():\n    add(1, 2)\n",
    "no_tests_at_all": "from lib.core import add  # Names the function, collects nothing.\n",
    "not_none": "from lib.core import add\n\n\ndef test_add():\n    assert add(1, 2) is not None\n",
    "right_type": "from lib.core import add\n\n\ndef test_add():\n    assert isinstance(add(1, 2), int)\n",
    "knows_its_folder": (
        "import os\nfrom lib.core import add\n\n\ndef test_add():\n    assert os.path.basename(os.getcwd()) == 'head'\n"
    ),
    "fails_after_its_first_run": (
        "import os\nfrom lib.core import add\n\n\ndef test_add():\n"
        "    flag = os.path.join(os.path.dirname(os.getcwd()), '.ran')\n"  # Outlives the run's copy.
        "    assert not os.path.exists(flag)\n    open(flag, 'w').close()\n"
    ),
}


@pytest.mark.parametrize("tests", ["honest", *TESTS_THAT_PIN_NOTHING])
@pytest.mark.parametrize("committed", ["right", "wrong"])
def test_long_horizon_tests_earn_credit_only_when_they_pin_the_function(tests: str, committed: str) -> None:
    from flywheel.environments.long_horizon import _tests_pin_the_function

    ctx = ToolContext(f"pin-{tests}-{committed}")
    answer = {"name": "lib", "function": "add", "reference": "def add(a, b):\n    return a + b\n"}
    try:
        verify_dir = fresh_verify_dir(ctx)
        assert verify_dir is not None
        head = f"{verify_dir}/head"
        ctx.write_file(f"{head}/lib/__init__.py", "")
        ctx.write_file(
            f"{head}/lib/core.py", "def add(a, b):\n    return a + b" + (" + 1" if committed == "wrong" else "") + "\n"
        )
        ctx.write_file(f"{head}/tests/test_core.py", HONEST if tests == "honest" else TESTS_THAT_PIN_NOTHING[tests])
        assert _tests_pin_the_function(ctx, answer, verify_dir) is (tests == "honest" and committed == "right")
    finally:
        ctx.cleanup()


@pytest.mark.parametrize("difficulty", ["easy", "hard"])
def test_a_generated_swe_task_ships_passing_visible_tests(tmp_path: Path, difficulty: str) -> None:
    """The visible tests the agent may run pass on the buggy package (they cover only the correct functions);
    a hard task spreads its functions over two modules, so the agent has to find the right one."""
    task = swe_tasks.make_task(random.Random(3), "off_by_one", difficulty)
    for path, text in task["files"].items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_visible.py"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:]
    modules = {Path(path).name for path in task["files"] if path.startswith(task["answer"]["package"] + "/")}
    assert modules == ({"__init__.py", "core.py", "extra.py"} if difficulty == "hard" else {"__init__.py", "core.py"})
    assert all(path in task["oracle"][-1]["final"] for path in task["answer"]["buggy_files"])  # It says what it fixed.


def test_a_pyproject_names_the_project_its_dependencies_and_its_cli() -> None:
    answer = {"name": "tally", "deps": ["requests>=2.0", "click==8.1"], "required": ["tally/cli.py"]}
    bare = '[project]\nname = "tally"\ndependencies = ["requests", "click"]\n'
    good = bare + '[project.scripts]\ntally = "tally.cli:main"\n'
    assert long_horizon_tasks.pyproject_ok(good, answer)  # Any version of each dependency.
    assert not long_horizon_tasks.pyproject_ok(good.replace('"click"', '"clack"'), answer)
    assert not long_horizon_tasks.pyproject_ok(bare, answer)  # A project with a cli.py needs its script.
    assert not long_horizon_tasks.pyproject_ok(good.replace('name = "tally"', 'name = "other"'), answer)
    assert long_horizon_tasks.pyproject_ok(bare, {**answer, "required": ["tally/core.py"]})
