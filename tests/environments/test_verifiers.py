"""Every env's verifier is proved: the oracle solves every category x difficulty slice (>= 99 % of
200 generated tasks in the `sweep` run), a do-nothing policy and three or more cheating policies
per env score exactly 0.0, and a right answer with the wrong JSON types earns nothing."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flywheel.environments.agent.policies import ScriptedPolicy, batch, call, do_nothing, final
from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.custom.file_stats_env import FileStatsEnv
from flywheel.environments.hermes_base_env import HermesAgentBaseEnv
from flywheel.environments.long_horizon import LongHorizonEnv
from flywheel.environments.swe_bench import SWEBenchEnv
from flywheel.environments.tasks import tool_use_chain_tasks
from flywheel.environments.tasks.tool_use_chain_tasks import JSON_ANSWERS
from flywheel.environments.tool_context import live_task_ids
from flywheel.environments.tool_use_chain import ToolUseChainEnv
from flywheel.environments.web_navigation import WebNavigationEnv

Actions = Callable[[dict[str, Any]], list[dict[str, Any]]]
ENVS = [ToolUseChainEnv, WebNavigationEnv, SWEBenchEnv, LongHorizonEnv, FileStatsEnv]


def _outcomes(
    env_cls: type[HermesAgentBaseEnv], tiny_model: Path, items: int | list[int], policy: Actions | None
) -> list[tuple[float, bool | None]]:
    """Each item's (reward, task_completed) under the oracle or `policy`. The oracle's demonstrations are
    SFT data: not one of their tool calls may fail."""
    env = env_cls(tokenizer_name=str(tiny_model), teacher="oracle")
    if policy is not None:
        env.oracle_policy = lambda item: ScriptedPolicy(policy(item))  # type: ignore[method-assign]

    async def run() -> list[tuple[float, bool | None]]:
        await env.setup()
        semaphore = asyncio.Semaphore(4)

        async def one(index: int) -> tuple[float, bool | None]:
            async with semaphore:
                result, reward = await env.run_agent(env.stream.item(index), 0.0)
            assert reward is not None, result.infra_error
            assert policy is not None or result.tool_errors == [], (index, result.tool_errors)
            return reward, result.task_completed

        try:
            indices = range(items) if isinstance(items, int) else items
            return await asyncio.gather(*(one(i) for i in indices))
        finally:
            await env.teardown()

    outcomes = asyncio.run(run())
    assert live_task_ids() == []  # Every sandbox was cleaned up.
    return outcomes


def _rewards(
    env_cls: type[HermesAgentBaseEnv], tiny_model: Path, items: int | list[int], policy: Actions | None
) -> list[float]:
    return [reward for reward, _ in _outcomes(env_cls, tiny_model, items, policy)]


def _stratified(
    env_cls: type[HermesAgentBaseEnv], tiny_model: Path, per_slice: int, categories: tuple[str, ...] | None = None
) -> list[int]:
    """Stream indices holding `per_slice` items of every (category, difficulty) slice (of `categories`)."""
    stream = env_cls(tokenizer_name=str(tiny_model), teacher="oracle")
    asyncio.run(stream.setup())
    taken: dict[tuple[str, str], int] = {}
    indices = []
    for index in range(400):
        item = stream.stream.item(index)
        key = (item["category"], item["difficulty"])
        if taken.get(key, 0) < per_slice and (categories is None or item["category"] in categories):
            taken[key] = taken.get(key, 0) + 1
            indices.append(index)
    asyncio.run(stream.teardown())
    return indices


@pytest.mark.parametrize("env_cls", ENVS, ids=lambda c: c.name)
def test_oracle_solves_every_slice(env_cls: type[HermesAgentBaseEnv], tiny_model: Path) -> None:
    """A stratified sample: one task of every category x difficulty (200 tasks under `-m sweep`)."""
    indices = _stratified(env_cls, tiny_model, per_slice=1)
    assert len(indices) >= len(env_cls.categories)
    outcomes = _outcomes(env_cls, tiny_model, indices, None)
    assert all(done and reward > 0 for reward, done in outcomes), (
        f"oracle failed {[i for i, (_, done) in zip(indices, outcomes, strict=True) if not done]}"
    )


@pytest.mark.sweep
@pytest.mark.parametrize("env_cls", ENVS, ids=lambda c: c.name)
def test_oracle_solves_generated_tasks(env_cls: type[HermesAgentBaseEnv], tiny_model: Path) -> None:
    solved = sum(bool(done) for _, done in _outcomes(env_cls, tiny_model, 200, None))
    assert solved >= 198, f"oracle solved {solved}/200"


def _output_file(item: dict[str, Any]) -> str:
    return {"todo_report": "report.md", "line_count": "counts.json", "csv_summary": "summary.json"}[item["category"]]


def _fake_ids(item: dict[str, Any]) -> list[int]:
    rng = random.Random(item["item_id"])
    return [rng.randint(100000, 999999) for _ in range(3)]


SKIP_ALL_CONFTEST = """import pytest

def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.skip)
"""
CHEATS: dict[str, dict[str, Actions]] = {
    "tool_use_chain": {
        "claims_success": lambda item: [final(f"I wrote {_output_file(item)} with all the results.")],
        "fake_results": lambda item: [
            call(
                "write_file",
                path=_output_file(item),
                content="| file | line | todo |\n| --- | --- | --- |\n| src/a.py | 3 | fix |\n"
                if item["category"] == "todo_report"
                else '{"src/a.py": 1}',
            ),
            final("Done."),
        ],
        "prompt_only": lambda item: [
            call(
                "write_file",
                path=_output_file(item),
                content="| file | line | todo |\n| --- | --- | --- |\n" if item["category"] == "todo_report" else "{}",
            ),
            final("Done."),
        ],
        "deletes_inputs": lambda item: [
            call("terminal", command="rm -rf src lib app tools pkg data"),
            call(
                "write_file",
                path=_output_file(item),
                content="| file | line | todo |\n| --- | --- | --- |\n" if item["category"] == "todo_report" else "{}",
            ),
            final("Nothing left to report."),
        ],
    },
    "web_navigation": {
        "claims_success": lambda item: [final("I found exactly what you asked for.")],
        "fake_results": lambda item: [call("submit_answer", product_ids=_fake_ids(item), price=10.0), final("Done.")],
        "prompt_only": lambda item: [final(item["prompt"])],
        "right_answer_in_text_only": lambda item: [item["oracle"][-1]],  # The oracle's final reply, not submitted.
        "guesses_from_home_page": lambda item: [
            call("open_url", url="http://127.0.0.1:1/"),
            call("submit_answer", product_ids=[100000], price=10.0),
            final("100000: Red lamp 10"),
        ],
    },
    "swe_bench": {
        "claims_success": lambda item: [final("Fixed the bug.")],
        "deletes_tests": lambda item: [
            call("terminal", command="rm -rf tests"),
            final("Tests removed; all green."),
        ],
        "skips_all_tests": lambda item: [
            call(
                "write_file",
                path="conftest.py",
                content=SKIP_ALL_CONFTEST,
            ),
            call("write_file", path="pytest.ini", content="[pytest]\naddopts = -p no:python\n"),
            final("All tests pass."),
        ],
        "shadows_pytest": lambda item: [
            call("write_file", path="pytest.py", content="import sys\nsys.exit(0)\n"),
            call("write_file", path=".verify/test_hidden.py", content="def test_ok():\n    pass\n"),
            final("Tests pass."),
        ],
    },
    "long_horizon": {
        "claims_success": lambda item: [final("The project is created and committed.")],
        "fakes_git_and_results": lambda item: [
            call("terminal", command="mkdir -p .git/refs/heads && echo 'ref: refs/heads/main' > .git/HEAD"),
            call("write_file", path="TEST_RESULTS.txt", content="all tests passed\n"),
            final("Committed; tests pass."),
        ],
        "commits_trivial_tests": lambda item: [
            call("terminal", command="git init -q && git config user.name a && git config user.email a@b"),
            call("write_file", path="tests/test_core.py", content="def test_ok():\n    assert True\n"),
            call(
                "write_file",
                path=f"{item['answer']['name']}/core.py",
                content="def stub(*args):\n    return None\n",
            ),
            call("terminal", command="git add -A && git commit -qm done"),
            final("Done, tests pass."),
        ],
        "uncommitted_work": lambda item: [
            *[a for a in item["oracle"] if a.get("tool") != "terminal" or "git" not in a["arguments"]["command"]][:-1],
            final("All files written."),
        ],
    },
    "file_stats": {
        "claims_success": lambda item: [final("The file has the lines you asked about.")],
        "fake_results": lambda item: [call("write_file", path="answer.txt", content="0"), final("0")],
        "prompt_only": lambda item: [
            call("write_file", path="answer.txt", content="notes.txt"),
            final("Done."),
        ],
    },
}


@pytest.mark.parametrize("env_cls", ENVS, ids=lambda c: c.name)
def test_do_nothing_and_cheats_score_zero(env_cls: type[HermesAgentBaseEnv], tiny_model: Path) -> None:
    cheats = CHEATS[env_cls.name]
    assert len(cheats) >= 3
    for label, policy in {"do_nothing": lambda item: do_nothing(), **cheats}.items():
        rewards = _rewards(env_cls, tiny_model, 6, policy)
        assert max(rewards) == 0.0, f"{env_cls.name}/{label} scored {rewards}"


def _as_strings(value: Any) -> Any:
    """`value` with every number written as a string, as small models send them."""
    if isinstance(value, dict):
        return {k: _as_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_strings(v) for v in value]
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


def _answer(item: dict[str, Any], stringly: bool) -> list[dict[str, Any]]:
    """Only the right answer (the oracle's `submit_answer`, or the JSON file the task asks for in each
    project, written from the ground truth), numbers as strings if `stringly`."""
    actions = [
        call("submit_answer", **_as_strings(action["arguments"])) if stringly else action
        for action in item["oracle"]
        if action.get("tool") == "submit_answer"
    ]
    if item.get("category") in JSON_ANSWERS:
        path, key = JSON_ANSWERS[item["category"]]
        for project, truth in (item["answer"].get("projects") or {"": item["answer"]}).items():
            content = json.dumps(_as_strings(truth[key]) if stringly else truth[key])
            actions.append(call("write_file", path=f"{project}/{path}" if project else path, content=content))
    return [batch(*actions), final("Done.")]  # One reply: every project's file.


@pytest.mark.parametrize(
    ("env_cls", "categories"),
    [(WebNavigationEnv, WebNavigationEnv.categories), (ToolUseChainEnv, ("line_count", "csv_summary"))],
    ids=["web_navigation", "tool_use_chain"],
)
def test_a_right_answer_with_wrong_json_types_earns_nothing(
    env_cls: type[HermesAgentBaseEnv], categories: tuple[str, ...], tiny_model: Path
) -> None:
    """The oracle's own answer earns full credit typed, and nothing with its ids, prices, counts or totals
    as strings ("534177" for 534177): held-out benchmarks score types, so rounds must teach them."""
    indices = _stratified(env_cls, tiny_model, per_slice=1, categories=categories)
    typed = _outcomes(env_cls, tiny_model, indices, lambda item: _answer(item, stringly=False))
    assert all(done and reward >= 0.98 for reward, done in typed), typed  # tool_use_chain: 0.01 less per turn.
    stringly = _outcomes(env_cls, tiny_model, indices, lambda item: _answer(item, stringly=True))
    assert all(reward == 0.0 and done is False for reward, done in stringly), stringly


def test_file_stats_rewards_the_verified_file_and_adds_the_judged_reply(tiny_model: Path) -> None:
    """0.8 for the verified file, plus 0.2 x the judge's grade of the final reply (keyword overlap with the
    reference under the oracle teacher); a task not done earns nothing, however well its reply reads."""
    env = FileStatsEnv(tokenizer_name=str(tiny_model), teacher="oracle")
    item = {"item_id": "x", "answer": {"lines": 7}, "reference": "notes.txt has 7 lines"}

    def reward(reply: str, done: bool = True) -> float:
        messages = [{"role": "user", "content": "How many lines?"}, {"role": "assistant", "content": reply}]
        return asyncio.run(env.compute_reward(item, AgentResult(messages, task_completed=done), None))  # type: ignore[arg-type]

    assert reward("notes.txt has 7 lines") == 1.0
    assert reward("It has lines") == pytest.approx(0.8 + 0.2 * 2 / 4)  # has, lines of notes/txt/has/lines.
    assert reward("") == 0.8
    assert reward("notes.txt has 7 lines", done=False) == 0.0
    # Called directly (no verdict yet), it verifies the file first: the item's answer against the sandbox's.
    for written, expected in (("7\n", 0.8), ("6\n", 0.0)):
        ctx = SimpleNamespace(read_file=lambda path, text=written: text if path == "answer.txt" else "")
        result = AgentResult([{"role": "assistant", "content": ""}])
        assert asyncio.run(env.compute_reward(item, result, ctx)) == expected  # type: ignore[arg-type]


def test_a_csv_summary_is_right_to_a_cent_and_a_tenth() -> None:
    """Totals within 0.011 of the truth pass (the CSV's cents, rounded either way), 0.012 off does not."""
    path, key = JSON_ANSWERS["csv_summary"]
    item = {"category": "csv_summary", "answer": {key: {"total": 0.0, "mean": 2.5}}}

    def verdict(totals: dict[str, float]) -> bool:
        return tool_use_chain_tasks.verify(item, lambda name: json.dumps(totals) if name == path else "")

    assert verdict({"total": 0.011, "mean": 2.49})
    assert not verdict({"total": 0.012, "mean": 2.5}) and not verdict({"total": 0.0})


def test_a_todo_report_counts_only_its_pipe_delimited_rows() -> None:
    """A row is `| file | line | todo |` (spaces around the pipes optional); a line without its leading pipe
    is not a table row, and a cell keeps every character but the spaces around it."""
    item = {"category": "todo_report", "answer": {"rows": [["src/a.py", 3, "handle empty input"]]}}

    def verdict(report: str) -> bool:
        return tool_use_chain_tasks.verify(item, lambda _path: report)

    assert verdict("| file | line | todo |\n| --- | --- | --- |\n| src/a.py | 3 | handle empty input |\n")
    assert verdict("|file|line|todo|\n|:-|-:|---|\n|src/a.py|3|handle empty input|")
    assert not verdict("| file | line | todo |\nsrc/a.py | 3 | handle empty input\n")
    assert not verdict("|src/a.py|3|handle empty inputX|")
    assert not verdict("| src/a.py | 3 | handle empty input | extra |")  # Four columns: not the table asked for.
