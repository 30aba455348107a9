"""`HermesAgentBaseEnv`: an atroposlib `BaseEnv` whose rollouts are multi-turn tool-using agents.

The base owns the agent loop, tool resolution per group, the sandbox and its `ToolContext`,
tokenisation for the trainer, and a concurrent, resumable `process` mode (`process_mode.py`); its
inference servers and their clients are set up in `servers.py`. A concrete env declares only
`config_init`, `setup`, `get_next_item`, `format_prompt`, `compute_reward`, `evaluate` and
`wandb_log`, and ends with `if __name__ == "__main__": Env.cli()`.

atroposlib 0.4.0 quirks handled here (see docs/architecture.md): `process` runs one group at a
time and renames an existing output file (we run groups concurrently and append, through
`process_mode.py`); `apply_chat_template` returns a BatchEncoding under transformers 5 (we
tokenise with `return_dict=False`); `process` forces wandb on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field, field_validator

from flywheel.environments.agent.conversation_tokens import ConversationTokenizer
from flywheel.environments.agent.messages import messages_with_dict_arguments
from flywheel.environments.agent.records import eval_metrics, eval_sample, group_meta
from flywheel.environments.agent.servers import build_server, default_server_configs, use_lean_clients
from flywheel.environments.agent.tools import resolve_toolsets
from flywheel.environments.agent_loop import (
    DEFAULT_MAX_REPEATED_REPLIES,
    DEFAULT_MAX_TOOL_CALLS_PER_REPLY,
    AgentResult,
    HermesAgentLoop,
    sanitize,
)
from flywheel.environments.episode import AgentEpisodes
from flywheel.environments.process_mode import write_groups
from flywheel.environments.sandbox.box import isolation_report
from flywheel.environments.sandbox.workspace import WorkspaceItems
from flywheel.environments.task_stream import turn_budget
from flywheel.environments.tool_call_parsers import PARSERS, get_parser
from flywheel.environments.tool_context import ToolContext
from flywheel.environments.verify.scoring import RolloutScoring

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent that completes tasks by calling tools. Call one tool at a time, read its "
    "result, and continue until the task is done. When you are finished, reply with a short "
    "final answer and no tool call."
)
Item = dict[str, Any]


class HermesAgentEnvConfig(BaseEnvConfig):
    """Config of an agent environment; CLI flags are `--env.<field>`."""

    # -- agent
    enabled_toolsets: list[str] = Field(default=["terminal", "file"], description="Toolsets the agent may use.")
    max_agent_turns: int = Field(
        default=12,
        ge=1,
        description="Model calls per rollout before it is cut off; a task whose oracle is longer gets "
        "1.5 x its oracle's calls (its horizon).",
    )
    agent_temperature: float = Field(default=1.0, ge=0, description="Sampling temperature for training rollouts.")
    system_prompt: str | None = Field(default=DEFAULT_SYSTEM_PROMPT, description="System message of every rollout.")
    tool_call_parser: str = Field(default="hermes", description="Parser for tool calls in raw model text.")
    render_tools_in_system_prompt: bool = Field(
        default=False, description="Describe tools in the system prompt (for templates that ignore tools=)."
    )
    extra_body: dict[str, Any] | None = Field(default=None, description="Extra fields sent with each request.")
    inference_retries: int = Field(
        default=1, ge=0, description="Extra tries per model call (atroposlib's server retries too)."
    )
    max_tool_calls_per_reply: int = Field(
        default=DEFAULT_MAX_TOOL_CALLS_PER_REPLY,
        ge=1,
        description="Tool calls of one reply that run; the rest are an error.",
    )
    max_repeated_replies: int | None = Field(
        default=DEFAULT_MAX_REPEATED_REPLIES,
        ge=2,
        description="End a rollout after this many replies in a row with the same tool calls and results "
        "(an agent stuck in a loop; None: never).",
    )
    teacher: Literal["server", "oracle"] = Field(
        default="server",
        description="Who acts: the inference server, or the env's oracle policy (teacher data).",
    )

    # -- sandbox
    terminal_backend: Literal["local"] = Field(
        default="local", description="Sandbox backend; `local` (namespaces + rlimits). docker/modal: plug in."
    )
    command_timeout_s: float = Field(default=30.0, gt=0, description="Wall-clock limit per sandbox command.")

    # -- tasks
    seed: int = Field(default=0, description="Seed of the training task stream.")
    first_item: int = Field(
        default=0, ge=0, description="Index of the first training item drawn (a generation shard starts at its range)."
    )
    eval_seed: int = Field(default=1_000_000, description="Seed of the held-out evaluation tasks.")
    eval_size: int = Field(default=20, ge=1, description="Held-out tasks per evaluation.")
    difficulty: str | None = Field(default=None, description="Only this difficulty (None: the task mix decides).")
    categories: list[str] | None = Field(default=None, description="Only these categories (None: all).")
    task_mix: dict[str, float] | None = Field(
        default=None, description="Sampling weights per 'category/difficulty' slice (from weakness mining)."
    )

    # -- throughput
    process_concurrency: int = Field(default=16, ge=1, description="Groups in flight at once in a `process` process.")
    process_workers: int = Field(
        default=1, ge=1, description="Processes `process` mode rolls out in (each rebuilds the env; one writes)."
    )
    eval_concurrency: int = Field(default=8, ge=1, description="Evaluation rollouts in flight at once.")

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value: str) -> str:
        if value not in PARSERS:
            raise ValueError(f"unknown tool_call_parser '{value}'; known: {', '.join(sorted(PARSERS))}")
        return value


class HermesAgentBaseEnv(BaseEnv, RolloutScoring, WorkspaceItems, AgentEpisodes):
    """Agent loop, tools, sandbox, tokenisation and a concurrent resumable `process` mode.

    Also a step-contract `BaseEnvironment`: `reset` / `step` / `score` drive one episode by hand.
    """

    name: str | None = None
    env_config_cls = HermesAgentEnvConfig
    server_cls = staticmethod(build_server)  # Atroposlib's servers; a keyless one gets a placeholder key.

    def __init__(
        self,
        config: HermesAgentEnvConfig | None = None,
        server_configs: Any = None,
        slurm: bool = False,
        testing: bool = False,
        *,
        num_tasks: int | None = None,
        difficulty: str | None = None,
        max_steps: int | None = None,
        **overrides: Any,
    ) -> None:
        """Atroposlib's `(config, server_configs)`, or `Env(num_tasks=, difficulty=, max_steps=)`.

        Without a config, `config_init()` supplies the defaults; keyword overrides are config fields.
        """
        if config is None:
            config, default_servers = self.config_init()
            fields = {
                "total_steps": num_tasks,
                "difficulty": difficulty,
                "max_agent_turns": max_steps,
                **overrides,
            }
            config = config.model_copy(update={k: v for k, v in fields.items() if v is not None})
            config = type(config).model_validate(config.model_dump())
            server_configs = server_configs or default_servers
        # BaseEnv would rename an existing output (x_1.jsonl) and truncate it; we append and resume.
        output = config.data_path_to_save_groups
        config.data_path_to_save_groups = None
        super().__init__(config, server_configs, slurm=slurm, testing=testing)
        config.data_path_to_save_groups = output
        # What a `process_workers` process rebuilds this env from.
        self.spawn_args = {"config": config, "server_configs": server_configs, "slurm": slurm, "testing": testing}
        self.config: HermesAgentEnvConfig = config
        use_lean_clients(self.server.servers)
        self._reward_buffer: list[float] = []
        self._conversation_tokens: ConversationTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._infra_failures = 0
        self._rollouts = 0
        # A loop built by hand from `self.server` (a hand-written `evaluate`) finds the task's files here.
        self.server.prepare_workspace = self._prepare_workspace_for  # type: ignore[attr-defined]

    # -- hooks a concrete env implements ---------------------------------------------------------

    def format_prompt(self, item: Item) -> str:
        """The user message for a task."""
        raise NotImplementedError

    async def compute_reward(self, item: Item, result: AgentResult, ctx: ToolContext) -> float:
        """Score a finished rollout by inspecting the sandbox through `ctx`; within `reward_range`.

        `result.task_completed` (from `verify`) and `result.key_decisions_hit` are already set.
        """
        raise NotImplementedError

    def tools_by_name(self) -> dict[str, Any]:
        """The tools this env's agent may call."""
        return {t.name: t for t in resolve_toolsets(self.config.enabled_toolsets) + self.extra_tools()}

    def oracle_policy(self, item: Item) -> Any:
        """A server-like policy that solves `item` (used with `teacher=oracle`)."""
        from flywheel.environments.agent.policies import ScriptedPolicy

        return ScriptedPolicy(item["oracle"], self.config.tool_call_parser)

    def extra_tools(self) -> list[Any]:
        """Tools beyond the named toolsets (an env's own, e.g. a browser)."""
        return []

    async def teardown(self) -> None:
        """Release what `setup` started (servers); called when `process` or `evaluate` ends."""

    async def close(self) -> None:
        """`teardown`, then close the inference clients (their aiohttp sessions leak otherwise)."""
        await self.teardown()
        for server in self.server.servers:
            client = getattr(server, "openai", None)
            if client is not None:
                await client.close()

    async def _run_evaluate(self) -> None:
        await self.setup()
        try:
            await self.evaluate()
        finally:
            await self.close()

    # -- rollouts --------------------------------------------------------------------------------

    def _resolve_tools_for_group(self) -> tuple[list[dict[str, Any]], set[str]]:
        """Tool schemas and names for one group (resolved once per group, as hermes-agent does)."""
        tools = resolve_toolsets(self.config.enabled_toolsets) + self.extra_tools()
        return [t.schema() for t in tools], {t.name for t in tools}

    def build_messages(self, item: Item, tool_schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        system = self.config.system_prompt or ""
        if self.config.render_tools_in_system_prompt and tool_schemas:
            system = f"{system}\n\n{get_parser(self.config.tool_call_parser).render_tools_prompt(tool_schemas)}"
        messages = [{"role": "system", "content": system}] if system else []
        return [*messages, {"role": "user", "content": self.format_prompt(item)}]

    async def run_agent(
        self,
        item: Item,
        temperature: float,
        tools: tuple[list[dict[str, Any]], set[str]] | None = None,
        server: Any = None,
    ) -> tuple[AgentResult, float | None]:
        """One rollout in a fresh sandbox: set up, run the loop, score (None on infra failure), clean up.
        `server` acts instead of the env's own (a trainer's policy)."""
        schemas, names = tools or self._resolve_tools_for_group()
        task_id = f"{item.get('item_id', 'task')}-{uuid.uuid4().hex[:8]}"
        ctx = ToolContext(task_id)
        try:
            await asyncio.to_thread(self.prepare_workspace, ctx, item)
            oracle = self.config.teacher == "oracle"
            server = self.oracle_policy(item) if oracle else server or self.server
            loop = HermesAgentLoop(
                server=server,
                valid_tool_names=names,
                task_id=task_id,
                tools=self.extra_tools(),
                **self.loop_settings(schemas, temperature) | {"max_turns": self.turn_budget(item)},
                render_prompt=None if oracle else self._prompt_renderer(schemas),
            )
            result = await loop.run(self.build_messages(item, schemas))
            if result.infra_error is not None:
                return result, None
            return result, await self.score_rollout(item, result, ctx)
        finally:
            ctx.cleanup()

    def turn_budget(self, item: Item) -> int:
        """Model calls `item` may take: `max_agent_turns`, or its horizon where longer (`task_stream.turn_budget`).
        A property of the item, so evaluation judges every model on an item under the same budget."""
        oracle = item.get("oracle")
        return turn_budget(len(oracle) if isinstance(oracle, list) else 0, self.config.max_agent_turns)

    def loop_settings(self, schemas: list[dict[str, Any]], temperature: float) -> dict[str, Any]:
        """The agent loop's settings from this env's config (shared by every loop an env builds)."""
        return {
            "tool_schemas": schemas,
            "max_turns": self.config.max_agent_turns,
            "temperature": temperature,
            "max_tokens": self.config.max_token_length,
            "extra_body": self.config.extra_body,
            "tool_call_parser": self.config.tool_call_parser,
            "inference_retries": self.config.inference_retries,
            "max_tool_calls_per_reply": self.config.max_tool_calls_per_reply,
            "max_repeated_replies": self.config.max_repeated_replies,
        }

    async def collect_trajectories(self, item: Item) -> tuple[ScoredDataGroup | None, list[Item]]:
        """`group_size` concurrent rollouts of one item; infra failures are dropped, not scored 0."""
        tools = self._resolve_tools_for_group()
        outcomes = await asyncio.gather(
            *(self.run_agent(item, self.config.agent_temperature, tools) for _ in range(self.config.group_size))
        )
        self._rollouts += len(outcomes)  # Training counters: evaluation (`run_agentic_eval`) never touches them.
        self._infra_failures += sum(1 for _, reward in outcomes if reward is None)
        group = ScoredDataGroup(
            tokens=[], masks=[], scores=[], messages=[], advantages=None, ref_logprobs=None,
            group_overrides={}, overrides=None, images=None,
        )  # fmt: skip
        prefix_cache: dict[str, str] = {}  # The group shares its prompt: render it once.
        completed: list[bool] = []
        for result, reward in outcomes:
            if reward is None:
                continue
            tokens, masks = await asyncio.to_thread(self.tokenize_conversation, result.messages, tools[0], prefix_cache)
            group["tokens"].append(tokens)
            group["masks"].append(masks)
            group["scores"].append(reward)
            group["messages"].append(result.messages)
            completed.append(result.task_completed if result.task_completed is not None else reward >= 1.0)
            self._reward_buffer.append(reward)
        if not group["scores"]:
            return None, []
        if len(group["scores"]) < self.config.group_size:
            group["group_overrides"] = {"group_size": len(group["scores"])}
        group["meta"] = group_meta(item, outcomes) | {"tools": tools[0], "completed": completed}  # type: ignore[typeddict-unknown-key]
        return group, []

    def _prompt_renderer(self, tool_schemas: list[dict[str, Any]]) -> Callable[[list[dict[str, Any]]], str]:
        """The prompt text the trainer's chat template makes of a conversation (for raw completions)."""

        def render(messages: list[dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(
                messages_with_dict_arguments(sanitize(messages)),
                tools=tool_schemas or None,
                tokenize=False,
                add_generation_prompt=True,
            )

        return render

    def tokenize_conversation(
        self,
        messages: list[dict[str, Any]],
        tool_schemas: list[dict[str, Any]],
        cache: dict[str, str] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Token ids of the whole conversation and a mask that keeps only assistant tokens
        (`ConversationTokenizer`; `cache` shares renderings across a group's rollouts).

        Strings are `sanitize`d first: a lone surrogate cannot be encoded, and tokenisers refuse it.
        """
        with self._tokenizer_lock:  # Rollouts tokenise in worker threads; a runner may swap the tokenizer.
            if self._conversation_tokens is None or self._conversation_tokens.tokenizer is not self.tokenizer:
                self._conversation_tokens = ConversationTokenizer(self.tokenizer)
            tokenize = self._conversation_tokens
        return tokenize(messages_with_dict_arguments(sanitize(messages)), tool_schemas, cache)

    # -- evaluation ------------------------------------------------------------------------------

    async def run_agentic_eval(
        self, items: list[Item], progress: Callable[[int, int], None] | None = None
    ) -> dict[str, float]:
        """Full agent loop at temperature 0 on `items`; writes metrics.json and samples.jsonl.

        `progress(done, total)` is called as each item finishes (a long evaluation shows it is alive).
        Training metric buffers are rolled back afterwards and the training counters are never
        touched, so evaluation never pollutes them.
        """
        started = time.time()
        buffer_mark = len(self._reward_buffer)
        semaphore = asyncio.Semaphore(self.config.eval_concurrency)
        tools = self._resolve_tools_for_group()
        done = 0

        async def one(item: Item) -> dict[str, Any]:
            nonlocal done
            async with semaphore:
                try:
                    result, reward = await self.run_agent(item, 0.0, tools)
                except Exception as err:  # The loop absorbs the model's faults: this one is ours, not its.
                    logger.exception("evaluation of item %s failed", item.get("item_id"))
                    result, reward = AgentResult(messages=[], infra_error=f"{type(err).__name__}: {err}"), None
            done += 1
            if progress is not None:
                progress(done, len(items))
            return eval_sample(item, result, reward)

        samples = await asyncio.gather(*(one(item) for item in items))
        del self._reward_buffer[buffer_mark:]
        metrics = eval_metrics(samples)
        await self.evaluate_log(
            metrics=metrics,
            samples=samples,
            start_time=started,
            end_time=time.time(),
            generation_parameters={
                "temperature": 0.0,
                "max_agent_turns": self.config.max_agent_turns,
                "sandbox": isolation_report(),  # An unisolated evaluation says so in its metadata.
            },
            verbose=False,
        )
        return metrics

    async def wandb_log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        wandb_metrics = dict(wandb_metrics or {})
        if self._reward_buffer:
            wandb_metrics["train/mean_reward"] = sum(self._reward_buffer) / len(self._reward_buffer)
            self._reward_buffer.clear()
        if self._rollouts:
            wandb_metrics["train/infra_failure_rate"] = self._infra_failures / self._rollouts
            wandb_metrics["env/rewards_out_of_range"] = self.rewards_out_of_range
        await super().wandb_log(wandb_metrics)

    # -- process mode: concurrent, appending, resumable ------------------------------------------

    async def process_manager(self) -> None:
        """Generate `total_steps` groups, `process_concurrency` at a time; a killed run resumes (`write_groups`)."""
        await write_groups(self, Path(self.config.data_path_to_save_groups or f"data/{self.name or 'groups'}.jsonl"))

    @classmethod
    def default_server_configs(cls) -> list[APIServerConfig]:
        """An OpenAI-compatible server on localhost; override with `--openai.*`."""
        return default_server_configs()
