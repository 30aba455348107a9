"""`TaskEnv`: the shared shape of the built-in environments, whose items come from a task family.

A subclass names its family (`make_task`, `categories`), its config (`env_config_cls`, plus
`config_defaults` for inherited fields such as `group_size`) and writes `verify` (and
`compute_reward` when its reward is more than the verifier's pass/fail); `config_init`, `setup`,
`get_next_item`, `format_prompt` and `evaluate` follow the hermes-agent contract with the usual
defaults: training items from the config's `seed` (filtered and weighted by `difficulty`,
`categories` and the mined `task_mix`), held-out items from `eval_seed` (same slice, no mix).
"""

from __future__ import annotations

from typing import Any, ClassVar

from flywheel.environments.agent.servers import default_tokenizer
from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.hermes_base_env import HermesAgentBaseEnv, HermesAgentEnvConfig
from flywheel.environments.task_stream import MakeTask, TaskStream


class TaskEnv(HermesAgentBaseEnv):
    """A `HermesAgentBaseEnv` over a seeded `TaskStream`."""

    make_task: ClassVar[MakeTask]
    categories: ClassVar[tuple[str, ...]]
    config_defaults: ClassVar[dict[str, Any]] = {}
    step_cost: ClassVar[float] = 0.0  # Reward less per model call: the efficiency term.

    @classmethod
    def config_init(cls) -> tuple[HermesAgentEnvConfig, list[Any]]:
        """`env_config_cls` with `config_defaults`, the default tokenizer and wandb off; the default servers."""
        config = cls.env_config_cls(tokenizer_name=default_tokenizer(), use_wandb=False, **cls.config_defaults)
        return config, cls.default_server_configs()

    async def setup(self) -> None:
        cfg = self.config
        family = (self.name, type(self).make_task, self.categories)
        self.stream = TaskStream(*family, cfg.seed, cfg.difficulty, cfg.categories, cfg.task_mix)
        self.eval_items = TaskStream(*family, cfg.eval_seed, cfg.difficulty, cfg.categories).items(cfg.eval_size)
        for item in self.eval_items:
            self.remember_item(item)
        self.index = self.config.first_item

    @property
    def _eval_items(self) -> list[dict[str, Any]]:
        """The held-out items under the name a hand-written `evaluate` reads."""
        return self.eval_items

    async def get_next_item(self) -> dict[str, Any]:
        self.index += 1
        return self.remember_item(self.stream.item(self.index - 1))

    async def compute_reward(self, item: dict[str, Any], result: AgentResult, ctx: Any) -> float:
        """1.0 when the verifier passed the task, less `step_cost` per model call (the reward template,
        docs/architecture.md), else 0.0."""
        if not await self.completed(item, result, ctx):
            return 0.0
        return round(1.0 - self.step_cost * result.num_steps, 6)

    def format_prompt(self, item: dict[str, Any]) -> str:
        return item["prompt"]

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        await self.run_agentic_eval(self.eval_items)
