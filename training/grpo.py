"""GRPO with TRL on the flywheel environments, rolled out by each env's own agent loop.

`training.rollouts` runs every rollout through the env's `run_agent` (the loop, tools, sandbox,
parser and verifier that `process` mode and evaluation use), so the policy is trained on exactly
the loop it is judged by; any env runs, a user's step env included, and several envs can share
a run (their tasks interleave). KL to the initial policy (`beta`), per-group reward scaling,
a NaN/inf guard, and a warning when every group of a step had identical rewards (all-0 or all-1:
no learning signal).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

from transformers import TrainerCallback

from data import ArtifactStore, Manifest
from environments.hermes_base_env import HermesAgentBaseEnv
from environments.registry import env_class
from training.config import RunnerConfig
from training.models import resolve_model
from training.rollouts import Task, agent_rollout_func, prompt_key
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


def env_reward(run: RunDir, every: int) -> Any:
    """TRL reward function: the env's own reward of each rollout; samples are saved every `every` steps."""

    def flywheel_env_reward(prompts, completions, env_reward, trainer_state, **extra: Any) -> list[float | None]:  # type: ignore[no-untyped-def]
        if trainer_state.global_step % every == 0:
            samples = [
                {"prompt": p, "completion": c, "reward": r, "task_completed": done}
                for p, c, r, done in zip(prompts, completions, env_reward, extra["task_completed"], strict=True)
            ]
            run.log_rollouts(trainer_state.global_step, samples)
        return list(env_reward)

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


def task_dataset(envs: list[HermesAgentBaseEnv], num_tasks: int) -> tuple[Any, dict[str, Task]]:
    """`num_tasks` training prompts, the envs' tasks interleaved, and the task each prompt names."""
    from datasets import Dataset

    rows, tasks = [], {}
    for index in range(num_tasks):
        env = envs[index % len(envs)]
        item = asyncio.run(env.get_next_item())
        prompt = [{"role": "user", "content": f"[{env.name} {item['item_id']}] {env.format_prompt(item)}"}]
        rows.append({"prompt": prompt, "env": env.name, "item_id": item["item_id"]})
        tasks[prompt_key(prompt)] = Task(env, item)
    return Dataset.from_list(rows), tasks


def run_grpo(
    cfg: RunnerConfig,
    store: ArtifactStore,
    callbacks: list[Any] | None = None,
    envs: list[HermesAgentBaseEnv | str] | None = None,
) -> Manifest:
    """load -> build -> run -> save: GRPO on the configured envs (`envs`: names, or instances as their
    makers configured them); the checkpoint goes to the store. The envs get the policy's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    started = time.perf_counter()
    if cfg.profile == "cpu":
        torch.set_num_threads(cfg.num_threads)
    model_dir = resolve_model(cfg.policy_model, store)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    overrides = {"difficulty": cfg.difficulty, "categories": cfg.categories, "seed": cfg.seed}
    envs = [
        env_class(env)(tokenizer_name=str(model_dir), **overrides) if isinstance(env, str) else env
        for env in (envs or cfg.envs)
    ]
    for one in envs:
        asyncio.run(one.setup())
        one.config.tokenizer_name, one.tokenizer = str(model_dir), tokenizer  # The policy's own tokenizer.
        one.config.max_agent_turns = min(one.config.max_agent_turns, cfg.max_tool_calls + 1)
    run = RunDir(cfg.logs_root, cfg.output_name)
    dataset, tasks = task_dataset(envs, cfg.num_tasks)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=[env_reward(run, cfg.rollouts_every)],
        args=grpo_args(cfg, str(run.checkpoints)),
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=agent_rollout_func(tasks, cfg.temperature, cfg.max_completion_length),
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
