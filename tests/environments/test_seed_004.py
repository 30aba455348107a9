"""The hermes-agent contract (docs/architecture.md) as a user writes it: `compute_reward` reading OpenAI-format
messages and calling `self._llm_judge`, and the hand-written `evaluate()` on every built-in env.

A fake OpenAI server plays the model: it replays each item's oracle (found by the prompt) and
answers the judge's grading prompt with a JSON verdict.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from flywheel.environments.agent.servers import server_configs
from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.custom.file_stats_env import FileStatsEnv
from flywheel.environments.registry import ENVIRONMENTS, env_class
from flywheel.environments.tool_call_parsers import get_parser
from flywheel.environments.tool_context import ToolContext, live_task_ids
from tests.environments.conftest import chat_reply


async def seed_evaluate(self, *args, **kwargs) -> None:
    """A hand-written `evaluate()` as the hermes-agent contract (docs/architecture.md) describes it."""
    import time
    import uuid

    from flywheel.environments.agent_loop import HermesAgentLoop
    from flywheel.environments.tool_context import ToolContext

    start_time = time.time()
    tools, valid_names = self._resolve_tools_for_group()
    samples = []

    for item in self._eval_items[: self.config.eval_size]:
        task_id = str(uuid.uuid4())
        messages = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        messages.append({"role": "user", "content": self.format_prompt(item)})

        agent = HermesAgentLoop(
            server=self.server,
            tool_schemas=tools,
            valid_tool_names=valid_names,
            max_turns=self.config.max_agent_turns,
            task_id=task_id,
            temperature=0.0,  # Детерминированно для оценки
            max_tokens=self.config.max_token_length,
            extra_body=self.config.extra_body,
        )
        result = await agent.run(messages)

        ctx = ToolContext(task_id)
        try:
            reward = await self.compute_reward(item, result, ctx)
        finally:
            ctx.cleanup()

        samples.append(
            {"prompt": messages[-1]["content"], "response": result.messages[-1]["content"], "reward": reward}
        )

    eval_metrics = {"eval/mean_reward": sum(s["reward"] for s in samples) / len(samples)}
    await self.evaluate_log(metrics=eval_metrics, samples=samples, start_time=start_time, end_time=time.time())


class _OracleModel:
    """Replays the oracle of the item whose prompt opens the conversation; grades with a JSON verdict.

    Items are looked up in `env.eval_items` at request time (the env is set up by then).
    """

    def __init__(self) -> None:
        self.env: Any = None
        self.parser = get_parser("hermes")
        self.judged = 0

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if user.startswith("Grade the answer"):
            self.judged += 1
            return chat_reply('Verdict: {"score": 9, "reason": "matches the reference"}')
        step = sum(1 for m in body["messages"] if m["role"] == "assistant")
        oracle = next(i["oracle"] for i in self.env.eval_items if self.env.format_prompt(i) == user)
        action = oracle[step] if step < len(oracle) else {"final": "Done."}
        if "final" in action:
            return chat_reply(action["final"])
        calls = action.get("calls") or [action]  # A batch: several calls in one reply.
        return chat_reply(self.parser.tool_calls_text([(c["tool"], c.get("arguments", {})) for c in calls]))


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_the_seeds_evaluate_runs_on_every_built_in_env(
    name: str, fake_openai: Any, tiny_model: Path, tmp_path: Path
) -> None:
    cls = type(f"Seed{name}", (env_class(name),), {"evaluate": seed_evaluate})
    model = _OracleModel()
    model.env = cls(tokenizer_name=str(tiny_model), eval_size=1, data_dir_to_save_evals=str(tmp_path),
                    server_configs=server_configs(fake_openai(model.handle), "fake"))  # fmt: skip
    asyncio.run(model.env._run_evaluate())
    results = json.loads((tmp_path / "metrics.json").read_text())["results"]
    metrics = next(v for v in results.values() if "eval/mean_reward" in v)
    assert metrics["eval/mean_reward"] >= 0.8, name  # The task's files were there and its tools were known.
    assert live_task_ids() == []


class SeedRewardEnv(FileStatsEnv):
    async def compute_reward(self, item, result: AgentResult, ctx: ToolContext) -> float:
        """A `compute_reward` as the hermes-agent contract (docs/architecture.md) describes it."""
        # Извлечение финального ответа (последнее сообщение assistant с контентом)
        final_response = ""
        tools_used = []
        for msg in reversed(result.messages):
            if msg.get("role") == "assistant" and msg.get("content") and not final_response:
                final_response = msg["content"]
            if msg.get("role") == "assistant" and msg.get("tool_calls"):
                for tc in msg["tool_calls"]:
                    fn = tc.get("function", {}) if isinstance(tc, dict) else {}
                    name = fn.get("name", "")
                    if name:
                        tools_used.append(name)
                    json.loads(fn["arguments"])  # Messages are OpenAI format: arguments are JSON text.

        # Оценка через LLM-судью, эвристику или ToolContext
        correctness = await self._llm_judge(item, final_response)
        return correctness


def test_the_seeds_compute_reward_reads_openai_messages_and_judges_once(
    fake_openai: Any, tiny_model: Path, tmp_path: Path
) -> None:
    model = _OracleModel()
    env = model.env = SeedRewardEnv(tokenizer_name=str(tiny_model), eval_size=2, data_dir_to_save_evals=str(tmp_path),
                                    server_configs=server_configs(fake_openai(model.handle), "fake"))  # fmt: skip

    async def scenario() -> dict[str, float]:
        await env.setup()
        metrics = await env.run_agentic_eval(env.eval_items)
        item = env.eval_items[0]
        again = await env._llm_judge(item, "Done.")  # Already judged: the verdict is read, not asked again.
        return metrics | {"again": again}

    metrics = asyncio.run(scenario())
    assert metrics["eval/mean_reward"] == pytest.approx(0.9) and metrics["again"] == pytest.approx(0.9)
    assert model.judged == 2  # One judge call per item.
    assert live_task_ids() == []


def test_a_failing_judge_falls_back_to_keyword_overlap(fake_openai: Any, tiny_model: Path) -> None:
    env = FileStatsEnv(tokenizer_name=str(tiny_model),
                       server_configs=server_configs(fake_openai(lambda p, b: (500, "down")), "fake"))  # fmt: skip
    item = {"item_id": "x", "prompt": "How many lines?", "reference": "notes.txt has 12 lines"}
    assert asyncio.run(env._llm_judge(item, "It has 12 lines")) == pytest.approx(
        2 / 4
    )  # has, lines of notes/txt/has/lines


def test_without_a_model_server_the_judge_is_keyword_overlap_per_item(tiny_model: Path) -> None:
    """Under the oracle teacher a reply is graded by its overlap with the item's reference (else its answer),
    once per (item, reply): two items given the same reply never share a grade."""
    env = FileStatsEnv(tokenizer_name=str(tiny_model), teacher="oracle")
    reply = "It has 12 lines"
    assert asyncio.run(env._llm_judge({"item_id": "a", "reference": "notes.txt has 12 lines"}, reply)) == 2 / 4
    assert asyncio.run(env._llm_judge({"item_id": "b", "answer": {"lines": 7}}, reply)) == 1.0  # Its one word: lines.
    assert asyncio.run(env._llm_judge({"item_id": "c"}, "XXXX")) == 0.0  # No reference: no word to find.
