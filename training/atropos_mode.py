"""GRPO the Atropos way (`rl_mode: atropos`): env workers feed `run-api`, the trainer consumes it.

    trainer ── policy endpoint (its weights, loaded each step) ◀── env workers (N processes)
       ▲                                                                        │ scored groups
       └──────────── checked groups (version, shape) ◀── run-api ◀──────────────┘

The env workers (`env_worker`, at least one an env, over the envs in turn) generate while the
trainer trains: a group sampled with weights at most `max_async_level` steps old is trained on, an
older one refused (`trajectory_api`). The trainer registers with `run-api` once its weights are
loaded, then starts the workers; the endpoint takes the trainer's weights at the start of training
and after every optimizer step (on vLLM: TRL's load before each step's generation). A resumed run's
step-k weights are version k: its workers' first groups, made before that load, are refused as stale.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import AutoConfig, TrainerCallback

from flywheel.environments.sandbox.box import isolation_available
from flywheel.training.env_fleet import EnvFleet
from flywheel.training.grpo import weighted_envs
from flywheel.training.grpo_config import GRPORunConfig
from flywheel.training.policy_endpoint import PolicyEndpoint
from flywheel.training.run_logs import RunDir
from flywheel.training.trajectory_api import GroupQueue, RunApi, atropos_rollout_func
from flywheel.training.worker_handoff import WorkerLauncher


def require_isolation() -> None:
    """Refused where the sandbox cannot be isolated: an agent's commands would then share the network
    with `run-api` and the endpoint (and could post groups of their own)."""
    if not isolation_available():
        raise ValueError(
            "rl_mode=atropos needs the sandbox's isolation (bubblewrap with user namespaces): without it an "
            "agent's commands reach run-api on loopback; install bubblewrap or use rl_mode=sync"
        )


def worker_fleet(cfg: GRPORunConfig, model_dir: Path, log_dir: Path, **placement: Any) -> EnvFleet:
    """The run's workers (at least one an env, over its weighted envs in turn) and where they post."""
    log_dir.mkdir(parents=True, exist_ok=True)
    config = log_dir / "atropos-run.json"
    config.write_text(cfg.model_dump_json())
    envs = weighted_envs(cfg)
    workers = ["--config", str(config), "--model-dir", str(model_dir)]
    return EnvFleet(envs, max(cfg.env_workers, len(envs)), workers, log_dir, **placement)


class AtroposMode:
    """The endpoint, fleet and group queue of one atropos-mode run, and what the trainer takes from them."""

    def __init__(
        self, cfg: GRPORunConfig, model_dir: Path, tokenizer: Any, run: RunDir, launcher: WorkerLauncher | None = None
    ) -> None:
        """Nothing starts here (`running` starts the processes and the endpoint's server), so a failure
        before training leaves nothing behind. With a `launcher` the workers run where it puts them (which
        checks its own sandbox) and only `run-api` is this process's child."""
        if launcher is None:
            require_isolation()
        self.cfg = cfg
        self.launcher = launcher
        self.fleet = worker_fleet(cfg, model_dir, run.path / "envs", host=cfg.serve_host)
        if launcher is not None:
            self.fleet.workers = 0
        # On vLLM the endpoint serves the trainer's engine, which exists once the trainer does (`running`).
        self.endpoint: PolicyEndpoint | None = None
        if not cfg.vllm():
            top_k, limit = cfg.sampling_top_k(False), cfg.max_completion_length
            self.endpoint = PolicyEndpoint.generation_copy(model_dir, tokenizer, top_k, limit, host=cfg.serve_host)
        self.api = RunApi(self.fleet.api_url)
        where = "their flow run's logs" if launcher else f"their logs: {self.fleet.log_dir}"
        hint = f"; the env workers: {where}" + (
            "; drop_flat_groups is on: a policy whose groups all score alike sends none" if cfg.drop_flat_groups else ""
        )
        vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size  # Known before the vLLM endpoint exists.
        self.queue = GroupQueue(
            self.api, cfg.num_rollouts_per_task, cfg.max_async_level, vocab_size, hint=hint,
            progress=self.replies, problem=self.problem,
        )  # fmt: skip

    def replies(self) -> int:
        """The policy endpoint's replies so far: the workers' progress."""
        return self.endpoint.served if self.endpoint is not None else 0

    def problem(self) -> str | None:
        """Why no group can come any more (None: the workers are running, or will be restarted)."""
        return self.fleet.problem() or (self.launcher.problem() if self.launcher else None)

    def dataset(self) -> Any:
        """The trainer's prompts: placeholders, one per rollout a step takes (its groups come from run-api)."""
        from datasets import Dataset

        return Dataset.from_list(
            [{"prompt": [{"role": "user", "content": "a group from run-api"}]}] * self.cfg.num_tasks
        )

    def rollout_func(self) -> Any:
        return atropos_rollout_func(self.queue, self.cfg.num_rollouts_per_task, self.cfg.max_completion_length)

    def callbacks(self, trainer_model: Any) -> list[TrainerCallback]:
        """Weight sync after each step and at the start (TRL's own on vLLM); the queue's counts in each step's log."""
        syncs = [] if self.cfg.vllm() else [SyncPolicy(self.endpoint, trainer_model)]
        return [*syncs, QueueStats(self)]

    @contextlib.contextmanager
    def running(self, trainer: Any) -> Iterator[None]:
        """`run-api` and the policy endpoint up, the trainer registered, the env workers started, for the
        length of training; everything stopped after (launched workers last: they end with the endpoint)."""
        cfg = self.cfg
        if self.endpoint is None:
            self.endpoint = PolicyEndpoint.on_vllm(trainer, cfg.max_completion_length, host=cfg.serve_host)
        with contextlib.ExitStack() as stack:
            if self.launcher is not None:
                stack.callback(self.launcher.stop)
            stack.enter_context(self.endpoint)
            stack.enter_context(self.fleet)  # Its workers stop before the endpoint.
            stack.enter_context(contextlib.closing(self.api))
            self.api.wait_until_up()
            per_step = cfg.batch_size * cfg.gradient_accumulation_steps * trainer.accelerator.num_processes
            max_len = cfg.max_completion_length + 8192  # Prompts (tool schemas) plus the completion cap.
            self.api.register(per_step, max_len, cfg.total_steps, 0, str(self.fleet.log_dir))
            if self.launcher is not None:
                self.launcher.start(self.fleet.api_url, self.endpoint.url)
            else:
                self.fleet.start_workers(self.endpoint.url)
            yield

    def summary(self) -> dict[str, Any]:
        """For the run's manifest: groups refused by reason, the trained groups' age, worker restarts."""
        ages = self.queue.ages
        return {
            "atropos": {
                "groups_trained": len(ages),
                "mean_age_steps": statistics.fmean(ages) if ages else None,
                "refused": dict(self.queue.refused),
                "worker_restarts": sum(self.fleet.restarts.values()),
                "endpoint_replies": self.replies(),
            }
        }


class SyncPolicy(TrainerCallback):
    """Loads the trainer's weights into the policy endpoint at the start of training and after every step."""

    def __init__(self, endpoint: PolicyEndpoint, trainer_model: Any) -> None:
        self.endpoint = endpoint
        self.trainer_model = trainer_model  # () -> the unwrapped model being trained.

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.endpoint.sync(self.trainer_model(), state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.endpoint.sync(self.trainer_model(), state.global_step)


class QueueStats(TrainerCallback):
    """Adds the groups refused so far (by reason), the trained groups' mean age and worker restarts to the log."""

    def __init__(self, mode: AtroposMode) -> None:
        self.mode = mode

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or "reward" not in logs:
            return
        summary = self.mode.summary()["atropos"]
        logs["atropos/groups_trained"] = summary["groups_trained"]
        logs["atropos/mean_age_steps"] = summary["mean_age_steps"]
        logs["atropos/worker_restarts"] = summary["worker_restarts"]
        for reason, count in summary["refused"].items():
            logs[f"atropos/refused/{reason}"] = count


def serve_env_workers(
    cfg: GRPORunConfig, model_dir: Path, api_url: str, policy_url: str, log_dir: Path, poll: float = 2.0
) -> dict[str, Any]:
    """The env workers of a trainer elsewhere (its `run-api` and policy endpoint), restarted when they
    die, until the endpoint has not answered `poll` seconds apart three times: the trainer is done.
    Raises when every worker has been given up."""
    import time

    import httpx

    require_isolation()
    with worker_fleet(cfg, model_dir, log_dir, api_url=api_url) as fleet:
        fleet.start_workers(policy_url)
        missed = 0
        with httpx.Client(timeout=5) as client:
            while missed < 3:
                if problem := fleet.problem():
                    raise RuntimeError(problem)
                time.sleep(poll)
                try:
                    client.get(f"{policy_url}/version").raise_for_status()
                    missed = 0
                except httpx.HTTPError:
                    missed += 1
    return {"workers": fleet.workers, "worker_restarts": sum(fleet.restarts.values())}
