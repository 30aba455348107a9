"""LongHorizonEnv: projects of 6 to 36 steps (package, metadata, README, tests, git commit).

Reward = committed milestones (partial credit) x efficiency of the step count.

    python environments/long_horizon.py evaluate --env.eval_size 5 --env.tokenizer_name MODEL_DIR \
        --env.data_dir_to_save_evals out/long --openai.base_url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import ast
import asyncio
import random
import secrets
from typing import Any, ClassVar

from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.errors import AgentError
from flywheel.environments.hermes_base_env import HermesAgentEnvConfig
from flywheel.environments.task_env import TaskEnv
from flywheel.environments.tasks import long_horizon_tasks as tasks
from flywheel.environments.tool_context import ToolContext
from flywheel.environments.verify.calls import checks_from, run_checks
from flywheel.environments.verify.hidden_tests import fresh_verify_dir, run_pytest, write_verifier_file
from flywheel.environments.verify.rewards import efficiency


class LongHorizonEnvConfig(HermesAgentEnvConfig):
    """Many turns: a hard task's oracle needs 36 model calls."""

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
        ctx.state["milestones"] = await asyncio.to_thread(milestone_score, item, ctx)  # Sandbox commands: off the loop.
        return ctx.state["milestones"] >= 1.0

    async def compute_reward(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> float:
        await self.completed(item, result, ctx)  # Runs `verify` (and so the milestones) if nobody has.
        return ctx.state.get("milestones", 0.0) * efficiency(result.turns_used, tasks.STEP_BUDGET)


_PINNED = " ".join(
    f"-c {setting}"
    for setting in (
        "core.fsmonitor=false", "core.hooksPath=/dev/null", "core.untrackedCache=false", "core.fileMode=true",
        "core.autocrlf=false", "core.excludesFile=/dev/null", "status.showUntrackedFiles=all",
    )
)  # fmt: skip


def milestone_score(item: dict[str, Any], ctx: ToolContext) -> float:
    """Sum of the milestones that hold in a fresh checkout of HEAD, judged by files, calls of the
    committed function in a child process, and junit reports of the committed tests.

    Runs after the agent's processes are dead. Git runs with the repo's fsmonitor and hooks
    switched off, so the agent's `.git/config` cannot run code that fakes its output, and the tree
    is compared with HEAD through a fresh index, with every setting that hides a change pinned, so
    neither index flags (`--assume-unchanged`, `--skip-worktree`) nor the repo's config
    (`status.showUntrackedFiles=no`, another `core.worktree`) make a dirty tree look clean.
    """
    answer = item["answer"]
    git = f"GIT_DIR=.git GIT_WORK_TREE=. GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null git {_PINNED}"
    index = 'GIT_INDEX_FILE="$index"'  # A fresh index of HEAD, outside the tree: no flag of the agent's index.
    clean = ctx.terminal(f"index=$(mktemp -u) && {index} {git} read-tree HEAD && {index} {git} status --porcelain")
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
        "tests": lambda: _tests_pin_the_function(ctx, answer, verify_dir),
    }
    score = sum(tasks.MILESTONES[name] for name, check in checks.items() if check())
    committed = set(tracked["output"].split())
    if set(answer["required"]) <= committed and not clean["output"].strip():
        score += tasks.MILESTONES["committed"]
    return round(score, 6)


def _tests_pin_the_function(ctx: ToolContext, answer: dict[str, Any], verify_dir: str) -> bool:
    """The committed tests name the function, pass on the committed code and on the task's reference
    function, and fail on a mutant that returns a wrong value of the right type: tests that pass
    whatever the function does (or patch pytest) earn nothing. Each run gets its own copy of the
    tree under a random name, in a random order, so a test cannot tell the runs apart by place or turn."""
    head = f"{verify_dir}/head"
    name, function = answer["name"], answer["function"]
    if function not in _read(ctx, f"{head}/tests/test_core.py"):
        return False
    core = _read(ctx, f"{head}/{name}/core.py")
    variants = {
        "committed": None,
        "reference": answer["reference"],
        "mutant": mutant_source(answer["reference"], function),
    }
    order = list(variants)
    random.SystemRandom().shuffle(order)
    for variant in order:
        copy = f"{verify_dir}/{secrets.token_hex(8)}"
        if ctx.terminal(f"cp -r {head} {copy}")["exit_code"] != 0:
            return False
        replaced = variants[variant]  # Appended: the later definition wins, the module's other names stay.
        if replaced is not None and not write_verifier_file(ctx, f"{copy}/{name}/core.py", f"{core}\n\n{replaced}"):
            return False  # The agent committed a link or a folder as core.py.
        outcomes = run_pytest(ctx, "tests", verify_dir, cwd=copy, timeout=60)
        ctx.terminal(f"rm -rf {copy}")
        held = outcomes.all_passed() if variant != "mutant" else bool(outcomes.results) and not outcomes.all_passed()
        if not held:  # The committed and the reference code pass every test (at least one); the mutant fails one.
            return False
    return True


_WRONG = """def _wrong(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "?"
    if isinstance(value, list):
        return value[:-1] if value else [0]
    if isinstance(value, dict):
        return {**value, "?": 0}
    return 0
"""


def mutant_source(reference: str, function: str) -> str:
    """`reference` with `function` answering a wrong value of the same type, under the same name and
    parameters: the reference renamed, and a new `function` that perturbs what it returns."""
    tree = ast.parse(reference)
    original = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    hidden = f"_{function}_{secrets.token_hex(4)}"
    original.name = hidden
    params = ", ".join(a.arg for a in original.args.args)
    return f"{ast.unparse(tree)}\n\n\n{_WRONG}\n\ndef {function}({params}):\n    return _wrong({hidden}({params}))\n"


def _read(ctx: ToolContext, path: str) -> str:
    try:
        return ctx.read_file(path)
    except (OSError, AgentError):
        return ""


if __name__ == "__main__":
    LongHorizonEnv.cli()
