"""Reward helpers (their docstring examples run too) and real SWE-bench-format instances."""

from __future__ import annotations

import asyncio
import doctest
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from environments import rewards
from environments.policies import ScriptedPolicy, do_nothing
from environments.swe_bench import SWEBenchEnv


def test_docstring_examples_hold() -> None:
    failures, tried = doctest.testmod(rewards)
    assert tried >= 8 and failures == 0


class _Judge:
    def __init__(self, reply: str | None) -> None:
        self.reply = reply

    async def chat_completion(self, **kwargs: Any) -> Any:
        if self.reply is None:
            raise TimeoutError("judge down")
        message = SimpleNamespace(content=self.reply)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def test_the_judge_reads_a_json_verdict_and_falls_back_to_keywords() -> None:
    judge = rewards.judge_verdict
    assert asyncio.run(judge(_Judge('{"score": 7, "reason": "ok"}'), "q", "Paris", "Paris")) == 0.7
    assert asyncio.run(judge(_Judge("7"), "q", "Paris, France", "capital Paris")) == 0.5  # No JSON: keywords.
    assert asyncio.run(judge(_Judge(None), "q", "capital is Paris", "capital Paris")) == 1.0  # Judge down.


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _instance(tmp_path: Path, ids: tuple[str, ...] = ("calc-1",)) -> Path:
    """An instances file: one line per id, all of the same bug in one generated repo."""
    repo = tmp_path / "repo"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text("def add(a, b):\n    return a - b\n")
    _git(tmp_path, "init", "-q", str(repo))
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc" / "ops.py").write_text("def add(a, b):\n    return a + b\n")
    patch = _git(repo, "diff")
    _git(repo, "checkout", "-q", "--", ".")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_ops.py").write_text(
        "import sys, os\nsys.path.insert(0, os.getcwd())\nfrom calc.ops import add\n\n\ndef test_add():\n"
        "    assert add(2, 3) == 5\n"
    )
    _git(repo, "add", "-N", "tests")
    test_patch = _git(repo, "diff")
    instance = {
        "repo_path": str(repo), "base_commit": base,
        "problem_statement": "add(2, 3) returns -1", "patch": patch, "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(["tests/test_ops.py::test_add"]), "PASS_TO_PASS": "[]",
    }  # fmt: skip
    path = tmp_path / "instances.jsonl"
    path.write_text("".join(json.dumps({"instance_id": i, **instance}) + "\n" for i in ids))
    return path


def test_real_swe_bench_instances_run_with_their_oracle_patch(tiny_model: Path, tmp_path: Path) -> None:
    env = SWEBenchEnv(tokenizer_name=str(tiny_model), teacher="oracle", instances_path=str(_instance(tmp_path)))

    async def scenario() -> tuple[float | None, float | None]:
        await env.setup()
        item = env.eval_items[0]  # One instance: it is held out for evaluation.
        _, solved = await env.run_agent(item, 0.0)
        env.oracle_policy = lambda item: ScriptedPolicy(do_nothing())  # type: ignore[method-assign]
        _, unsolved = await env.run_agent(item, 0.0)
        return solved, unsolved

    assert asyncio.run(scenario()) == (1.0, 0.0)


def test_swe_instances_held_out_for_evaluation_are_never_trained_on(tiny_model: Path, tmp_path: Path) -> None:
    ids = tuple(f"calc-{n}" for n in range(12))
    forward, backward = _instance(tmp_path / "a", ids), _instance(tmp_path / "b", ids[::-1])

    def split(path: Path, eval_size: int) -> tuple[list[str], list[str]]:
        env = SWEBenchEnv(tokenizer_name=str(tiny_model), instances_path=str(path), eval_size=eval_size)

        async def scenario() -> tuple[list[str], list[str]]:
            await env.setup()
            held_out = [item["item_id"] for item in env.eval_items]
            trained = [(await env.get_next_item())["item_id"] for _ in range(3 * len(ids))]
            return held_out, trained

        return asyncio.run(scenario())

    held_out, trained = split(forward, 4)
    assert len(held_out) == 4 and not set(held_out) & set(trained)
    assert set(held_out) | set(trained) == set(ids)
    assert sorted(split(backward, 4)[0]) == sorted(held_out)  # The file's order does not choose them.

    env = SWEBenchEnv(tokenizer_name=str(tiny_model), instances_path=str(forward), eval_size=len(ids))
    asyncio.run(env.setup())
    with pytest.raises(ValueError, match="eval_size"):  # Nothing left to train on: say so, never reuse eval.
        asyncio.run(env.get_next_item())
