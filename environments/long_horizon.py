"""LongHorizonEnv: 30+ step projects (package, metadata, README, tests, git commit).

Reward = committed milestones (partial credit) x efficiency of the step count.

    python environments/long_horizon.py evaluate --env.eval_size 5 --env.tokenizer_name MODEL_DIR \
        --env.data_dir_to_save_evals out/long --openai.base_url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

from typing import Any

from environments.agent_loop import AgentResult
from environments.hermes_base_env import HermesAgentEnvConfig, default_tokenizer
from environments.rewards import efficiency
from environments.task_env import TaskEnv
from environments.tasks import long_horizon_tasks as tasks
from environments.tool_context import ToolContext


class LongHorizonEnvConfig(HermesAgentEnvConfig):
    """Many turns: the oracle itself needs 30+ tool calls."""

    max_agent_turns: int = 48


class LongHorizonEnv(TaskEnv):
    name = "long_horizon"
    env_config_cls = LongHorizonEnvConfig
    make_task = tasks.make_task
    categories = tasks.CATEGORIES

    @classmethod
    def config_init(cls) -> tuple[LongHorizonEnvConfig, list[Any]]:
        config = LongHorizonEnvConfig(tokenizer_name=default_tokenizer(), group_size=2, use_wandb=False)
        return config, cls.default_server_configs()

    async def compute_reward(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> float:
        return milestone_score(item, ctx) * efficiency(result.turns_used, tasks.STEP_BUDGET)


def milestone_score(item: dict[str, Any], ctx: ToolContext) -> float:
    """Sum of the milestones that hold in a fresh checkout of HEAD."""
    answer = item["answer"]
    clean = ctx.terminal("git status --porcelain")
    tracked = ctx.terminal("git ls-tree -r --name-only HEAD")
    if clean["exit_code"] != 0 or tracked["exit_code"] != 0:
        return 0.0  # No real repository or no commit: nothing counts.
    ctx.terminal("rm -rf .verify && mkdir -p .verify/head")
    ctx.write_file(".verify/pytest.ini", "[pytest]\n")
    if ctx.terminal("git archive HEAD | tar -x -C .verify/head")["exit_code"] != 0:
        return 0.0
    score = 0.0
    for milestone, command in tasks.milestone_checks(answer).items():
        if ctx.terminal(f"cd .verify/head && {command}", timeout=60)["exit_code"] == 0:
            score += tasks.MILESTONES[milestone]
    committed = set(tracked["output"].split())
    if set(answer["required"]) <= committed and not clean["output"].strip():
        score += tasks.MILESTONES["committed"]
    return round(score, 6)


if __name__ == "__main__":
    LongHorizonEnv.cli()
