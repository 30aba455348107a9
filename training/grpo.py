"""GRPO with TRL on the flywheel environments, rolled out by each env's own agent loop.

`flywheel.training.rollouts` runs every rollout through the env's `run_agent` (the loop, tools, sandbox,
parser and verifier that `process` mode and evaluation use), so the policy is trained on exactly
the loop it is judged by; any env runs, a user's step env included, and several envs can share
a run (their tasks interleave). KL to the initial policy (`beta`), per-group reward scaling,
a NaN/inf guard, and a warning when every group of a step had identical rewards (all-0 or all-1:
no learning signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from flywheel.data import ArtifactStore, Manifest
from flywheel.environments.hermes_base_env import HermesAgentBaseEnv
from flywheel.environments.registry import categories_of, env_class
from flywheel.environments.task_stream import weighted_round_robin
from flywheel.training.checkpoints import StepCheckpoints, finish, model_parents, resume_from, train
from flywheel.training.config import RunnerConfig
from flywheel.training.distributed import training_arguments
from flywheel.training.grpo_config import GRPORunConfig, grpo_kwargs
from flywheel.training.models import resolve_model
from flywheel.training.rollouts import Outcome, PolicyServer, Task, agent_rollout_func, prompt_key, run_rollouts
from flywheel.training.run_logs import MetricsCallback, NonFiniteGuard, RunDir
from flywheel.training.schedule import warming_up_from_the_first_step
from flywheel.training.screening import screen_tasks

logger = logging.getLogger(__name__)


class RewardStats(TrainerCallback):
    """Adds each env's reward mean/std, the rollouts re-tokenised instead of trained on their sampled
    tokens, and the step's tokens per second to the step's log (so to metrics.jsonl and the Prefect
    run); list it before the callbacks that write the log."""

    def __init__(self) -> None:
        self.rewards: dict[str, list[float]] = defaultdict(list)
        self.retokenized = 0
        self._tokens = 0.0

    def record(self, envs: list[str], rewards: list[float | None], retokenized: list[bool] | None = None) -> None:
        for env, reward in zip(envs, rewards, strict=True):
            if reward is not None:  # An infra failure is not a score.
                self.rewards[env].append(reward)
        self.retokenized += sum(retokenized or [])

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or "reward" not in logs:
            return
        for env, values in self.rewards.items():
            logs[f"rewards/{env}/mean"] = statistics.fmean(values)
            logs[f"rewards/{env}/std"] = statistics.pstdev(values)
        self.rewards.clear()
        logs["rollouts_retokenized"], self.retokenized = self.retokenized, 0
        if logs.get("num_tokens") and logs.get("step_time"):
            logs["tokens_per_second"] = (logs["num_tokens"] - self._tokens) / logs["step_time"]
            self._tokens = logs["num_tokens"]


def env_reward(run: RunDir, every: int, stats: RewardStats | None = None) -> Any:
    """TRL reward function: the env's own reward of each rollout; samples are saved every `every` steps."""

    def flywheel_env_reward(prompts, completions, env_reward, trainer_state, **extra: Any) -> list[float | None]:  # type: ignore[no-untyped-def]
        if stats is not None and "env" in extra:
            stats.record(extra["env"], env_reward, extra.get("retokenized"))
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


def grpo_args(cfg: GRPORunConfig, output_dir: str) -> Any:
    """TRL `GRPOConfig` from the runner knobs."""
    from trl import GRPOConfig

    return training_arguments(GRPOConfig, grpo_kwargs(cfg, output_dir))


def generation_problem(cfg: GRPORunConfig, num_processes: int) -> str | None:
    """Why this run's generation cannot work across `num_processes` ranks (None: it can)."""
    if num_processes > 1 and cfg.rl_mode == "atropos":
        return "rl_mode=atropos trains in one process, behind one policy endpoint: run it on one GPU"
    if num_processes > 1 and cfg.deepspeed in ("zero3", "zero3_offload") and not cfg.vllm():
        return (
            "in-process generation under ZeRO-3 on several GPUs hangs: every forward gathers the sharded weights "
            "collectively, and each rank's env loops generate a different number of tokens; use vLLM or zero2"
        )
    return None


def env_draws(envs: list[HermesAgentBaseEnv]) -> Iterator[HermesAgentBaseEnv]:
    """The envs in the order GRPO draws tasks from them: each env's share is the sum of its task mix
    (the curriculum's learnability weights, one scale across envs); an env without a mix gets the
    mean share of those with one (all alike when none has one)."""
    sums = [None if env.config.task_mix is None else sum(env.config.task_mix.values()) for env in envs]
    mixed = [total for total in sums if total is not None]
    default = statistics.fmean(mixed) if mixed else 1.0
    shares = [default if total is None else total for total in sums]
    return (envs[index] for index in weighted_round_robin(shares))


def task_dataset(envs: list[HermesAgentBaseEnv], num_tasks: int) -> tuple[Any, dict[str, Task]]:
    """`num_tasks` training prompts, drawn from the envs by their shares, and the task each prompt names."""
    drawn = itertools.islice(env_draws(envs), num_tasks)
    return tasks_dataset([Task(env, asyncio.run(env.get_next_item())) for env in drawn])


def tasks_dataset(chosen: list[Task]) -> tuple[Any, dict[str, Task]]:
    """The training prompts naming `chosen`, and the task each prompt names."""
    from datasets import Dataset

    rows = [{"prompt": task_prompt(t.env, t.item), "env": t.env.name, "item_id": t.item["item_id"]} for t in chosen]
    return Dataset.from_list(rows), {prompt_key(row["prompt"]): task for row, task in zip(rows, chosen, strict=True)}


def task_prompt(env: HermesAgentBaseEnv, item: dict[str, Any]) -> list[dict[str, str]]:
    """The dataset row naming a task (the rollout builds the real prompt with the env's own `build_messages`)."""
    return [{"role": "user", "content": f"[{env.name} {item['item_id']}] {env.format_prompt(item)}"}]


def run_grpo(
    cfg: GRPORunConfig,
    store: ArtifactStore,
    callbacks: list[Any] | None = None,
    envs: list[HermesAgentBaseEnv | str] | None = None,
    env_workers: Any = None,
) -> Manifest:
    """load -> build -> run -> save: GRPO on the configured envs (`envs`: names, or instances as their
    makers configured them); the checkpoint goes to the store. The envs get the policy's tokenizer.
    `env_workers`: where atropos mode's env workers run (a `worker_handoff.WorkerLauncher`; None: where the
    process that launched this one says, else here)."""
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    started = time.perf_counter()
    settings = cfg.settings()
    if settings.device == "cpu":
        torch.set_num_threads(cfg.num_threads)
    model_dir = resolve_model(cfg.policy_model, store)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    run = RunDir(cfg.logs_root, cfg.output_name)
    resume = resume_from(store, cfg, run)
    screened: dict[str, list[Outcome]] = {}
    if cfg.rl_mode == "atropos":
        from flywheel.training.atropos_mode import AtroposMode
        from flywheel.training.worker_handoff import HandOff

        if any(not isinstance(env, str) for env in envs or []):
            raise ValueError(
                "rl_mode=atropos builds each env in its worker processes from its name: pass envs by name, "
                "module:Class or file path, not instances"
            )

        launcher = env_workers or HandOff.from_environment()
        atropos = AtroposMode(cfg, model_dir, tokenizer, run, launcher=launcher)
        dataset, rollout_func, agents = atropos.dataset(), atropos.rollout_func(), []
    else:
        atropos = None
        agents = policy_envs(cfg, envs, model_dir, tokenizer)
        dataset, tasks = task_dataset(agents, 1 if cfg.screen_tasks else cfg.num_tasks)  # Screening replaces it.
        rollout_func = agent_rollout_func(tasks, cfg.temperature, cfg.max_completion_length, screened)
    parents = model_parents(store, cfg.policy_model)
    stats = RewardStats()
    # Atropos mode's weight sync and queue counts (before the callbacks that write the log).
    fed = atropos.callbacks(lambda: trainer.accelerator.unwrap_model(trainer.model)) if atropos else []
    trainer = warming_up_from_the_first_step(GRPOTrainer)(
        model=str(model_dir),  # TRL loads it after the args exist, so ZeRO-3 partitions it while loading.
        reward_funcs=[env_reward(run, cfg.rollouts_every, stats)],
        args=grpo_args(cfg, str(run.checkpoints)),
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout_func,
        callbacks=[
            stats, *fed, MetricsCallback(run), NonFiniteGuard(), RewardDistributionWarning(), KeepScreening(run),
            StepCheckpoints(store, cfg, parents), *(callbacks or []),
        ],
    )  # fmt: skip
    if settings.device == "cpu":
        score_reference_in_bf16(trainer)
    if problem := generation_problem(cfg, trainer.accelerator.num_processes):
        raise ValueError(problem)
    screening = screen_into(trainer, cfg, agents, tasks, screened, run, resume) if cfg.screen_tasks else {}
    skipped = {}
    if resume is None and screening.get("kept") == 0:  # Only flat groups: step 1 would change no weight.
        skipped = {"skipped": "no screened task gave differing rewards: the policy is stored untrained"}
        logger.warning("%s: GRPO skipped, %s", cfg.output_name, skipped["skipped"])
    with atropos.running(trainer) if atropos is not None else contextlib.nullcontext():
        stopped = None if skipped else train(trainer, resume)
    logged = run.read_metrics()
    rewards = [m["reward"] for m in logged if "reward" in m]
    return finish(
        store, trainer, run, cfg, model_dir, parents, started, stopped,
        first_reward=rewards[0] if rewards else None,
        final_reward=rewards[-1] if rewards else None,
        kl=next((m["kl"] for m in reversed(logged) if "kl" in m), None),
        zero_std_share=statistics.fmean(m["frac_reward_zero_std"] for m in logged if "frac_reward_zero_std" in m)
        if rewards else None,
        **({"screening": screening} if screening else {}),
        **(atropos.summary() if atropos is not None else {}),
        **skipped,
    )  # fmt: skip


def score_reference_in_bf16(trainer: Any) -> None:
    """Keep the KL reference's weights in bf16 when the trainer autocasts to bf16 (a CPU with bf16
    dot products): the reference only scores, its matmuls already run in bf16 under autocast, and the
    KL it gives moves by ~1e-7, while its fp32 copy and autocast's per-forward bf16 cast of it cost
    0.3 GB of a 135M model's GRPO peak (of 4.9 GB)."""
    import torch

    if trainer.ref_model is not None and trainer.args.bf16 and trainer.ref_model.dtype == torch.float32:
        trainer.ref_model.to(torch.bfloat16)


SCREENING_FILE = "screening.json"


class KeepScreening(TrainerCallback):
    """Puts the screening's kept tasks into each step checkpoint (before it is mirrored), so a resumed
    run trains on the same tasks instead of screening again with other weights."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        kept = self.run.path / SCREENING_FILE
        if kept.exists() and state.is_world_process_zero:
            shutil.copy(kept, Path(args.output_dir) / f"checkpoint-{state.global_step}" / SCREENING_FILE)


def screen_into(
    trainer: Any,
    cfg: GRPORunConfig,
    envs: list[HermesAgentBaseEnv],
    tasks: dict[str, Task],
    screened: dict[str, list[Outcome]],
    run: RunDir,
    resume: Path | None,
) -> dict[str, Any]:
    """Screen tasks with the trainer's initial policy and make the kept ones its dataset; `tasks` and
    `screened` (the rollout function's) are filled in. A resumed run reloads the tasks it screened."""

    by_name = {env.name: env for env in envs}
    if resume is not None and (resume / SCREENING_FILE).exists():
        saved = json.loads((resume / SCREENING_FILE).read_text())
        chosen = [Task(by_name[t["env"]], t["item"]) for t in saved["tasks"]]
    else:
        chosen, summary = _screen(trainer, cfg, envs, screened)
        saved = {"summary": summary, "tasks": [{"env": t.env.name, "item": t.item} for t in chosen]}
    (run.path / SCREENING_FILE).write_text(json.dumps(saved, default=str))  # Rides in every step checkpoint.
    trainer.train_dataset, named = tasks_dataset(chosen)
    tasks.clear()
    tasks.update(named)
    return saved["summary"]


def _screen(
    trainer: Any, cfg: GRPORunConfig, envs: list[HermesAgentBaseEnv], screened: dict[str, list[Outcome]]
) -> tuple[list[Task], dict[str, Any]]:
    """Run the screening (see `flywheel.training.screening`); the kept groups become step 1's rollouts."""
    if trainer.accelerator.num_processes > 1:
        raise ValueError("screen_tasks runs in single-process GRPO only; set screen_tasks=0 for multi-GPU runs")
    group = cfg.num_rollouts_per_task
    per_step = cfg.batch_size * cfg.gradient_accumulation_steps // group
    needed = min(cfg.num_tasks, per_step * cfg.total_steps)
    drawn = env_draws(envs)

    def draw() -> Task:
        env = next(drawn)
        return Task(env, asyncio.run(env.get_next_item()))

    with PolicyServer.of_trainer(trainer, cfg.max_completion_length) as server:

        def roll(batch: list[Task]) -> list[Outcome]:
            return asyncio.run(run_rollouts(batch, server, cfg.temperature))

        found = screen_tasks(draw, roll, group, needed, max(cfg.screen_tasks, needed))
    summary = found.summary()
    logger.info("task screening: %s", json.dumps(summary))
    if not found.kept:
        logger.warning(
            "task screening: none of %d screened tasks gave differing rewards (all solved or all failed): "
            "GRPO would learn nothing from them, so it will not train; widen the slices or start from another policy",
            summary["screened"],
        )
    # A step needs `per_step` distinct tasks: flat ones fill in when too few were kept.
    kept = found.kept + found.flat[: max(0, per_step - len(found.kept))]
    for task, outcomes in kept:
        screened[prompt_key(task_prompt(task.env, task.item))] = list(outcomes)
    return [task for task, _ in kept], summary


def policy_envs(
    cfg: RunnerConfig, envs: list[HermesAgentBaseEnv | str] | None, model_dir: Path, tokenizer: Any
) -> list[HermesAgentBaseEnv]:
    """The run's envs, set up, on the policy's own tokenizer, their turns capped by `max_agent_turns`."""
    names = weighted_envs(cfg) if not envs else []
    built = [policy_env(cfg, env, model_dir, tokenizer) if isinstance(env, str) else env for env in (envs or names)]
    for one in built:
        asyncio.run(one.setup())
        on_policy_tokenizer(cfg, one, model_dir, tokenizer)
    return built


def weighted_envs(cfg: RunnerConfig) -> list[str]:
    """The run's envs that its task mix gives some weight (an env with nothing learnable gets no tasks)."""
    mixes = cfg.task_mix or {}
    names = [name for name in cfg.envs if mixes.get(name) is None or any(mixes[name].values())]
    if not names:
        raise ValueError(f"task_mix gives every env zero weight: {cfg.task_mix}")
    return names


def policy_env(cfg: RunnerConfig, name: str, model_dir: Path, tokenizer: Any, **config: Any) -> HermesAgentBaseEnv:
    """Env `name` as the run configures it (difficulty, categories, its task mix), not set up yet."""
    cls = env_class(name)
    categories = categories_of(cls, cfg.categories)
    mix = (cfg.task_mix or {}).get(name)
    return cls(tokenizer_name=str(model_dir), difficulty=cfg.difficulty, categories=categories, task_mix=mix,
               seed=cfg.seed, **config)  # fmt: skip


def on_policy_tokenizer(cfg: RunnerConfig, env: HermesAgentBaseEnv, model_dir: Path, tokenizer: Any) -> None:
    """Give `env` the policy's tokenizer and the run's caps on turns and reply length."""
    env.config.tokenizer_name, env.tokenizer = str(model_dir), tokenizer
    env.config.max_agent_turns = min(env.config.max_agent_turns, cfg.max_agent_turns)
    if cfg.max_token_length:
        env.config.max_token_length = cfg.max_token_length
