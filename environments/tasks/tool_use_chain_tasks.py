"""Task family for `ToolUseChainEnv`: multi-tool chores on a generated repository.

Categories:
- `todo_report`: collect every TODO comment of the Python files into a markdown table.
- `line_count`: count the import lines of every Python file into counts.json.
- `csv_summary`: total a CSV's amounts per region into summary.json.

Difficulty grows the horizon: an easy repository is one project; a medium one holds 2 projects and a
hard one 4 (more files each, and distractors), one folder each, and every project needs its own
deliverable in its folder - the oracle looks into each and runs the category's command there: 3, 6
and 10 model calls.

Each task carries its ground truth (`answer`, computed from the generated files, not from the
workspace; per project under `projects` when there are several) and an `oracle` action list that
solves it with the same tools the agent has. JSON answers are checked with their types: a count is
an integer and a total a number, never a string.
"""

from __future__ import annotations

import random
from typing import Any

from flywheel.environments.agent.policies import call, final
from flywheel.environments.agent.tools import json_type_error
from flywheel.environments.verify.untrusted import bounded_text, finite_number, load_json

CATEGORIES = ("todo_report", "line_count", "csv_summary")
_SIZE = {"easy": 3, "medium": 4, "hard": 5}  # Python files per project.
_PROJECTS = {"easy": 1, "medium": 2, "hard": 4}
_PROJECT_NAMES = ("atlas", "borealis", "cobalt", "dune", "ember", "fjord", "granite", "harbor")
_DIRS = ("src", "lib", "app", "app/core", "tools", "pkg/util")
_WORDS = ("parser", "cache", "render", "client", "config", "storage", "metrics", "router", "auth", "queue")
_VERBS = ("handle", "load", "save", "check", "build", "merge", "split", "format", "parse", "emit")
_TODOS = (
    "handle empty input",
    "add retries",
    "remove this hack",
    "log the error",
    "support unicode",
    "cache the result",
    "validate arguments",
    "close the file",
    "speed this up",
    "write docs",
)
_IMPORTS = (
    "import os",
    "import sys",
    "import json",
    "from pathlib import Path",
    "import re",
    "from typing import Any",
)
_REGIONS = ("north", "south", "east", "west", "central")
# The oracles count, total and number lines with a script, never in their head: adding a column of
# decimals, tallying lines over many files or numbering a TODO's line is arithmetic a small model
# cannot learn from a few demonstrations, and one command (the same for every task and every
# difficulty of the category) is a procedure it can.
_IMPORT_COUNTS = (
    "python -c \"import glob,json;json.dump({p:sum(l.startswith(('import ','from ')) for l in open(p)) "
    "for p in sorted(glob.glob('**/*.py',recursive=True))},open('counts.json','w'))\""
)
_CSV_TOTALS = (
    'python -c "import csv,json,collections;t=collections.Counter();'
    "[t.update({r['region']:float(r['amount'])}) for r in csv.DictReader(open('data/sales.csv'))];"
    "json.dump({k:round(v,2) for k,v in t.items()},open('summary.json','w'))\""
)
_TODO_TABLE = (  # awk numbers the lines; starting with its own first word, it is not mistaken for the others.
    'awk \'BEGIN{print "| file | line | todo |\\n| --- | --- | --- |"} /# TODO:/{sub(/.*# TODO: */,"");'
    'print "| " FILENAME " | " FNR " | " $0 " |"}\' $(find * -name \'*.py\' | LC_ALL=C sort) > report.md'
)
# The JSON file each JSON-answer category asks for, and the key of its ground truth in `answer`.
JSON_ANSWERS = {"line_count": ("counts.json", "counts"), "csv_summary": ("summary.json", "totals")}
_COUNTS = {"type": "object", "additionalProperties": {"type": "integer"}}
_TOTALS = {"type": "object", "additionalProperties": {"type": "number"}}


def make_task(rng: random.Random, category: str, difficulty: str) -> dict[str, Any]:
    names = sorted(rng.sample(_PROJECT_NAMES, _PROJECTS[difficulty])) if difficulty != "easy" else [""]
    builder = {"todo_report": _todo_report, "line_count": _line_count, "csv_summary": _csv_summary}[category]
    files: dict[str, str] = {}
    truths: dict[str, dict[str, Any]] = {}
    steps: list[dict[str, Any]] = [] if names == [""] else [call("list_files", path=".")]
    for name in names:
        project = _python_files(rng, _SIZE[difficulty], nested=difficulty != "easy")
        if difficulty == "hard":  # Distractors the instructions exclude.
            project["NOTES.txt"] = "TODO: not a python file\nimport os is not code here\n"
        task, project, truths[name], look, command = builder(rng, project, difficulty)
        files |= {f"{name}/{path}" if name else path: text for path, text in project.items()}
        if name:  # Look into the project, then run the command there.
            inside = look["arguments"]["path"].strip(".").strip("/")
            steps += [{**look, "arguments": {"path": f"{name}/{inside}".rstrip("/")}}]
            steps += [call("terminal", command=f"cd {name} && {command}")]
        else:
            steps += [look, call("terminal", command=command)]
    prompt = task
    if names != [""]:
        folders = ", ".join(f"{name}/" for name in names)
        for whole, project in _PER_PROJECT:
            task = task.replace(whole, project)
        prompt = f"This repository holds {len(names)} projects, one per folder: {folders}. For each project: {task}"
    answer = truths[""] if names == [""] else {"projects": truths}
    return {"prompt": prompt, "files": files, "answer": answer, "oracle": [*steps, final(_DONE[category])]}


def _python_files(rng: random.Random, count: int, nested: bool) -> dict[str, str]:
    files: dict[str, str] = {}
    while len(files) < count:
        folder = rng.choice(_DIRS if nested else _DIRS[:1])
        path = f"{folder}/{rng.choice(_WORDS)}_{rng.randint(1, 99)}.py"
        lines = [*rng.sample(_IMPORTS, rng.randint(0, 3)), ""]
        for _ in range(rng.randint(2, 4)):
            name = f"{rng.choice(_VERBS)}_{rng.choice(_WORDS)}"
            lines += [f"def {name}(value):", f'    """{name.replace("_", " ").capitalize()}."""']
            if rng.random() < 0.45:
                lines.append(f"    # TODO: {rng.choice(_TODOS)}")
            lines += ["    return value", ""]
        files[path] = "\n".join(lines)
    if not any("# TODO:" in text for text in files.values()):  # Every task has at least one TODO.
        path = sorted(files)[0]
        files[path] = files[path].replace("    return value", f"    # TODO: {rng.choice(_TODOS)}\n    return value", 1)
    return files


_DONE = {"todo_report": "report.md is written.", "line_count": "counts.json is written.",
         "csv_summary": "summary.json is written."}  # fmt: skip
# A task's wording for a whole repository -> for one project of several (its file goes in its folder).
_PER_PROJECT = (
    ("of this repository", "of the project"),
    ("in this repository", "in the project"),
    ("the repository root", "the project's folder"),
    ("Write report.md", "Write report.md in the project's folder"),
    ("Write counts.json", "Write counts.json in the project's folder"),
    ("write summary.json", "write summary.json in the project's folder"),
    ("data/sales.csv lists", "The project's data/sales.csv lists"),
)
Built = tuple[str, dict[str, str], dict[str, Any], dict[str, Any], str]


def _todo_report(rng: random.Random, files: dict[str, str], difficulty: str) -> Built:
    rows = [
        [path, number, line.split("TODO:", 1)[1].strip()]
        for path in sorted(p for p in files if p.endswith(".py"))
        for number, line in enumerate(files[path].splitlines(), start=1)
        if "# TODO:" in line
    ]
    task = (
        "Collect every TODO comment in the Python (.py) files of this repository. Write report.md "
        "containing one markdown table with the columns `file | line | todo`, one row per TODO, sorted "
        "by file path and then line number. `todo` is the text after 'TODO:'; `line` is 1-based."
    )
    return task, files, {"rows": rows}, call("list_files", path="."), _TODO_TABLE


def _line_count(rng: random.Random, files: dict[str, str], difficulty: str) -> Built:
    counts = {
        path: sum(1 for line in text.splitlines() if line.startswith(("import ", "from ")))
        for path, text in sorted(files.items())
        if path.endswith(".py")
    }
    task = (
        "For every Python (.py) file in this repository, count the lines that start with `import ` or "
        "`from `. Write counts.json: a JSON object mapping each file path (relative to the repository "
        "root) to its count."
    )
    return task, files, {"counts": counts}, call("list_files", path="."), _IMPORT_COUNTS


def _csv_summary(rng: random.Random, files: dict[str, str], difficulty: str) -> Built:
    regions = rng.sample(_REGIONS, {"easy": 2, "medium": 3, "hard": 5}[difficulty])
    rows = []
    for _ in range({"easy": 6, "medium": 15, "hard": 40}[difficulty]):
        amount = round(rng.uniform(-20 if difficulty == "hard" else 1, 500), 2)
        rows.append((rng.choice(regions), rng.choice(_WORDS), amount))
    totals = {r: round(sum(a for reg, _, a in rows if reg == r), 2) for r in sorted({reg for reg, _, _ in rows})}
    csv = "region,product,amount\n" + "".join(f"{r},{p},{a:.2f}\n" for r, p, a in rows)
    task = (
        "data/sales.csv lists sales (region, product, amount; refunds are negative). Compute the total "
        "amount per region and write summary.json as a JSON object {region: total}, totals rounded to "
        "2 decimals."
    )
    return (
        task,
        {**files, "data/sales.csv": csv},
        {"totals": totals},
        call("read_file", path="data/sales.csv"),
        _CSV_TOTALS,
    )


def verify(item: dict[str, Any], read: Any) -> bool:
    """Check each project's file against its ground truth; `read(path)` returns text or raises. The files
    are the agent's: read bounded (`verify.untrusted`), so a hostile one fails the task instead of the verifier."""
    projects = item["answer"].get("projects") or {"": item["answer"]}
    return all(
        _verify_one(item["category"], truth, lambda path, name=name: read(f"{name}/{path}" if name else path))
        for name, truth in projects.items()
    )


def _verify_one(category: str, answer: dict[str, Any], read: Any) -> bool:
    try:
        if category == "todo_report":
            return _table_rows(bounded_text(read("report.md"))) == [[f, int(n), t] for f, n, t in answer["rows"]]
        path, key = JSON_ANSWERS[category]
        produced, expected = load_json(read(path)), answer[key]
        if category == "line_count":
            return json_type_error(produced, _COUNTS) is None and produced == expected
        return (
            json_type_error(produced, _TOTALS) is None
            and set(produced) == set(expected)
            and all(abs(finite_number(produced[k]) - v) <= 0.011 for k, v in expected.items())
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # Unjudgeable is a ValueError.
        return False


def _table_rows(markdown: str) -> list[list[Any]]:
    rows = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not line.strip().startswith("|") or set(cells[1]) <= set("-: "):
            continue
        if cells[1].isdigit():
            rows.append([cells[0], int(cells[1]), cells[2]])
    return rows
