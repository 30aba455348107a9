"""`StepEnvAdapter`: a user's `BaseEnvironment` (reset/step) as a full agent env.

The one adapter between the step contract (docs/architecture.md) and everything that runs agent envs (process /
evaluate / serve, evaluation suites, a flywheel round). Each rollout deep-copies the user's env
(episodes of a group run concurrently), calls `reset(task_id)`, shows `State.text` as the user
message with `State.tools` as the tools, and then, per model reply: the reply becomes an
`Action` (text + parsed tool calls), `step(action)` runs, and the `next_state`'s text goes back as
the tool result (after a tool call) or as the next user message. The episode's reward is the sum
of its step rewards, checked against the env's `reward_range` like any env's.

Task ids are `0..n-1` when the env has a size (`len(env)`, or `len(env.tasks)`, or `num_tasks` in
the config); the last `eval_size` of them (at most a fifth) are held out for evaluation. An env
without a size gets `reset(None)` (it picks) and has no held-out split, which is logged.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any, ClassVar

from pydantic import Field

from flywheel.environments.agent.servers import default_tokenizer
from flywheel.environments.agent_loop import AgentResult, HermesAgentLoop
from flywheel.environments.base import Action, BaseEnvironment, State
from flywheel.environments.hermes_base_env import HermesAgentBaseEnv, HermesAgentEnvConfig
from flywheel.environments.tool_call_parsers import ParsedToolCall
from flywheel.environments.tool_context import ToolContext

logger = logging.getLogger(__name__)


class StepEnvConfig(HermesAgentEnvConfig):
    """Config of an adapted step env: how to build it, and how many tasks it has."""

    enabled_toolsets: list[str] = Field(default=[], description="Sandbox toolsets (a step env brings its own).")
    env_kwargs: dict[str, Any] = Field(default={}, description="Keyword arguments of the env's constructor.")
    num_tasks: int | None = Field(default=None, ge=1, description="Task ids 0..n-1 (None: from len(env)).")


class StepEnvLoop(HermesAgentLoop):
    """The agent loop with the user's `step` in place of the sandbox's tools."""

    def __init__(self, environment: BaseEnvironment, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.environment = environment
        self.reward = 0.0
        self.done = False

    async def _act(
        self,
        ctx: ToolContext,
        turn: int,
        content: str,
        calls: list[ParsedToolCall],
        parse_errors: list[str],
        result: AgentResult,
    ) -> bool:
        if parse_errors and not calls:  # Nothing the env could act on: the model hears why, as usual.
            return await super()._act(ctx, turn, content, calls, parse_errors, result)
        action = Action(text=content, tool_calls=calls)
        outcome = await asyncio.to_thread(self.environment.step, action)
        self.reward += float(outcome.reward)
        if outcome.done:
            self.done = True
            result.finished_naturally = not action.is_tool_call
            return True
        if not isinstance(outcome.next_state, State):
            raise TypeError(f"{type(self.environment).__name__}.step returned done=False without a next_state")
        text = outcome.next_state.text
        if action.is_tool_call:  # One observation answers the whole action: it goes with the last call.
            for index, call in enumerate(calls):
                shown = text if index == len(calls) - 1 else ""
                result.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": shown})
        else:
            result.messages.append({"role": "user", "content": text})
        return False


class StepEnvAdapter(HermesAgentBaseEnv):
    """Runs `environment_cls` (a `BaseEnvironment`) wherever a built-in env runs."""

    environment_cls: ClassVar[type[BaseEnvironment]]
    env_config_cls = StepEnvConfig

    @classmethod
    def config_init(cls) -> tuple[StepEnvConfig, list[Any]]:
        config = StepEnvConfig(tokenizer_name=default_tokenizer(), group_size=4, use_wandb=False)
        return config, cls.default_server_configs()

    @property
    def reward_range(self) -> tuple[float, float]:  # type: ignore[override]
        return self.environment_cls.reward_range

    _given: BaseEnvironment | None = None

    @classmethod
    def around(cls, environment: BaseEnvironment, **config: Any) -> StepEnvAdapter:
        """An adapter for an env the user already built (each rollout runs on a copy of it)."""
        adapter = adapter_class(type(environment))(**config)
        adapter._given = environment
        return adapter

    async def setup(self) -> None:
        if self.config.teacher == "oracle":
            raise ValueError(f"{self.name} is a step env and has no oracle: generate with a model (teacher=server)")
        self.prototype = self._given or self.environment_cls(**self.config.env_kwargs)
        size = self.config.num_tasks or _size(self.prototype)
        if size is None:
            logger.warning("%s has no size (len(env) or env.tasks): evaluation reuses tasks it picks", self.name)
            self.train_ids: list[Any] = [None]
            self.eval_ids: list[Any] = [None] * self.config.eval_size
        else:
            held_out = min(self.config.eval_size, size // 5) if size >= 2 else 0
            self.train_ids = list(range(size - held_out)) or [0]
            self.eval_ids = list(range(size - held_out, size))
        self.eval_items = [self._item(task_id, i) for i, task_id in enumerate(self.eval_ids)]
        for item in self.eval_items:  # The held-out prompts, for decontamination and the eval set's record.
            item["prompt"] = copy.deepcopy(self.prototype).reset(item["task_id"]).text
        self.index = self.config.first_item

    async def get_next_item(self) -> dict[str, Any]:
        self.index += 1
        return self._item(self.train_ids[(self.index - 1) % len(self.train_ids)], self.index - 1)

    def _item(self, task_id: Any, index: int) -> dict[str, Any]:
        key = task_id if task_id is not None else f"n{index}"
        return {"item_id": f"{self.name}-{key}", "task_id": task_id, "env": self.name, "category": "all",
                "difficulty": "all"}  # fmt: skip

    def format_prompt(self, item: dict[str, Any]) -> str:
        return item.get("prompt", "")

    async def run_agent(
        self,
        item: dict[str, Any],
        temperature: float,
        tools: tuple[list[dict[str, Any]], set[str]] | None = None,
        server: Any = None,
    ) -> tuple[AgentResult, float | None]:
        """One episode of a fresh copy of the user's env through `StepEnvLoop`; None on infra failure."""
        environment = copy.deepcopy(self.prototype)
        state = await asyncio.to_thread(environment.reset, item["task_id"])
        if not isinstance(state, State):
            raise TypeError(f"{self.environment_cls.__name__}.reset returned {type(state).__name__}, not a State")
        schemas = list(state.tools)
        system = self.config.system_prompt
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": state.text}
        ]
        loop = StepEnvLoop(
            environment,
            server=server or self.server,
            valid_tool_names={s["function"]["name"] for s in schemas},
            task_id=f"{item['item_id']}-{id(environment):x}",
            **self.loop_settings(schemas, temperature),
            render_prompt=self._prompt_renderer(schemas),
        )
        ctx = ToolContext(loop.task_id)
        try:
            result = await loop.run(messages)
            if result.infra_error is not None:
                return result, None
            ctx.state["step_reward"] = loop.reward
            ctx.state["done"] = loop.done
            return result, await self.score_rollout(item, result, ctx)
        finally:
            ctx.cleanup()

    async def compute_reward(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> float:
        """The sum of the episode's step rewards (0 when it never reached `done`)."""
        return ctx.state["step_reward"] if ctx.state["done"] else 0.0

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        await self.run_agentic_eval(self.eval_items)


def cli(environment_cls: type[BaseEnvironment]) -> None:
    """`python my_env.py process|evaluate|serve ...` for a seed-style env, as for the built-in envs:
    end the env's file with `if __name__ == "__main__": cli(MyEnv)`."""
    adapter_class(environment_cls).cli()


def adapter_class(environment_cls: type[BaseEnvironment]) -> type[StepEnvAdapter]:
    """A `StepEnvAdapter` subclass for `environment_cls`, named after it."""
    name = environment_cls.name or environment_cls.__name__
    return type(
        f"{environment_cls.__name__}Adapter", (StepEnvAdapter,), {"environment_cls": environment_cls, "name": name}
    )


def _size(environment: BaseEnvironment) -> int | None:
    for sized in (environment, getattr(environment, "tasks", None)):
        try:
            return len(sized)  # type: ignore[arg-type]
        except TypeError:
            continue
    return None
