"""GRPO with TRL on the flywheel environments: multi-turn tool use through `environment_factory`.

Each rollout gets a `SandboxToolEnv` (TRL's environment contract): `reset(task_index=...)`
builds the task's sandbox, its public methods are the tools the model calls, and the env's own
verifier scores the final state. KL to the initial policy (`beta`), per-group reward scaling,
a NaN/inf guard, and a warning when every group of a step had identical rewards (all-0 or all-1:
no learning signal).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import sys
import time
import uuid
from typing import Any, ClassVar

from transformers import TrainerCallback

from data import ArtifactStore, Manifest
from environments.agent_loop import AgentResult
from environments.hermes_base_env import HermesAgentBaseEnv, _prepare_workspace
from environments.registry import env_class
from environments.tool_context import ToolContext
from environments.tools import Tool, resolve_toolsets
from training.config import ConfigError, RunnerConfig
from training.models import resolve_model
from training.run_logs import MetricsCallback, NonFiniteGuard, RunDir

logger = logging.getLogger(__name__)

# `vllm serve` flags and environment that TRL's GRPO server mode needs (weights are pushed over NCCL;
# log-probs must reflect sampling). Pass them as `ServerConfig(extra_args=..., env=...)` when starting it.
GRPO_VLLM_SERVER_ARGS = [
    "--weight-transfer-config",
    '{"backend": "nccl"}',
    "--logprobs-mode",
    "processed_logprobs",
    "--max-logprobs",
    "-1",
]
GRPO_VLLM_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def load_env(name: str, **config: Any) -> HermesAgentBaseEnv:
    """An environment by registry name, set up (its task stream ready)."""
    env = env_class(name)(**config)
    asyncio.run(env.setup())
    return env


class SandboxToolEnv:
    """One rollout's sandbox for TRL's tool loop; public methods are the agent's tools.

    Use `tool_env_class(env)`: it adds one method per tool the env gives its agent (its toolsets
    and its own, such as the web env's browser), with the tool's own signature and docstring,
    which is where TRL reads the schema the model sees.
    """

    tools: ClassVar[dict[str, Tool]] = {}

    def __init__(self, env: HermesAgentBaseEnv) -> None:
        self._env = env
        self._ctx: ToolContext | None = None
        self._item: dict[str, Any] | None = None
        self._calls = 0

    def reset(self, task_index: int = 0, **_: Any) -> None:
        """Start task `task_index` in a fresh sandbox (the prompt already holds the instructions)."""
        self._release()
        self._item = self._env.stream.item(int(task_index))
        self._ctx = ToolContext(f"grpo-{self._item['item_id']}-{uuid.uuid4().hex[:8]}")
        _prepare_workspace(self._ctx, self._item)
        self._calls = 0

    def _verify(self, completion: Any) -> float:
        """The env's verifier on this rollout's sandbox, then the sandbox is released."""
        if self._item is None or self._ctx is None:
            return 0.0
        messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        result = AgentResult(messages=messages, turns_used=self._calls + 1)
        try:
            reward = asyncio.run(self._env.compute_reward(self._item, result, self._ctx))
        finally:
            self._release()
        return float(min(1.0, max(0.0, reward)))

    def _tool(self, name: str, **arguments: Any) -> str:
        self._calls += 1
        if self._ctx is None:
            return "Error: no task is active"
        try:
            return self.tools[name](self._ctx, arguments)
        except Exception as err:  # A tool failure is the model's to see, never a crashed step.
            return f"Error: {err}"

    def _release(self) -> None:
        if self._ctx is not None:
            self._ctx.cleanup()
            self._ctx = None


def tool_env_class(env: HermesAgentBaseEnv) -> type[SandboxToolEnv]:
    """A `SandboxToolEnv` whose methods are exactly the tools `env` gives its agent."""
    tools = {t.name: t for t in resolve_toolsets(env.config.enabled_toolsets) + env.extra_tools()}
    methods = {name: _tool_method(t) for name, t in tools.items()}
    return type(f"{type(env).__name__}Tools", (SandboxToolEnv,), {"tools": tools, **methods})


def _tool_method(tool: Tool) -> Any:
    """`tool.fn(ctx, **args)` as a method `(self, **args)`: same parameters, annotations and docstring."""
    parameters = list(inspect.signature(tool.fn).parameters.values())[1:]  # Drop the ToolContext.

    def method(self: SandboxToolEnv, *args: Any, **kwargs: Any) -> str:
        bound = inspect.Signature(parameters).bind(*args, **kwargs)
        return self._tool(tool.name, **bound.arguments)

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__name__ = method.__qualname__ = tool.name
    method.__doc__ = tool.fn.__doc__
    method.__signature__ = inspect.Signature([self_param, *parameters], return_annotation=str)
    method.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": "str"}
    return method


def env_reward(run: RunDir, every: int) -> Any:
    """TRL reward function: each rollout's env verifier; samples are saved every `every` steps."""

    def flywheel_env_reward(prompts, completions, environments, trainer_state, **_: Any) -> list[float]:  # type: ignore[no-untyped-def]
        rewards = [env._verify(completion) for env, completion in zip(environments, completions, strict=True)]
        if trainer_state.global_step % every == 0:
            samples = [
                {"prompt": p, "completion": c, "reward": r}
                for p, c, r in zip(prompts, completions, rewards, strict=True)
            ]
            run.log_rollouts(trainer_state.global_step, samples)
        return rewards

    return flywheel_env_reward


class RewardDistributionWarning(TrainerCallback):
    """Warns when every group of a step scored the same (all-0 or all-1): zero advantages, no signal."""

    def __init__(self) -> None:
        self.flat_steps: list[int] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and logs.get("frac_reward_zero_std") == 1.0:
            self.flat_steps.append(state.global_step)
            logger.warning(
                "step %d: every group had identical rewards (mean %.2f): all-0 or all-1 groups give no "
                "learning signal; SFT first, or adjust the task difficulty",
                state.global_step,
                logs.get("reward", float("nan")),
            )


def grpo_args(cfg: RunnerConfig, output_dir: str) -> Any:
    """TRL `GRPOConfig` from the runner knobs."""
    from trl import GRPOConfig

    return GRPOConfig(**grpo_kwargs(cfg, output_dir))


def grpo_kwargs(cfg: RunnerConfig, output_dir: str) -> dict[str, Any]:
    """`GRPOConfig` fields for the profile (pure, so the GPU profile is checked on CPU machines)."""
    args: dict[str, Any] = {
        "output_dir": output_dir,
        "max_steps": cfg.total_steps,
        "learning_rate": cfg.learning_rate,
        "warmup_steps": max(1, int(cfg.warmup_ratio * cfg.total_steps)) if cfg.warmup_ratio else 0,
        "per_device_train_batch_size": cfg.batch_size,
        "num_generations": cfg.num_rollouts_per_task,
        "max_completion_length": cfg.max_completion_length,
        "beta": cfg.kl_beta,
        "scale_rewards": "group",
        "temperature": cfg.temperature,
        "top_k": cfg.top_k,
        "max_tool_calling_iterations": cfg.max_tool_calls,
        "seed": cfg.seed,
        "logging_steps": 1,
        "logging_nan_inf_filter": False,
        "save_strategy": "no",
        "report_to": cfg.report_to or "none",
        "disable_tqdm": not sys.stderr.isatty(),  # A progress bar on a terminal only.
    }
    if cfg.profile == "cpu":
        args.update(use_cpu=True, bf16=False, gradient_checkpointing=False)
    else:
        args.update(bf16=True, gradient_checkpointing=True)
        if cfg.use_vllm:
            args.update(use_vllm=True, vllm_mode=cfg.vllm_mode)
            if cfg.vllm_mode == "server":
                args["vllm_server_base_url"] = cfg.vllm_server_base_url
    return args


def task_dataset(env: HermesAgentBaseEnv, num_tasks: int) -> Any:
    """GRPO prompts: the env's system + user messages for tasks 0..n-1, with their index for reset()."""
    from datasets import Dataset

    rows = []
    for index in range(num_tasks):
        item = env.stream.item(index)
        rows.append({"prompt": env.build_messages(item, []), "task_index": index})
    return Dataset.from_list(rows)


def run_grpo(
    cfg: RunnerConfig,
    store: ArtifactStore,
    callbacks: list[Any] | None = None,
    env: HermesAgentBaseEnv | None = None,
) -> Manifest:
    """load -> build -> run -> save: GRPO on the configured env (or `env`, as configured by its
    maker); the checkpoint goes to the store. The env gets the policy's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    started = time.perf_counter()
    if cfg.profile == "cpu":
        torch.set_num_threads(cfg.num_threads)
    model_dir = resolve_model(cfg.policy_model, store)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if env is None:
        env = load_env(
            cfg.envs[0],
            tokenizer_name=str(model_dir),
            difficulty=cfg.difficulty,
            categories=cfg.categories,
            seed=cfg.seed,
        )
    else:
        asyncio.run(env.setup())
    if not hasattr(env, "stream"):
        raise ConfigError(f"GRPO needs an env with a task stream (a TaskEnv); {type(env).__name__} has none")
    env.config.tokenizer_name, env.tokenizer = str(model_dir), tokenizer
    run = RunDir(cfg.logs_root, cfg.output_name)
    tools_class = tool_env_class(env)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=[env_reward(run, cfg.rollouts_every)],
        args=grpo_args(cfg, str(run.checkpoints)),
        train_dataset=task_dataset(env, cfg.num_tasks),
        processing_class=tokenizer,
        environment_factory=lambda: tools_class(env),
        callbacks=[MetricsCallback(run), NonFiniteGuard(), RewardDistributionWarning(), *(callbacks or [])],
    )
    trainer.train()
    return save_checkpoint(store, trainer, tokenizer, run, cfg, model_dir, started)


def save_checkpoint(
    store: ArtifactStore, trainer: Any, tokenizer: Any, run: RunDir, cfg: RunnerConfig, model_dir: Any, started: float
) -> Manifest:
    """Save the trained policy and mirror the run folder into the store, with lineage and figures."""
    from training.models import TRAINING_TEMPLATE_FILE

    final_dir = run.checkpoints / "final"
    trainer.save_model(str(final_dir))
    tokenizer.save_pretrained(final_dir)
    if (model_dir / TRAINING_TEMPLATE_FILE).exists():
        (final_dir / TRAINING_TEMPLATE_FILE).write_text((model_dir / TRAINING_TEMPLATE_FILE).read_text())
    logged = run.read_metrics()
    rewards = [m["reward"] for m in logged if "reward" in m]
    metrics = {
        "algorithm": cfg.algorithm,
        "steps": trainer.state.global_step,
        "first_reward": rewards[0] if rewards else None,
        "final_reward": rewards[-1] if rewards else None,
        "kl": next((m["kl"] for m in reversed(logged) if "kl" in m), None),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "device": "cpu" if cfg.profile == "cpu" else "cuda",
    }
    parents = [
        p
        for p in (
            store.try_resolve(f"model/{cfg.policy_model}", cfg.policy_model),
            cfg.dataset and store.resolve(cfg.dataset),
        )
        if p
    ]
    params = json.loads(cfg.model_dump_json())
    manifest = store.put("checkpoint", cfg.output_name, final_dir, parents=parents, params=params, metrics=metrics)
    store.put("run", cfg.output_name, run.path, parents=[manifest.id], metrics=metrics)
    logger.info("%s %s: %d steps, reward %s -> %s", cfg.algorithm, cfg.output_name, metrics["steps"],
                metrics["first_reward"], metrics["final_reward"])  # fmt: skip
    return manifest
