"""ToolUseChainEnv: goals that need several tools in the right order, verified on the final files.

    python environments/tool_use_chain.py process --env.total_steps 8 --env.group_size 2 \
        --env.data_path_to_save_groups out/tool_use_chain.jsonl --env.tokenizer_name MODEL_DIR \
        --openai.base_url http://127.0.0.1:8000/v1 --openai.model_name MODEL
"""

from __future__ import annotations

import asyncio
from typing import Any

from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.hermes_base_env import HermesAgentEnvConfig
from flywheel.environments.task_env import TaskEnv
from flywheel.environments.tasks import tool_use_chain_tasks as tasks
from flywheel.environments.tool_context import ToolContext


class ToolUseChainEnvConfig(HermesAgentEnvConfig):
    """Defaults for repository chores: terminal + file tools, a few turns per file."""

    max_agent_turns: int = 16


class ToolUseChainEnv(TaskEnv):
    step_cost = 0.01  # Done = 1, less 0.01 per model call.
    name = "tool_use_chain"
    env_config_cls = ToolUseChainEnvConfig
    make_task = tasks.make_task
    categories = tasks.CATEGORIES

    key_decisions = ("read_file", "write_file")

    async def verify(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> bool:
        return await asyncio.to_thread(tasks.verify, item, ctx.read_file)  # Sandbox reads: off the loop.


if __name__ == "__main__":
    ToolUseChainEnv.cli()
