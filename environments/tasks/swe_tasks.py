"""Task family for `SWEBenchEnv`: a small generated Python package with injected bugs.

The agent sees the package, a visible test file and an issue text. After the episode the verifier
calls every function of the package on hidden inputs in a child process and compares the results
outside it (`flywheel.environments.verify.calls`), so files the agent planted (conftest.py, pytest.ini, a shadowing
pytest.py, deleted or edited visible tests, a package that patches pytest) change nothing. The
hidden checks cover every function, so gutting code fails too.
Difficulty grows the horizon: 1, 2 or 3 bugs (each reported in the issue) among 2, 4 or 7
functions, spread over two modules when hard. The oracle fixes each bug with a targeted `patch` of
the changed line (read the module, patch, run the tests: the same three steps per bug), rather than
rewriting a module that holds up to seven functions: 5, 8 and 11 model calls.
"""

from __future__ import annotations

import random
from typing import Any

from flywheel.environments.agent.policies import call, final

CATEGORIES = ("off_by_one", "wrong_operator", "wrong_condition")

# name -> (correct source, {category: buggy source}, hidden test lines, issue example)
_FUNCTIONS: dict[str, tuple[str, dict[str, str], list[str], str]] = {
    "clamp": (
        "def clamp(value, low, high):\n    return max(low, min(value, high))\n",
        {
            "wrong_operator": "def clamp(value, low, high):\n    return max(low, max(value, high))\n",
            "wrong_condition": "def clamp(value, low, high):\n    return value if low < value else low\n",
        },
        ["assert clamp(15, 0, 10) == 10", "assert clamp(-3, 0, 10) == 0", "assert clamp(4, 0, 10) == 4"],
        "`clamp(15, 0, 10)` returns 15, but it should return 10.",
    ),
    "count_up_to": (
        "def count_up_to(n):\n    return list(range(1, n + 1))\n",
        {"off_by_one": "def count_up_to(n):\n    return list(range(1, n))\n"},
        ["assert count_up_to(3) == [1, 2, 3]", "assert count_up_to(0) == []", "assert count_up_to(1) == [1]"],
        "`count_up_to(3)` returns [1, 2] but should return [1, 2, 3].",
    ),
    "last_n": (
        "def last_n(items, n):\n    return items[len(items) - n:] if n > 0 else []\n",
        {"off_by_one": "def last_n(items, n):\n    return items[len(items) - n + 1 :] if n > 0 else []\n"},
        [
            "assert last_n([1, 2, 3, 4], 2) == [3, 4]",
            "assert last_n([1], 0) == []",
            "assert last_n([5, 6], 2) == [5, 6]",
        ],
        "`last_n([1, 2, 3, 4], 2)` returns [4] instead of [3, 4].",
    ),
    "is_even": (
        "def is_even(n):\n    return n % 2 == 0\n",
        {
            "wrong_operator": "def is_even(n):\n    return n % 2 == 1\n",
            "wrong_condition": "def is_even(n):\n    return n % 2 != 0\n",
        },
        ["assert is_even(4) is True", "assert is_even(7) is False", "assert is_even(0) is True"],
        "`is_even(4)` returns False.",
    ),
    "average": (
        "def average(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n",
        {
            "wrong_operator": "def average(xs):\n    return sum(xs) * len(xs) if xs else 0.0\n",
            "off_by_one": "def average(xs):\n    return sum(xs) / (len(xs) + 1) if xs else 0.0\n",
        },
        ["assert average([2, 4]) == 3", "assert average([]) == 0.0", "assert average([5]) == 5"],
        "`average([2, 4])` does not return 3.",
    ),
    "is_adult": (
        "def is_adult(age):\n    return age >= 18\n",
        {
            "wrong_condition": "def is_adult(age):\n    return age > 18\n",
            "off_by_one": "def is_adult(age):\n    return age >= 19\n",
        },
        ["assert is_adult(18) is True", "assert is_adult(17) is False", "assert is_adult(40) is True"],
        "`is_adult(18)` returns False; an 18-year-old is an adult.",
    ),
    "word_count": (
        "def word_count(text):\n    return len(text.split())\n",
        {"off_by_one": "def word_count(text):\n    return len(text.split()) - 1\n"},
        ["assert word_count('a b c') == 3", "assert word_count('') == 0", "assert word_count('one') == 1"],
        "`word_count('a b c')` returns 2 instead of 3.",
    ),
}
_PACKAGES = ("mathkit", "toolbelt", "numtools", "handy", "utilbox")


def make_task(rng: random.Random, category: str, difficulty: str) -> dict[str, Any]:
    candidates = sorted(n for n, spec in _FUNCTIONS.items() if category in spec[1])
    buggy = rng.sample(candidates, {"easy": 1, "medium": 2, "hard": 3}[difficulty])
    others = rng.sample(sorted(set(_FUNCTIONS) - set(buggy)), {"easy": 1, "medium": 2, "hard": 4}[difficulty])
    names = sorted([*buggy, *others])
    package = rng.choice(_PACKAGES)
    # Hard tasks spread functions over two modules, so the agent has to find the right one.
    modules = {name: ("core" if difficulty != "hard" or i % 2 == 0 else "extra") for i, name in enumerate(names)}

    def module_source(module: str) -> str:
        parts = [_FUNCTIONS[n][1][category] if n in buggy else _FUNCTIONS[n][0] for n in names if modules[n] == module]
        return "\n\n".join(parts)

    files = {f"{package}/__init__.py": ""}
    for module in sorted(set(modules.values())):
        files[f"{package}/{module}.py"] = module_source(module)
    imports = "\n".join(f"from {package}.{modules[n]} import {n}" for n in names)
    visible = [line for n in others for line in _FUNCTIONS[n][2][:1]]
    files["tests/test_visible.py"] = f"{imports}\n\n\ndef test_examples():\n" + "".join(f"    {t}\n" for t in visible)
    paths = {name: f"{package}/{modules[name]}.py" for name in buggy}
    reports = " ".join(_FUNCTIONS[name][3] for name in buggy)
    steps = [call("list_files", path=".")]
    for name in buggy:
        steps += [
            call("read_file", path=paths[name]),
            call("patch", path=paths[name], **_fix(files[paths[name]], name, category)),
            call("terminal", command="python -m pytest -q tests", timeout=120),
        ]
    fixed = ", ".join(f"`{name}` in {paths[name]}" for name in buggy)
    return {
        "prompt": (
            f"Bug report for the `{package}` package in this repository: {reports} "
            "Fix the package's source (do not change the tests). You can run the tests with "
            "`python -m pytest -q tests`."
        ),
        "files": files,
        "answer": {
            "package": package,
            "imports": imports,
            "checks": [check for n in names for check in _FUNCTIONS[n][2]],
            "buggy_files": sorted(set(paths.values())),
        },
        "oracle": [*steps, final(f"Fixed {fixed}.")],
    }


def _fix(source: str, name: str, category: str) -> dict[str, str]:
    """The oracle's edit: only the lines the bug changed (the whole function where those are not unique
    in the module), so the demonstration is the same few tokens at every difficulty, however many
    functions share the file, instead of the whole module rewritten."""
    correct, broken = _FUNCTIONS[name][0], _FUNCTIONS[name][1][category]
    good, bad = correct.splitlines(keepends=True), broken.splitlines(keepends=True)
    changed = [i for i, (a, b) in enumerate(zip(good, bad, strict=True)) if a != b]
    old = "".join(bad[changed[0] : changed[-1] + 1])
    if source.count(old) != 1:
        return {"old_string": broken, "new_string": correct}
    return {"old_string": old, "new_string": "".join(good[changed[0] : changed[-1] + 1])}
