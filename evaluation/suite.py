"""The shipped offline lm-eval suite: tool-call formatting, tool selection, and a little reasoning.

Tool-call items use typed arguments (integers, numbers, booleans, enums, arrays) and are scored
strictly (`tasks/utils.py`): "5" for an integer is wrong, as on held-out tool-calling benchmarks.
Items are generated deterministically (seeded) from the environments' vocabulary, carry
`category` and `difficulty` in the doc (for weakness mining), and are written as lm-eval YAML +
JSONL into a folder that `--include_path` / `TaskManager(include_path=...)` reads; the same items
are stored as an `evalset` artifact (lineage and decontamination of training data).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from flywheel.data import ArtifactNotFound, ArtifactStore, Manifest

SUITE_VERSION = 2
SUITE_TASKS = ("flywheel_tool_call", "flywheel_tool_select", "flywheel_reasoning")
# The env categories that train each task's skill (`CurriculumConfig.teaches`): an exact typed call from
# a request, and the right function (or none) among several. No env teaches the suite's arithmetic.
SUITE_TEACHERS = {
    "flywheel_tool_call": ("function_calling/single", "function_calling/parallel"),
    "flywheel_tool_select": ("function_calling/choose_or_refuse",),
}
TOOLS = ("terminal", "read_file", "write_file", "list_files", "open_url", "search", "submit_answer")
_SYSTEM = (
    "You can call these tools (optional arguments in brackets):\n"
    "- terminal(command: string, [timeout: integer seconds])\n"
    "- read_file(path: string, [max_lines: integer])\n"
    "- write_file(path: string, content: string)\n"
    "- list_files(path: string)\n"
    "- open_url(url: string)\n"
    '- search(query: string, [department: "books" | "garden" | "kitchen" | "toys"], [max_price: number], '
    "[in_stock: boolean])\n"
    "- submit_answer(product_ids: array of integers, [price: number])\n"
    'To call one, reply with <tool_call>{"name": ..., "arguments": {...}}</tool_call>, every argument '
    "in its JSON type."
)
_DEPARTMENTS = ("books", "garden", "kitchen", "toys")
_DIRS = ("src", "docs", "app/core", "tests", "data/raw", "pkg/util/io")
_FILES = ("notes.md", "config.json", "main.py", "report.csv", "todo.txt", "setup.cfg")
_WORDS = ("alpha", "ready", "draft", "done", "pending", "ok")


def _path(rng: random.Random, difficulty: str) -> str:
    depth = {"easy": 0, "medium": 1, "hard": 2}[difficulty]
    parts = [rng.choice(_DIRS) for _ in range(depth)]
    return "/".join([*parts, rng.choice(_FILES)]) if parts else rng.choice(_FILES)


def _tool_call_item(rng: random.Random, index: int) -> dict[str, Any]:
    difficulty = ("easy", "medium", "hard")[index % 3]
    tool = TOOLS[index % len(TOOLS)]
    path = _path(rng, difficulty)
    word = rng.choice(_WORDS)
    folder = path.rsplit("/", 1)[0] if "/" in path else "."
    distractor = " The user is in a hurry." if difficulty == "hard" else ""
    lines, seconds = rng.randint(2, 40), rng.choice((10, 60, 120))
    price = rng.choice((15, 40, 99.5, 12.75))
    department, in_stock = rng.choice(_DEPARTMENTS), rng.random() < 0.5
    product_ids = rng.sample(range(100000, 999999), 1 if difficulty == "easy" else 2)
    stock = "only items in stock" if in_stock else "including items out of stock"
    intents = {
        "read_file": (f"Show me the first {lines} lines of {path}.", {"path": path, "max_lines": lines}),
        "write_file": (f"Create the file {path} containing exactly: {word}", {"path": path, "content": word}),
        "list_files": (f"List the files in the folder {folder}.", {"path": folder}),
        "terminal": (
            f"Run the shell command `wc -l {path}` with a timeout of {seconds} seconds.",
            {"command": f"wc -l {path}", "timeout": seconds},
        ),
        "open_url": (f"Open the web page http://127.0.0.1:8000/{word}.", {"url": f"http://127.0.0.1:8000/{word}"}),
        "search": (
            f"Search the shop for '{word} lamp' in the {department} department, at most ${price}, {stock}.",
            {"query": f"{word} lamp", "department": department, "max_price": price, "in_stock": in_stock},
        ),
        "submit_answer": (
            f"Submit the answer: product id(s) {', '.join(map(str, product_ids))}, price ${price}.",
            {"product_ids": product_ids, "price": price},
        ),
    }
    request, arguments = intents[tool]
    return {
        "prompt": f"{_SYSTEM}\n\nTask: {request}{distractor}",
        "target": json.dumps({"name": tool, "arguments": arguments}),
        "category": f"tool_call/{tool}",
        "difficulty": difficulty,
    }


def _tool_select_item(rng: random.Random, index: int) -> dict[str, Any]:
    item = _tool_call_item(rng, index)
    tool = json.loads(item["target"])["name"]
    request = item["prompt"].split("Task: ", 1)[1]
    return {
        "prompt": f"Which tool should be used for this task? {request}\nAnswer:",
        "choices": list(TOOLS),
        "target": TOOLS.index(tool),
        "category": f"tool_select/{tool}",
        "difficulty": item["difficulty"],
    }


def _reasoning_item(rng: random.Random, index: int) -> dict[str, Any]:
    difficulty = ("easy", "medium", "hard")[index % 3]
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 5)
    if difficulty == "easy":
        question, answer = f"A box has {a} pens and {b} more are added. How many pens are in the box?", a + b
    elif difficulty == "medium":
        question, answer = f"A shelf holds {a} rows of {b} books. How many books are on the shelf?", a * b
    else:
        question = f"There are {a} bags with {b} marbles each; {c} marbles are lost. How many marbles remain?"
        answer = a * b - c
    return {
        "prompt": f"{question} Answer with a number only.",
        "target": str(answer),
        "category": "reasoning/arithmetic",
        "difficulty": difficulty,
    }


def suite_items(size: int = 30, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """The suite's items per task (deterministic in `seed`)."""
    builders = {
        "flywheel_tool_call": _tool_call_item,
        "flywheel_tool_select": _tool_select_item,
        "flywheel_reasoning": _reasoning_item,
    }
    return {
        task: [build(random.Random(f"{task}:{seed}:{i}"), i) for i in range(size)] for task, build in builders.items()
    }


def _yaml(task: str, data_file: Path) -> str:
    common = (
        f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data_file}\n"
        f"test_split: test\ndoc_to_text: '{{{{prompt}}}}'\nmetadata:\n  version: {SUITE_VERSION}\n"
    )
    if task == "flywheel_tool_select":
        return common + (
            "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{target}}'\n"
            "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        )
    scorer = "process_tool_call" if task == "flywheel_tool_call" else "process_number"
    metrics = "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    max_tokens = 64
    if task == "flywheel_tool_call":
        metrics += "  - metric: valid_call\n    aggregation: mean\n    higher_is_better: true\n"
        max_tokens = 96  # The longest typed call is ~55 tokens.
    return common + (
        "output_type: generate_until\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['<|im_end|>', '</tool_call>\\n\\n']\n"
        f"  max_gen_toks: {max_tokens}\n  do_sample: false\n"
        f"process_results: !function utils.{scorer}\nmetric_list:\n{metrics}"
    )


def write_suite(folder: Path, size: int = 30, seed: int = 0) -> Path:
    """Write the suite (YAML, JSONL, utils.py) into `folder` for lm-eval's include path."""
    folder.mkdir(parents=True, exist_ok=True)
    for task, items in suite_items(size, seed).items():
        data_file = (folder / f"{task}.jsonl").resolve()
        data_file.write_text("".join(json.dumps(item) + "\n" for item in items))
        (folder / f"{task}.yaml").write_text(_yaml(task, data_file))
    shutil.copy(Path(__file__).parent / "tasks" / "utils.py", folder / "utils.py")
    return folder


def store_suite(store: ArtifactStore, size: int = 30, seed: int = 0) -> Manifest:
    """The suite's items as an `evalset` artifact (reused when identical)."""
    files = {
        f"{task}.jsonl": "".join(json.dumps(i) + "\n" for i in items) for task, items in suite_items(size, seed).items()
    }
    params = {"suite_version": SUITE_VERSION, "size": size, "seed": seed}
    try:
        existing = store.manifest("evalset/flywheel-suite")
    except ArtifactNotFound:
        existing = None
    if existing is not None and existing.params == params:
        return existing
    return store.put("evalset", "flywheel-suite", files, params=params)
