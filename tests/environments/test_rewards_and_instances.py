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

from flywheel.environments.agent.policies import ScriptedPolicy, call, do_nothing, final
from flywheel.environments.agent_loop import AgentResult, ToolError
from flywheel.environments.swe_bench import (
    SWEBenchEnv,
    _is_test,
    hidden_test_files,
    load_instances,
    restore_test_files,
)
from flywheel.environments.verify import rewards
from flywheel.environments.verify.scoring import RewardError, RolloutScoring


def test_docstring_examples_hold() -> None:
    failures, tried = doctest.testmod(rewards)
    assert tried >= 8 and failures == 0


class _Judge:
    def __init__(self, reply: str | None, delay: float = 0.0) -> None:
        self.reply, self.delay = reply, delay
        self.requests: list[dict[str, Any]] = []

    async def chat_completion(self, **kwargs: Any) -> Any:
        self.requests.append(kwargs)
        await asyncio.sleep(self.delay)
        if self.reply is None:
            raise TimeoutError("judge down")
        message = SimpleNamespace(content=self.reply)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def test_the_judge_reads_a_json_verdict_and_falls_back_to_keywords() -> None:
    judge = rewards.judge_verdict
    assert asyncio.run(judge(_Judge('{"score": 7, "reason": "ok"}'), "q", "Paris", "Paris")) == 0.7
    assert asyncio.run(judge(_Judge("7"), "q", "Paris, France", "capital Paris")) == 0.5  # No JSON: keywords.
    assert asyncio.run(judge(_Judge(None), "q", "capital is Paris", "capital Paris")) == 1.0  # Judge down.


def test_the_judge_is_asked_once_greedily_for_a_short_json_verdict() -> None:
    judge = _Judge('{"score": 10}')
    assert asyncio.run(rewards.judge_verdict(judge, "What is the capital?", "Paris", "Paris")) == 1.0
    [request] = judge.requests
    assert {key: request[key] for key in ("temperature", "max_tokens", "n")} == {
        "temperature": 0.0,
        "max_tokens": 96,
        "n": 1,
    }
    system, user = request["messages"]
    assert system == {"role": "system", "content": "You are a strict grader."}
    assert user["role"] == "user" and user["content"] == (
        "Grade the answer against the reference. Reply with a JSON object only: "
        '{"score": <integer 0-10>, "reason": "<one sentence>"}.\n'
        "Question: What is the capital?\nReference: Paris\nAnswer: Paris"
    )


def test_a_slow_judge_is_given_up_for_keywords(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rewards, "JUDGE_TIMEOUT_S", 0.05)
    slow = _Judge('{"score": 0}', delay=2.0)  # It would say 0, but too late.
    assert asyncio.run(rewards.judge_verdict(slow, "q", "capital Paris", "capital Paris")) == 1.0
    assert rewards.keyword_overlap("anything at all", "a b") == 0.0  # No reference word to find: nothing found.


def test_rewards_weigh_their_signals_to_six_decimals() -> None:
    assert rewards.multi_signal_reward(1.0, 0.0, 1.0) == 0.8  # No tool used: that part is 0, not an error.
    assert rewards.multi_signal_reward(1 / 3, 1 / 3, 1 / 3) == 0.333333


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ('{"score": 3} and later {"score": 9}', 0.3),  # The first verdict counts.
        ('Thinking {not json}, {{"score": 8}', 0.8),  # Braces that open no JSON object are skipped.
        ('{"score": 15}', 1.0),
        ('{"score": -3}', 0.0),
        ('{"reason": "no score"}', None),
        ('{"score": "7"}', None),
        ('{"score": true}', None),
        ("no verdict at all", None),
    ],
)
def test_a_verdict_is_the_first_json_objects_numeric_score(reply: str, score: float | None) -> None:
    assert rewards.parse_verdict(reply) == score


def test_the_final_answer_is_the_last_assistant_text() -> None:
    assert rewards.final_answer([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "x"}]) == "a"
    assert rewards.final_answer([{"role": "user", "content": "task"}, {"role": "assistant", "content": ""}]) == ""


def test_a_call_without_a_function_has_no_name() -> None:
    messages = [{"role": "assistant", "tool_calls": [{"id": "c1"}, {"function": {}}, {"function": {"name": "ls"}}]}]
    assert rewards.tools_used(messages) == ["", "", "ls"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _instance(tmp_path: Path, ids: tuple[str, ...] = ("calc-1",), test_patch: str | None = None) -> Path:
    """An instances file: one line per id, all of the same bug in one generated repo. The base has a
    passing test of `sub`; the hidden tests add one of `add` to the same file."""
    repo = tmp_path / "repo"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text("def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n")
    (repo / "tests" / "test_ops.py").write_text(TESTS_AT_BASE)
    _git(tmp_path, "init", "-q", str(repo))
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc" / "ops.py").write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n")
    patch = _git(repo, "diff")
    _git(repo, "checkout", "-q", "--", ".")
    (repo / "tests" / "test_ops.py").write_text(TESTS_AT_BASE + "\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    instance = {
        "repo_path": str(repo), "base_commit": base,
        "problem_statement": "add(2, 3) returns -1", "patch": patch, "test_patch": test_patch or _git(repo, "diff"),
        "FAIL_TO_PASS": json.dumps(["tests/test_ops.py::test_add"]), "PASS_TO_PASS": '["tests/test_ops.py::test_sub"]',
    }  # fmt: skip
    _git(repo, "checkout", "-q", "--", ".")
    path = tmp_path / "instances.jsonl"
    path.write_text("".join(json.dumps({"instance_id": i, **instance}) + "\n" for i in ids))
    return path


TESTS_AT_BASE = "from calc.ops import add, sub\n\n\ndef test_sub():\n    assert sub(3, 2) == 1\n"
STUB_PYTEST = "import sys\nsys.modules['_pytest.python'].Function.runtest = lambda self: None\n"
STUB_TESTS_FOLDER = (  # Only the tests under tests/: a canary elsewhere would still fail as it must.
    "import sys\n_function = sys.modules['_pytest.python'].Function\n_run = _function.runtest\n"
    "_function.runtest = lambda self: None if '/tests/' in str(self.path) else _run(self)\n"
)


def _instance_reward(tiny_model: Path, instances: Path, policy: list[dict[str, Any]] | None = None) -> float | None:
    """The held-out instance's reward for the oracle, or for `policy` when given."""
    env = SWEBenchEnv(tokenizer_name=str(tiny_model), teacher="oracle", instances_path=str(instances))
    if policy is not None:
        env.oracle_policy = lambda item: ScriptedPolicy(policy)  # type: ignore[method-assign]

    async def scenario() -> float | None:
        await env.setup()
        return (await env.run_agent(env.eval_items[0], 0.0))[1]  # One instance: it is held out.

    return asyncio.run(scenario())


def test_real_swe_bench_instances_run_with_their_oracle_patch(tiny_model: Path, tmp_path: Path) -> None:
    instances = _instance(tmp_path)
    assert _instance_reward(tiny_model, instances) == 1.0
    assert _instance_reward(tiny_model, instances, do_nothing()) == 0.0


@pytest.mark.parametrize(
    "attack",
    [
        # Module code above the test the hidden patch adds: the patch still applies around it.
        [call("write_file", path="tests/test_ops.py", content=STUB_PYTEST + TESTS_AT_BASE)],
        # The package stubs pytest in any test process that imports it.
        [call("write_file", path="calc/__init__.py", content=STUB_PYTEST)],
        # ... only for the hidden tests' folder (the red team's forgery): the canary lives beside them.
        [call("write_file", path="calc/__init__.py", content=STUB_TESTS_FOLDER)],
        # The named test's file swapped for a folder, so writing the hidden tests fails.
        [call("terminal", command="rm tests/test_ops.py && mkdir tests/test_ops.py")],
    ],
    ids=["stub_in_a_test_file", "stub_in_the_package", "stub_for_the_tests_folder", "test_file_made_a_folder"],
)
def test_real_swe_instances_judge_the_hidden_tests_not_the_agents_edits(
    tiny_model: Path, tmp_path: Path, attack: list[dict[str, Any]]
) -> None:
    assert _instance_reward(tiny_model, _instance(tmp_path), [*attack, final("Fixed.")]) == 0.0


def test_a_real_instance_whose_test_patch_does_not_apply_is_refused_with_gits_reason(tmp_path: Path) -> None:
    bad = "--- a/tests/test_ops.py\n+++ b/tests/test_ops.py\n@@ -1,1 +1,1 @@\n-no such line\n+x\n"
    with pytest.raises(ValueError, match=r"instances.jsonl:1: not a usable SWE-bench instance \(git apply failed"):
        load_instances(_instance(tmp_path, test_patch=bad))


def test_hidden_test_files_are_the_patched_files_and_the_named_tests_at_the_base() -> None:
    files = {"t/test_a.py": "def test_a():\n    pass\n", "t/test_b.py": "B\n", "t/test_c.py": "C\n", "m.py": "M\n"}
    patch = (
        "--- a/t/test_a.py\n+++ b/t/test_a.py\n@@ -1,2 +1,2 @@\n def test_a():\n-    pass\n+    assert 1\n"
        "--- a/t/test_c.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-C\n"
        "--- /dev/null\n+++ b/t/test_new.py\n@@ -0,0 +1 @@\n+N\n"
    )
    hidden = hidden_test_files(files, patch, ["t/test_a.py::test_a", "t/test_b.py::test_b", "t/gone.py::test_x"])
    assert hidden == {
        "t/test_a.py": "def test_a():\n    assert 1\n",
        "t/test_b.py": "B\n",
        "t/test_c.py": None,
        "t/test_new.py": "N\n",
    }


def test_hidden_test_files_take_nested_folders_odd_names_and_class_tests() -> None:
    """Folders the patch needs that are not there yet, a file name with a tab (`--numstat -z` keeps it
    whole), and a named test inside a class (its file is what comes before the first `::`)."""
    files = {"t/unit/deep/test_a.py": "A\n", "t/test\tx.py": "A\n", "t/test_c.py": "C\n"}
    patch = (
        "--- a/t/unit/deep/test_a.py\n+++ b/t/unit/deep/test_a.py\n@@ -1 +1 @@\n-A\n+B\n"
        '--- "a/t/test\\tx.py"\n+++ "b/t/test\\tx.py"\n@@ -1 +1 @@\n-A\n+B\n'
    )
    hidden = hidden_test_files(files, patch, ["t/test_c.py::TestC::test_c"])
    assert hidden == {"t/test_c.py": "C\n", "t/unit/deep/test_a.py": "B\n", "t/test\tx.py": "B\n"}


class _RecordingContext:
    """What `restore_test_files` asks of a sandbox: the files it writes and the commands it runs."""

    def __init__(self) -> None:
        self.written: dict[str, str] = {}
        self.commands: list[str] = []

    def write_file(self, path: str, content: str) -> None:
        self.written[path] = content

    def terminal(self, command: str, **_: Any) -> dict[str, Any]:
        self.commands.append(command)
        return {"exit_code": 0, "output": ""}


def test_the_hidden_tests_are_written_over_the_agents_and_deleted_files_removed() -> None:
    ctx = _RecordingContext()
    assert restore_test_files(ctx, {"t/test_a.py": "A\n", "t/old test.py": None})  # type: ignore[arg-type]
    assert ctx.written == {"t/test_a.py": "A\n"} and ctx.commands == ["rm -rf -- 't/old test.py'"]


@pytest.mark.parametrize(
    ("path", "is_test"),
    [("t/test_a.py", True), ("t/a_test.py", True), ("t/helpers.py", False), ("t/test_a.txt", False)],
)
def test_a_canary_goes_into_each_hidden_test_module_only(path: str, is_test: bool) -> None:
    """pytest's own naming (`test_*.py`, `*_test.py`): a helper module the patch touches gets no canary."""
    assert _is_test(path) is is_test


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


class _Scored(RolloutScoring):
    """The scoring mixin alone: a verifier that raises on the agent's output, and a chosen reward."""

    name, key_decisions, reward_range = "scored", ("read_file", "write_file", "search"), (0.0, 1.0)

    def __init__(self, reward: float) -> None:
        self.reward = reward

    async def verify(self, item: dict[str, Any], result: AgentResult, ctx: Any) -> bool:
        raise ValueError("the agent's file broke me")

    async def compute_reward(self, item: dict[str, Any], result: AgentResult, ctx: Any) -> float:
        return self.reward


def _tool_turn(name: str) -> dict[str, Any]:
    return {"role": "assistant", "tool_calls": [{"function": {"name": name, "arguments": "{}"}}]}


def test_key_decisions_count_each_tool_once_it_ran_without_an_error() -> None:
    """Turns are the assistant messages (tool results between them are none): write_file failed at turn 0,
    read_file ran at turn 1, so one of the three decisions was made."""
    messages = [{"role": "user", "content": "go"}, _tool_turn("write_file"), {"role": "tool", "content": "error"}]
    messages += [_tool_turn("read_file"), {"role": "tool", "content": "ok"}]
    result = AgentResult(messages=messages, tool_errors=[ToolError(0, "write_file", {}, "denied")])
    assert _Scored(1.0).key_decisions_made({}, result) == pytest.approx(1 / 3)
    messages += [_tool_turn("write_file")]  # Turn 2: now it ran.
    assert _Scored(1.0).key_decisions_made({}, result) == pytest.approx(2 / 3)


def test_each_verifier_error_is_a_failed_task_counted_once() -> None:
    env = _Scored(0.5)
    for _ in range(2):
        result = AgentResult(messages=[])
        assert asyncio.run(env.score_rollout({"item_id": "a"}, result, None)) == 0.5
        assert result.task_completed is False and result.verify_error == "ValueError: the agent's file broke me"
    assert env.verifier_errors == 2
    with pytest.raises(RewardError, match=r"^scored: compute_reward returned nan for item a$"):
        asyncio.run(_Scored(float("nan")).score_rollout({"item_id": "a"}, AgentResult(messages=[]), None))
