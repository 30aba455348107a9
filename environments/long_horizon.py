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
from environments.verify_calls import checks_from, run_checks
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
    """Sum of the milestones that hold in a fresh checkout of HEAD, judged by files, calls of the
    committed function in a child process, and junit reports of the committed tests.

    Runs after the agent's processes are dead. Git runs with the repo's fsmonitor and hooks
    switched off, so the agent's `.git/config` cannot run code that fakes its output.
    """
    answer = item["answer"]
    git = "git -c core.fsmonitor=false -c core.hooksPath=/dev/null"
    clean = ctx.terminal(f"{git} status --porcelain")
    tracked = ctx.terminal(f"{git} ls-tree -r --name-only HEAD")
    if clean["exit_code"] != 0 or tracked["exit_code"] != 0:
        return 0.0  # No real repository or no commit: nothing counts.
    verify_dir = fresh_verify_dir(ctx)
    if verify_dir is None:
        return 0.0
    head = f"{verify_dir}/head"
    if ctx.terminal(f"mkdir -p {head} && {git} archive HEAD | tar -x -C {head}")["exit_code"] != 0:
        return 0.0
    imports = f"from {answer['name']}.core import {answer['function']}"
    checks = {
        "pyproject": lambda: tasks.pyproject_ok(_read(ctx, f"{head}/pyproject.toml"), answer),
        "readme": lambda: tasks.readme_ok(_read(ctx, f"{head}/README.md"), answer),
        "function": lambda: run_checks(ctx, imports, checks_from(answer["checks"]), verify_dir, head, timeout=60),
        "tests": lambda: _tests_catch_a_gutted_function(ctx, answer, verify_dir),
    }
    score = sum(tasks.MILESTONES[name] for name, check in checks.items() if check())
    committed = set(tracked["output"].split())
    if set(answer["required"]) <= committed and not clean["output"].strip():
        score += tasks.MILESTONES["committed"]
    return round(score, 6)


def _tests_catch_a_gutted_function(ctx: ToolContext, answer: dict[str, Any], verify_dir: str) -> bool:
    """The committed tests name the function, pass on the committed code, and fail on a copy whose
    function returns None: tests that pass whatever the code does (or that patch pytest) earn nothing."""
    head, gutted = f"{verify_dir}/head", f"{verify_dir}/gutted"
    name, function = answer["name"], answer["function"]
    if function not in _read(ctx, f"{head}/tests/test_core.py"):
        return False
    if not run_pytest(ctx, "tests", verify_dir, cwd=head, timeout=60).all_passed():
        return False
    core = f"{name}/core.py"
    if ctx.terminal(f"cp -r {head} {gutted}")["exit_code"] != 0:
        return False
    try:  # The later definition wins: the module's function now returns None.
        ctx.write_file(
            f"{gutted}/{core}", _read(ctx, f"{head}/{core}") + f"\n\ndef {function}(*a, **k):\n    return None\n"
        )
    except (OSError, AgentError):
        return False  # The agent committed a link or a folder as core.py.
    outcomes = run_pytest(ctx, "tests", verify_dir, cwd=gutted, timeout=60)
    return bool(outcomes.results) and not outcomes.all_passed()


def _read(ctx: ToolContext, path: str) -> str:
    try:
        return ctx.read_file(path)
    except (OSError, AgentError):
        return ""


if __name__ == "__main__":
    LongHorizonEnv.cli()
