"""LongHorizonEnv: 30+ step projects (package, metadata, README, tests, git commit).

Reward = committed milestones (partial credit) x efficiency of the step count.

    python environments/long_horizon.py evaluate --env.eval_size 5 --env.tokenizer_name MODEL_DIR \
        --env.data_dir_to_save_evals out/long --openai.base_url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

from typing import Any, ClassVar

from environments.agent_loop import AgentResult
from environments.errors import AgentError
from environments.hermes_base_env import HermesAgentEnvConfig
from environments.rewards import efficiency
from environments.task_env import TaskEnv
from environments.tasks import long_horizon_tasks as tasks
from environments.tool_context import ToolContext
from environments.verify_tests import fresh_verify_dir, run_pytest


class LongHorizonEnvConfig(HermesAgentEnvConfig):
    """Many turns: the oracle itself needs 30+ tool calls."""

    max_agent_turns: int = 48


class LongHorizonEnv(TaskEnv):
    name = "long_horizon"
    env_config_cls = LongHorizonEnvConfig
    config_defaults: ClassVar[dict[str, Any]] = {"group_size": 2}
    make_task = tasks.make_task
    categories = tasks.CATEGORIES

    reward_range = (0.0, 1.0)

    async def verify(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> bool:
        """Every milestone holds (the score is kept for `compute_reward`: partial credit)."""
        ctx.state["milestones"] = milestone_score(item, ctx)
        return ctx.state["milestones"] >= 1.0

    async def compute_reward(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> float:
        await self.completed(item, result, ctx)  # Runs `verify` (and so the milestones) if nobody has.
        return ctx.state["milestones"] * efficiency(result.turns_used, tasks.STEP_BUDGET)


def milestone_score(item: dict[str, Any], ctx: ToolContext) -> float:
    """Sum of the milestones that hold in a fresh checkout of HEAD, judged by files and junit reports.

    Runs after the agent's processes are dead. Git runs with the repo's fsmonitor and hooks
    switched off, so the agent's `.git/config` cannot run code that fakes its output.
    """
    answer = item["answer"]
    git = "git -c core.fsmonitor=false -c core.hooksPath=/dev/null"
    clean = ctx.terminal(f"{git} status --porcelain")
    tracked = ctx.terminal(f"{git} ls-tree -r --name-only HEAD")
    if clean["exit_code"] != 0 or tracked["exit_code"] != 0:
        return 0.0  # No real repository or no commit: nothing counts.
    fresh_verify_dir(ctx)
    if ctx.terminal(f"mkdir -p .verify/head && {git} archive HEAD | tar -x -C .verify/head")["exit_code"] != 0:
        return 0.0
    checks = {
        "pyproject": lambda: tasks.pyproject_ok(_read(ctx, ".verify/head/pyproject.toml"), answer),
        "readme": lambda: tasks.readme_ok(_read(ctx, ".verify/head/README.md"), answer),
        "function": lambda: _hidden_function_tests(ctx, answer),
        "tests": lambda: (
            answer["function"] in _read(ctx, ".verify/head/tests/test_core.py")
            and run_pytest(ctx, "tests", cwd=".verify/head", timeout=60).all_passed()
        ),
    }
    score = sum(tasks.MILESTONES[name] for name, check in checks.items() if check())
    committed = set(tracked["output"].split())
    if set(answer["required"]) <= committed and not clean["output"].strip():
        score += tasks.MILESTONES["committed"]
    return round(score, 6)


def _hidden_function_tests(ctx: ToolContext, answer: dict[str, Any]) -> bool:
    ctx.write_file(".verify/test_function.py", tasks.function_tests(answer))
    outcomes = run_pytest(ctx, "../test_function.py", cwd=".verify/head", timeout=60)
    return outcomes.all_passed(expected=len(answer["checks"]))


def _read(ctx: ToolContext, path: str) -> str:
    try:
        return ctx.read_file(path)
    except (OSError, AgentError):
        return ""


if __name__ == "__main__":
    LongHorizonEnv.cli()
