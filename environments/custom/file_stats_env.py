"""Example custom environment (a template to copy): count the lines of a generated file.
    python environments/custom/file_stats_env.py process --env.total_steps 4 --env.group_size 2 \
        --env.tokenizer_name MODEL_DIR --openai.base_url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from pydantic import Field

from flywheel.environments.agent.policies import call, final
from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.hermes_base_env import HermesAgentEnvConfig
from flywheel.environments.task_env import TaskEnv
from flywheel.environments.tool_context import ToolContext
from flywheel.environments.verify.rewards import final_answer


def make_task(rng: random.Random, category: str, difficulty: str) -> dict[str, Any]:
    lines = rng.randint(3, {"easy": 10, "medium": 50, "hard": 200}[difficulty])
    words = ("alpha", "beta", "gamma", "delta")
    text = "".join(f"{rng.choice(words)} {i}\n" for i in range(lines))
    return {
        "prompt": "How many lines does notes.txt have? Write just the number to answer.txt.",
        "files": {"notes.txt": text},
        "answer": {"lines": lines},
        "reference": f"notes.txt has {lines} lines",
        "oracle": [
            call("terminal", command="wc -l notes.txt"),
            call("write_file", path="answer.txt", content=str(lines)),
            final("Done."),
        ],
    }


class FileStatsEnvConfig(HermesAgentEnvConfig):
    max_agent_turns: int = Field(default=6, description="Three tool calls are enough.")


class FileStatsEnv(TaskEnv):
    name = "file_stats"
    make_task = make_task
    categories = ("line_count",)
    env_config_cls = FileStatsEnvConfig
    config_defaults: ClassVar[dict[str, Any]] = {"group_size": 2}  # Fields of the base config.

    async def verify(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> bool:
        try:  # Verify the file, never the model's claim.
            return int(ctx.read_file("answer.txt").strip()) == item["answer"]["lines"]
        except (OSError, ValueError):
            return False

    async def compute_reward(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> float:
        """Multi-signal: the verified file earns 0.8, a judged final reply the rest.

        The judge only adds to a verified task, so talking well can never stand in for the work.
        """
        if not await self.completed(item, result, ctx):
            return 0.0
        reply = final_answer(result.messages)
        return 0.8 + 0.2 * await self._llm_judge(item, reply) if reply else 0.8

    async def wandb_log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        await super().wandb_log(wandb_metrics)  # Add env-specific metrics here, then call super.


if __name__ == "__main__":
    FileStatsEnv.cli()
