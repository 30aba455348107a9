"""ToolUseChainEnv: goals that need several tools in the right order, verified on the final files.

    python environments/tool_use_chain.py process --env.total_steps 8 --env.group_size 2 \
        --env.data_path_to_save_groups out/tool_use_chain.jsonl --env.tokenizer_name MODEL_DIR \
        --openai.base_url http://127.0.0.1:8000/v1 --openai.model_name MODEL
"""

from __future__ import annotations

from typing import Any

from environments.agent_loop import AgentResult
from environments.hermes_base_env import HermesAgentBaseEnv, HermesAgentEnvConfig, default_tokenizer
from environments.rewards import binary_reward
from environments.task_stream import TaskStream
from environments.tasks import tool_use_chain_tasks as tasks
from environments.tool_context import ToolContext


class ToolUseChainEnvConfig(HermesAgentEnvConfig):
    """Defaults for repository chores: terminal + file tools, a few turns per file."""

    max_agent_turns: int = 16


class ToolUseChainEnv(HermesAgentBaseEnv):
    name = "tool_use_chain"
    env_config_cls = ToolUseChainEnvConfig
    categories = tasks.CATEGORIES

    @classmethod
    def config_init(cls) -> tuple[ToolUseChainEnvConfig, list[Any]]:
        config = ToolUseChainEnvConfig(tokenizer_name=default_tokenizer(), group_size=4, use_wandb=False)
        return config, cls.default_server_configs()

    async def setup(self) -> None:
        cfg = self.config
        self.stream = TaskStream(
            self.name,
            tasks.make_task,
            self.categories,
            cfg.seed,
            cfg.difficulty,
            cfg.categories,
            cfg.task_mix,
        )
        self.eval_items = TaskStream(self.name, tasks.make_task, self.categories, cfg.eval_seed).items(cfg.eval_size)
        self.index = 0

    async def get_next_item(self) -> dict[str, Any]:
        self.index += 1
        return self.stream.item(self.index - 1)

    def format_prompt(self, item: dict[str, Any]) -> str:
        return item["prompt"]

    async def compute_reward(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> float:
        return binary_reward(tasks.verify(item, ctx.read_file))

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        await self.run_agentic_eval(self.eval_items)

    async def wandb_log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        await super().wandb_log(wandb_metrics)


if __name__ == "__main__":
    ToolUseChainEnv.cli()
