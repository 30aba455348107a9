"""Task family for `LongHorizonEnv`: build and commit a small Python project.

Difficulty grows the horizon: an easy project is written in four replies, tested and committed in
one command (6 model calls); a medium one file by file, then tested, committed and checked (11); a
hard one (a console script and a licence too) the careful way, each file read back and each step
checked (36).

Milestones give partial credit, but only for what is committed: the verifier checks out HEAD
into a fresh folder and judges that, so files that were never committed, a fake `.git`, or a
"tests passed" note earn nothing.
"""

from __future__ import annotations

import random
from typing import Any

from flywheel.environments.agent.policies import batch, call, final
from flywheel.environments.verify.untrusted import load_toml

CATEGORIES = ("library", "cli_tool", "data_utils")
MILESTONES = {"pyproject": 0.15, "readme": 0.10, "function": 0.30, "tests": 0.20, "committed": 0.25}
STEP_BUDGET = 45
_NAMES = ("tallyho", "brightpath", "quickmath", "wordsmith", "tinyfmt", "numwise", "textkit", "slugger")
_DEPS = ("requests>=2.31", "rich>=13", "click>=8", "pydantic>=2", "httpx>=0.27")

# category -> list of (function name, source, hidden checks, test body)
_FUNCTIONS: dict[str, list[tuple[str, str, list[str], str]]] = {
    "library": [
        (
            "is_prime",
            "def is_prime(n):\n    if n < 2:\n        return False\n    return all(n % d for d in range(2, int(n**0.5) + 1))\n",
            ["is_prime(2)", "is_prime(97)", "not is_prime(1)", "not is_prime(91)"],
            "assert is_prime(13) and not is_prime(15)",
        ),
        (
            "fizzbuzz",
            "def fizzbuzz(n):\n    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0"
            " else str(i) for i in range(1, n + 1)]\n",
            [
                "fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']",
                "fizzbuzz(15)[-1] == 'FizzBuzz'",
                "fizzbuzz(0) == []",
            ],
            "assert fizzbuzz(3) == ['1', '2', 'Fizz']",
        ),
    ],
    "cli_tool": [
        (
            "slugify",
            "import re\n\n\ndef slugify(text):\n    return re.sub(r'[^a-z0-9]+', '-', text.lower()).strip('-')\n",
            ["slugify('Hello World!') == 'hello-world'", "slugify('  A--B ') == 'a-b'", "slugify('') == ''"],
            "assert slugify('Hi There') == 'hi-there'",
        ),
        (
            "shout",
            "def shout(text):\n    return text.upper() + '!'\n",
            ["shout('hi') == 'HI!'", "shout('') == '!'"],
            "assert shout('ok') == 'OK!'",
        ),
    ],
    "data_utils": [
        (
            "word_freq",
            "def word_freq(text):\n    counts = {}\n    for word in text.lower().split():\n"
            "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
            ["word_freq('a b A') == {'a': 2, 'b': 1}", "word_freq('') == {}"],
            "assert word_freq('x x y') == {'x': 2, 'y': 1}",
        ),
        (
            "moving_sum",
            "def moving_sum(values, k):\n    return [sum(values[i:i + k]) for i in range(len(values) - k + 1)]\n",
            ["moving_sum([1, 2, 3, 4], 2) == [3, 5, 7]", "moving_sum([1], 2) == []"],
            "assert moving_sum([1, 1, 1], 2) == [2, 2]",
        ),
    ],
}


def make_task(rng: random.Random, category: str, difficulty: str) -> dict[str, Any]:
    name = f"{rng.choice(_NAMES)}{rng.randint(2, 99)}"
    function, source, checks, test_body = rng.choice(_FUNCTIONS[category])
    deps = rng.sample(_DEPS, {"easy": 1, "medium": 2, "hard": 3}[difficulty])
    with_cli = difficulty == "hard"
    dep_list = ", ".join(f'"{d}"' for d in deps)
    scripts = f'\n[project.scripts]\n{name} = "{name}.cli:main"\n' if with_cli else ""
    pyproject = f'[project]\nname = "{name}"\nversion = "0.1.0"\ndependencies = [{dep_list}]\n{scripts}'
    readme = f"# {name}\n\nUsage:\n\n```python\nfrom {name}.core import {function}\n```\n"
    test = f"from {name}.core import {function}\n\n\ndef test_{function}():\n    {test_body}\n"
    files = {
        "pyproject.toml": pyproject,
        f"{name}/__init__.py": f'"""{name}."""\n',
        f"{name}/core.py": source,
        "tests/test_core.py": test,
        "README.md": readme,
    }
    if with_cli:
        files[f"{name}/cli.py"] = f"from {name}.core import {function}\n\n\ndef main():\n    print({function})\n"
        files["LICENSE"] = "MIT License\n"
    required = sorted(files)
    extra = f" Also add a console script `{name}` in pyproject ({name}.cli:main) and an MIT LICENSE file."
    prompt = (
        f"Create a Python project named `{name}` in this empty folder: a package `{name}/` whose module "
        f"`{name}/core.py` defines `{function}` (it must satisfy: {checks[0]}); pyproject.toml with "
        f"[project] name `{name}` and dependencies {', '.join(deps)}; a README.md that names the project "
        f"and shows how to import `{function}`; tests in tests/test_core.py that check what `{function}` returns "
        f"and pass with `python -m pytest`. Then initialise git and commit everything, leaving a clean tree."
        + (extra if with_cli else "")
    )
    return {
        "prompt": prompt,
        "answer": {
            "name": name,
            "function": function,
            "reference": source,
            "checks": checks,
            "deps": deps,
            "required": required,
        },
        "oracle": _ORACLES[difficulty](name, function, files, checks[0]),
    }


_COMMIT = "git init -q && git add -A && git -c user.name='Flywheel Agent' -c user.email=agent@flywheel.local commit -qm"


def _batched(name: str, function: str, files: dict[str, str], example: str) -> list[dict[str, Any]]:
    """Write the files in four replies (the two smallest in one), then test and commit in one command: 6
    steps, each reply short enough for a small model's reply budget."""
    small = sorted(files, key=lambda path: len(files[path]))[:2]
    return [
        batch(*(call("write_file", path=path, content=files[path]) for path in small)),
        *(call("write_file", path=path, content=content) for path, content in files.items() if path not in small),
        call("terminal", command=f"python -m pytest -q tests && {_COMMIT} 'Create {name}'", timeout=120),
        final(f"Created and committed the `{name}` project."),
    ]


def _file_by_file(name: str, function: str, files: dict[str, str], example: str) -> list[dict[str, Any]]:
    """One file a step, then test, commit and check: 11 steps."""
    return [
        call("list_files", path="."),
        *(call("write_file", path=path, content=content) for path, content in files.items()),
        call("terminal", command=f"python -c 'from {name}.core import {function}; print({example})'"),
        call("terminal", command="python -m pytest -q tests", timeout=120),
        call("terminal", command=f"{_COMMIT} 'Create {name}'"),
        call("terminal", command="git status --porcelain"),
        final(f"Created and committed the `{name}` project."),
    ]


def _careful(name: str, function: str, files: dict[str, str], example: str) -> list[dict[str, Any]]:
    """A careful engineer's 30+ steps: build, check, commit one file at a time, re-check."""
    steps = [
        call("list_files", path="."),
        call("terminal", command=f"mkdir -p {name} tests"),
        call("terminal", command="git init -q"),
        call("terminal", command="git config user.name 'Flywheel Agent'"),
        call("terminal", command="git config user.email agent@flywheel.local"),
    ]
    for path, content in files.items():
        steps += [call("write_file", path=path, content=content), call("read_file", path=path)]
    steps += [
        call("terminal", command=f"python -c 'from {name}.core import {function}; print({example})'"),
        call("terminal", command="python -m pytest -q tests", timeout=120),  # A test run may outlast the 30 s default.
        call("list_files", path="."),
    ]
    steps += [call("terminal", command=f"git add {path}") for path in files]
    steps += [
        call("terminal", command="git status --short"),
        call("terminal", command="git diff --cached --stat"),
        call("terminal", command=f"git commit -q -m 'Create {name}'"),
        call("terminal", command="git log --oneline"),
        call("terminal", command="git status --porcelain"),
        call("terminal", command="git show --stat HEAD"),
    ]
    return [*steps, final(f"Created and committed the `{name}` project.")]


_ORACLES = {"easy": _batched, "medium": _file_by_file, "hard": _careful}


def pyproject_ok(text: str, answer: dict[str, Any]) -> bool:
    """The committed pyproject.toml names the project, lists its dependencies (and the CLI script)."""
    try:
        project = load_toml(text)["project"]
        deps = " ".join(project.get("dependencies", []))
        wanted = [d.split(">")[0].split("=")[0] for d in answer["deps"]]
        ok = project["name"] == answer["name"] and all(d in deps for d in wanted)
        if any(path.endswith("cli.py") for path in answer["required"]):
            ok = ok and bool(project["scripts"][answer["name"]])
        return ok
    except (ValueError, KeyError, TypeError, AttributeError):  # Unjudgeable: hostile TOML is a failed milestone.
        return False


def readme_ok(text: str, answer: dict[str, Any]) -> bool:
    """The committed README names the project and its function."""
    return answer["name"] in text and answer["function"] in text
