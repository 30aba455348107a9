"""The step contract (docs/architecture.md) as a user copies it: built-in envs driven by `reset`/`step`,
and a user's `BaseEnvironment` (tests/environments/seed_my_env.py) run in process and evaluate
mode through the adapter, registered by name, `module:Class` or file path."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flywheel.environments.adapter import StepEnvAdapter
from flywheel.environments.agent.servers import server_configs
from flywheel.environments.base import Action, BaseEnvironment
from flywheel.environments.registry import env_class
from flywheel.environments.tool_context import live_task_ids
from flywheel.environments.tool_use_chain import ToolUseChainEnv
from flywheel.environments.verify.scoring import RewardError
from tests.environments import seed_my_env
from tests.environments.conftest import chat_reply

SEED_ENV_FILE = Path(seed_my_env.__file__)


def test_a_built_in_env_is_a_base_environment_and_needs_no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_TOKENIZER", "/nonexistent/tokenizer")  # Loading it would fail.
    env = ToolUseChainEnv(num_tasks=100, difficulty="medium", max_steps=20)
    assert isinstance(env, BaseEnvironment)
    try:
        state = env.reset(3)
        assert state.prompt == env.stream.item(3)["prompt"] and {t["function"]["name"] for t in state.tools} >= {
            "write_file", "terminal"}  # fmt: skip
        for action in env.stream.item(3)["oracle"][:-1]:
            _, reward, done, _ = env.step(action)
            assert (reward, done) == (0.0, False)
        final = env.step(Action(text="Done: the files are written."))
        assert final.done and final.info["task_completed"]
        assert final.reward == pytest.approx(1.0 - 0.01 * final.info["turns"])  # The efficiency term.
        assert env.score(final.next_state.messages) == pytest.approx(final.reward)
        args = final.next_state.messages[2]["tool_calls"][0]["function"]["arguments"]
        assert isinstance(json.loads(args), dict)  # OpenAI format: arguments are a JSON string.
        env.reset(3)  # A fresh sandbox: the earlier work is gone.
        claim = env.step("I did it.")
        assert claim.reward == 0.0 and claim.info["task_completed"] is False
        env.reset(4)
        listed = env.step('<tool_call>{"name": "list_files", "arguments": {}}</tool_call>')
        assert not listed.done and "Error" not in listed.next_state.observation
    finally:
        env.shutdown()
    assert live_task_ids() == []


def _adder(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A model that calls `add` on the question's numbers, then answers with the tool's result."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return chat_reply(last["content"])
    a, b = map(int, re.search(r"What is (\d+) \+ (\d+)", last["content"]).groups())
    return chat_reply(f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>')


@pytest.mark.parametrize("spec", [str(SEED_ENV_FILE), "tests.environments.seed_my_env:MyEnv"])
def test_a_users_step_env_runs_in_process_and_evaluate_mode(
    spec: str, fake_openai: Any, tiny_model: Path, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    seed_my_env.write_tasks(str(tasks), n=10)
    cls = env_class(spec)
    assert issubclass(cls, StepEnvAdapter) and cls.environment_cls.__name__ == "MyEnv" and cls.name == "my_env"
    env = cls(
        tokenizer_name=str(tiny_model), env_kwargs={"task_file": str(tasks)}, group_size=2, total_steps=3,
        eval_size=2, data_path_to_save_groups=str(tmp_path / "groups.jsonl"),
        data_dir_to_save_evals=str(tmp_path / "evals"), server_configs=server_configs(fake_openai(_adder), "fake"),
    )  # fmt: skip
    env.n_groups_to_process = 3  # What the `process` CLI sets from --env.total_steps.
    asyncio.run(env.process_manager())
    groups = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert sorted(g["meta"]["item_id"] for g in groups) == ["my_env-0", "my_env-1", "my_env-2"]
    for group in groups:
        assert group["scores"] == [1.0, 1.0] and all(group["tokens"]) and any(m != -100 for m in group["masks"][0])
        tool_turn = group["messages"][0][3]
        assert tool_turn["role"] == "tool" and group["messages"][0][-1]["content"] == tool_turn["content"]

    env = cls(
        tokenizer_name=str(tiny_model), env_kwargs={"task_file": str(tasks)}, eval_size=2,
        data_dir_to_save_evals=str(tmp_path / "evals"), server_configs=server_configs(fake_openai(_adder), "f"),
    )  # fmt: skip
    asyncio.run(env._run_evaluate())
    metrics = json.loads((tmp_path / "evals" / "metrics.json").read_text())["results"]["atropos|my_env_eval|0"]
    assert metrics["eval/success_rate"] == 1.0 and metrics["eval/n"] == 2.0
    samples = [json.loads(line) for line in (tmp_path / "evals" / "samples.jsonl").read_text().splitlines()]
    assert sorted(s["item_id"] for s in samples) == ["my_env-8", "my_env-9"]  # Held out: the last tasks.
    assert live_task_ids() == []


class _Overpaid(seed_my_env.MyEnv):
    def verify(self, agent_answer: str, expected: str) -> float:
        return 2.0 if agent_answer.strip() == expected else float("nan")


def test_a_reward_outside_the_declared_range_is_counted_and_a_nan_is_an_error(
    fake_openai: Any, tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    seed_my_env.write_tasks(str(tasks), n=10)
    from flywheel.environments.adapter import adapter_class

    env = adapter_class(_Overpaid)(tokenizer_name=str(tiny_model), env_kwargs={"task_file": str(tasks)},
                                   server_configs=server_configs(fake_openai(_adder), "fake"))  # fmt: skip

    async def scenario() -> tuple[float | None, str]:
        await env.setup()
        _, reward = await env.run_agent(await env.get_next_item(), 0.0)
        env.prototype.tasks[1]["expected"] = "wrong"
        with pytest.raises(RewardError, match="nan"):
            await env.run_agent(await env.get_next_item(), 0.0)
        return reward, caplog.text

    reward, logged = asyncio.run(scenario())
    assert reward == 2.0 and env.rewards_out_of_range == 1  # Kept as given, never clipped to 1.0.
    assert "outside the declared reward_range" in logged
    assert live_task_ids() == []


def test_a_seed_env_file_gets_the_three_cli_modes(tmp_path: Path) -> None:
    """`cli(MyEnv)` at the end of a user's file: `python my_env.py process|evaluate|serve` as for built-in envs."""
    script = tmp_path / "my_env.py"
    script.write_text(SEED_ENV_FILE.read_text() + "\n\nif __name__ == '__main__':\n"
                      "    from flywheel.environments.adapter import cli\n\n    cli(MyEnv)\n")  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(script), "process", "--help"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--env.group_size" in done.stdout and "--openai.base_url" in done.stdout


SEED_IMPORTS = """
from environments.base import BaseEnvironment
from environments.agent_loop import HermesAgentLoop
from environments.tool_context import ToolContext
from environments.tool_use_chain import ToolUseChainEnv
import flywheel.environments.base as base, flywheel.environments.tool_use_chain as chain
assert BaseEnvironment is base.BaseEnvironment and ToolUseChainEnv is chain.ToolUseChainEnv
print("OK")
"""


def test_the_seeds_import_spelling_names_our_modules_in_a_checkout(tmp_path: Path) -> None:
    """Seed 004's `from environments.agent_loop import ...`, run in the checkout, loads each module once;
    elsewhere `environments` is the user's own package, never ours."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", SEED_IMPORTS], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-2000:]
    (tmp_path / "environments").mkdir()
    (tmp_path / "environments" / "__init__.py").write_text("MINE = True\n")
    code = "import flywheel.environments.registry, environments; print(environments.MINE)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "True", done.stderr[-2000:]
