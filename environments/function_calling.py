"""FunctionCallingEnv: calls to generated APIs, judged by exact match of name, argument keys and typed values.

Each task brings its own functions. They are listed in the user message, rendered the way the
configured tool-call parser renders tools for a system prompt (with how to write a call), and they
are the rollout's tools: the agent loop runs them like any tool (each checks its arguments against
its schema and answers `{"status": "ok"}`), so a right call gets a result and a mistyped one a tool
error. The request-level `tools=` stays empty, as do the toolsets (no shell, no files): what a
trainer renders from the conversation is what the model saw. The verifier judges the calls in the
conversation (`tasks.verify`); the reward is 1 less 0.01 per model call when they are right, else 0.

    python environments/function_calling.py process --env.total_steps 8 --env.group_size 2 \
        --env.data_path_to_save_groups out/function_calling.jsonl --env.tokenizer_name MODEL_DIR \
        --openai.base_url http://127.0.0.1:8000/v1 --openai.model_name MODEL
"""

from __future__ import annotations

import asyncio
import functools
from contextvars import ContextVar
from typing import Any

from pydantic import Field

from flywheel.environments.agent.tools import Tool
from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.hermes_base_env import HermesAgentEnvConfig
from flywheel.environments.task_env import TaskEnv
from flywheel.environments.task_stream import TaskStream
from flywheel.environments.tasks import function_calling_tasks as tasks
from flywheel.environments.tool_context import ToolContext
from flywheel.environments.verify.untrusted import Unjudgeable

SYSTEM_PROMPT = (
    "You are an assistant that answers requests by calling functions. Make every call a request needs "
    "in one reply; when the results come back, reply with a short final answer and no call. When none "
    "of the functions can do what is asked, make no call and say so."
)
# The functions of the task whose rollout runs in this context (each rollout is its own asyncio task).
_TASK_TOOLS: ContextVar[tuple[Tool, ...]] = ContextVar("function_calling_task_tools", default=())


class FunctionCallingEnvConfig(HermesAgentEnvConfig):
    """The task's functions are the only tools; a right answer takes two turns (calls, then words)."""

    enabled_toolsets: list[str] = Field(default_factory=list, description="No shell or file tools.")
    max_agent_turns: int = Field(
        default=5, ge=1, description="Model calls per rollout: room for 4 calls made one per reply, then words."
    )
    system_prompt: str | None = Field(default=SYSTEM_PROMPT, description="System message of every rollout.")


class FunctionCallingEnv(TaskEnv):
    step_cost = 0.01  # Done = 1, less 0.01 per model call.
    name = "function_calling"
    env_config_cls = FunctionCallingEnvConfig
    make_task = tasks.make_task
    categories = tasks.CATEGORIES

    async def setup(self) -> None:
        """`TaskEnv.setup`, with the held-out tasks from their own part of the task space (`tasks.split_of`)."""
        await super().setup()
        cfg = self.config
        held_out = functools.partial(tasks.make_task, split="held_out")
        stream = TaskStream(self.name, held_out, self.categories, cfg.eval_seed, cfg.difficulty, cfg.categories)
        self.eval_items = stream.items(cfg.eval_size)
        for item in self.eval_items:
            self.remember_item(item)

    def format_prompt(self, item: dict[str, Any]) -> str:
        listing = item.get("listing", "schema")
        return tasks.user_prompt(item["functions"], item["request"], self.config.tool_call_parser, listing)

    async def run_agent(
        self,
        item: dict[str, Any],
        temperature: float,
        tools: tuple[list[dict[str, Any]], set[str]] | None = None,
        server: Any = None,
    ) -> tuple[AgentResult, float | None]:
        """The base rollout, with the task's functions among the tool names the loop accepts and runs."""
        schemas, names = tools or self._resolve_tools_for_group()
        functions = tuple(tasks.function_tools(item))
        token = _TASK_TOOLS.set(functions)  # `extra_tools()` gives them to the loop this rollout builds.
        try:
            return await super().run_agent(item, temperature, (schemas, names | {f.name for f in functions}), server)
        finally:
            _TASK_TOOLS.reset(token)

    def extra_tools(self) -> list[Any]:
        """The current rollout's functions (none outside one: the env itself declares no tool)."""
        return list(_TASK_TOOLS.get())

    def tools_by_name(self) -> dict[str, Any]:
        """The tools of an episode driven by `reset`/`step`: its task's functions."""
        return super().tools_by_name() | {t.name: t for t in tasks.function_tools(self._episode_item or {})}

    async def verify(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> bool:
        unparsed = [e.error for e in result.tool_errors if e.tool_name.startswith("<")]  # <parse>, <too many calls>
        try:
            return await asyncio.to_thread(tasks.verify, item, result.messages, unparsed)
        except Unjudgeable as err:  # Output no honest reply holds: a failed task, with its reason.
            result.verify_error = f"Unjudgeable: {err}"
            return False


if __name__ == "__main__":
    FunctionCallingEnv.cli()
