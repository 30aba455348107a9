"""The agent loop and the base env: infra failures, tool errors, turn limits, eval hygiene, gym view."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flywheel.environments.agent.policies import ScriptedPolicy, batch, call, final
from flywheel.environments.agent.tools import TOOLSETS, Tool, tool
from flywheel.environments.agent_loop import HermesAgentLoop
from flywheel.environments.errors import InfraError
from flywheel.environments.tool_call_parsers import get_parser
from flywheel.environments.tool_context import ToolContext, live_task_ids, release
from flywheel.environments.tool_use_chain import ToolUseChainEnv

FILE_TOOLS = TOOLSETS["file"]


class _Failing:
    """A server that fails `failures` times, then answers with a final message."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    async def chat_completion(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("connection refused")
        return await ScriptedPolicy([final("ok")]).chat_completion(**kwargs)


def _loop(
    server: Any,
    max_turns: int = 4,
    retries: int = 1,
    tools: list[Tool] = FILE_TOOLS,
    cap: int = 8,
    repeats: int | None = 3,
) -> HermesAgentLoop:
    schemas = [t.schema() for t in tools]
    names = {t.name for t in tools}
    return HermesAgentLoop(
        server, schemas, names, max_turns, "loop-test", tools=tools, inference_retries=retries,
        max_tool_calls_per_reply=cap, max_repeated_replies=repeats,
    )  # fmt: skip


def _run(loop: HermesAgentLoop) -> Any:
    try:
        return asyncio.run(loop.run([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]))
    finally:
        release("loop-test")


def test_inference_failure_after_retries_is_an_infra_error() -> None:
    server = _Failing(failures=10)
    result = _run(_loop(server, retries=1))
    assert result.infra_error and "connection refused" in result.infra_error
    assert server.calls == 2 and result.turns_used == 0


def test_a_transient_failure_is_retried() -> None:
    result = _run(_loop(_Failing(failures=1), retries=1))
    assert result.infra_error is None and result.finished_naturally
    assert result.messages[-1] == {"role": "assistant", "content": "ok"}


def test_tool_errors_go_back_to_the_model_and_are_recorded() -> None:
    actions = [
        call("no_such_tool"),
        call("read_file", path="../../etc/passwd"),
        call("read_file"),
        call("write_file", path="a.txt", content="hi"),
        final("done"),
    ]
    result = _run(_loop(ScriptedPolicy(actions), max_turns=6))
    assert [e.tool_name for e in result.tool_errors] == ["no_such_tool", "read_file", "read_file"]
    assert "outside the workspace" in result.tool_errors[1].error
    tool_messages = [m for m in result.messages if m["role"] == "tool"]
    assert tool_messages[0]["content"].startswith("Error: unknown tool")
    assert tool_messages[-1]["content"].startswith("wrote 2 characters")
    assert result.finished_naturally and result.turns_used == 5


def test_a_batch_is_one_turn_whose_calls_run_in_order() -> None:
    """An oracle's `batch` of independent calls is one reply: one turn, every call run, in order."""
    actions = [batch(call("write_file", path="a.txt", content="1"), call("read_file", path="a.txt")), final("done")]
    result = _run(_loop(ScriptedPolicy(actions)))
    assert result.turns_used == 2 and result.finished_naturally and not result.tool_errors
    assert [m["content"] for m in result.messages if m["role"] == "tool"] == ["wrote 1 characters to a.txt", "1"]


def test_tool_calls_beyond_the_cap_are_reported_to_the_model_not_run() -> None:
    hermes = get_parser("hermes")
    three = "".join(hermes.tool_call_text("write_file", {"path": f"{i}.txt", "content": "x"}) for i in range(3))
    result = _run(_loop(ScriptedPolicy([final(three), final("done")]), cap=2))
    tool_results = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert tool_results == ["wrote 1 characters to 0.txt", "wrote 1 characters to 1.txt"]
    notice = result.messages[-2]["content"]
    assert notice == "Tool call error: only 2 tool calls per reply are run; this reply had 3, so the last 1 did not run"
    assert [e.tool_name for e in result.tool_errors] == ["<too many calls>"] and result.finished_naturally


def test_malformed_native_tool_calls_are_tool_errors() -> None:
    def native(name: Any, arguments: Any) -> SimpleNamespace:
        return SimpleNamespace(function=SimpleNamespace(name=name, arguments=arguments))

    entries = [
        native(None, "{}"),
        native("read_file", "{not json"),
        native("list_files", "[1]"),
        SimpleNamespace(),
        native("list_files", ""),
    ]

    class Native:
        async def chat_completion(self, **kwargs: Any) -> Any:
            done = any(m["role"] == "assistant" for m in kwargs["messages"])
            message = SimpleNamespace(content="done" if done else None, tool_calls=None if done else entries)
            return SimpleNamespace(choices=[SimpleNamespace(message=message)], usage=None)

    result = _run(_loop(Native()))
    assert result.infra_error is None and result.finished_naturally
    assert [e.tool_name for e in result.tool_errors] == ["<parse>"] * 4
    assert [m["name"] for m in result.messages if m["role"] == "tool"] == ["list_files"]


@tool
def broken_disk(ctx: ToolContext) -> str:
    """Fail the way a broken sandbox does."""
    raise InfraError("disk full")


def test_an_infra_error_in_a_tool_ends_the_rollout_without_raising() -> None:
    result = _run(_loop(ScriptedPolicy([call("broken_disk"), final("done")]), tools=[broken_disk]))
    assert result.infra_error == "disk full" and not result.finished_naturally and result.turns_used == 1


def test_turn_limit_cuts_the_rollout() -> None:
    result = _run(_loop(ScriptedPolicy([call("list_files")] * 10), max_turns=3, repeats=None))
    assert result.turns_used == 3 and not result.finished_naturally and not result.stuck


def test_a_loop_that_repeats_the_same_calls_and_results_stops_early() -> None:
    result = _run(_loop(ScriptedPolicy([call("list_files")] * 10), max_turns=8))
    assert result.turns_used == 3 and result.stuck and not result.finished_naturally


@tool
def tick(ctx: ToolContext) -> str:
    """Count the calls (a result that changes each time)."""
    ctx.state["ticks"] = ctx.state.get("ticks", 0) + 1
    return str(ctx.state["ticks"])


def test_repeated_calls_with_new_results_or_other_calls_in_between_go_on() -> None:
    changing = _run(_loop(ScriptedPolicy([call("tick")] * 10), max_turns=5, tools=[tick]))
    assert changing.turns_used == 5 and not changing.stuck
    listing, other = call("list_files"), call("write_file", path="a.txt", content="x")
    actions = [listing, listing, other, listing, listing, final("done")]
    interrupted = _run(_loop(ScriptedPolicy(actions), max_turns=8))
    assert interrupted.finished_naturally and not interrupted.stuck and interrupted.turns_used == 6


def test_evaluation_does_not_pollute_training_buffers(tiny_model: Path, tmp_path: Path) -> None:
    env = ToolUseChainEnv(tokenizer_name=str(tiny_model), teacher="oracle", data_dir_to_save_evals=str(tmp_path))

    async def scenario() -> dict[str, float]:
        await env.setup()
        await env.collect_trajectories(env.stream.item(0))
        before = list(env._reward_buffer)
        metrics = await env.run_agentic_eval(env.eval_items[:3])
        assert env._reward_buffer == before
        return metrics

    metrics = asyncio.run(scenario())
    assert metrics["eval/success_rate"] == 1.0 and metrics["eval/n"] == 3
    assert (tmp_path / "metrics.json").exists() and (tmp_path / "samples.jsonl").exists()
    assert live_task_ids() == []


def test_evaluation_survives_an_item_that_crashes(tiny_model: Path, tmp_path: Path) -> None:
    env = ToolUseChainEnv(tokenizer_name=str(tiny_model), teacher="oracle", data_dir_to_save_evals=str(tmp_path))

    async def scenario() -> dict[str, float]:
        await env.setup()
        items = [dict(item) for item in env.eval_items[:3]]
        items[1]["setup_commands"] = ["exit 3"]  # Not the model's fault: an infra failure, not a 0.
        return await env.run_agentic_eval(items)

    metrics = asyncio.run(scenario())
    assert metrics["eval/n"] == 3 and metrics["eval/infra_failures"] == 1 and metrics["eval/success_rate"] == 1.0
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert samples[1]["reward"] is None and "setup command failed" in samples[1]["infra_error"]
    assert live_task_ids() == []


def test_seed_style_constructor_sets_the_runner_knobs(tiny_model: Path) -> None:
    env = ToolUseChainEnv(num_tasks=100, difficulty="medium", max_steps=20, tokenizer_name=str(tiny_model))
    assert (env.config.total_steps, env.config.difficulty, env.config.max_agent_turns) == (100, "medium", 20)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ToolUseChainEnv(tool_call_parser="bogus", tokenizer_name=str(tiny_model))
