"""GRPO the Atropos way (`rl_mode: atropos`): env workers feed `run-api`, the trainer consumes it.

    trainer ── policy endpoint (a copy of the weights, synced each step) ◀── env workers (N processes)
       ▲                                                                        │ scored groups
       └──────────── checked groups (version, shape) ◀── run-api ◀──────────────┘

The env workers (`env_worker`) generate while the trainer trains: a group sampled with weights at
most `max_async_level` steps old is trained on, an older one refused (`trajectory_api`). The
trainer registers with `run-api` once its weights are loaded, then starts the workers; the
endpoint takes the trainer's weights after every optimizer step, and at the start of training (a
resumed run's step-k weights are version k, and groups its killed run left in `run-api` are
refused as stale).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from flywheel.training.env_fleet import EnvFleet
from flywheel.training.grpo import GRPORunConfig
from flywheel.training.policy_endpoint import PolicyEndpoint
from flywheel.training.run_logs import RunDir
from flywheel.training.trajectory_api import GroupQueue, RunApi, atropos_rollout_func


class AtroposMode:
    """The endpoint, fleet and group queue of one atropos-mode run, and what the trainer takes from them."""

    def __init__(self, cfg: GRPORunConfig, model_dir: Path, tokenizer: Any, run: RunDir) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.run = run
        self.endpoint: PolicyEndpoint | None = None
        self.fleet: EnvFleet | None = None
        self.queue: GroupQueue | None = None
        self._api: RunApi | None = None
        self._stack = contextlib.ExitStack()

    def dataset(self) -> Any:
        """The trainer's prompts: placeholders, one per rollout a step takes (its groups come from run-api)."""
        from datasets import Dataset

        return Dataset.from_list(
            [{"prompt": [{"role": "user", "content": "a group from run-api"}]}] * self.cfg.num_tasks
        )

    def start(self) -> None:
        """`run-api` and the policy endpoint (workers start once the trainer registered: `running`)."""
        cfg = self.cfg
        config = self.run.path / "atropos-run.json"
        config.write_text(cfg.model_dump_json())
        worker_args = ["--config", str(config), "--model-dir", str(self.model_dir)]
        self.fleet = self._stack.enter_context(EnvFleet(cfg.envs, cfg.env_workers, worker_args, self.run.path / "envs"))
        self.endpoint = self._stack.enter_context(
            PolicyEndpoint(self.model_dir, self.tokenizer, cfg.sampling_top_k(False), cfg.max_completion_length)
        )
        self._api = RunApi(self.fleet.api_url)
        self.queue = GroupQueue(self._api, cfg.num_rollouts_per_task, cfg.max_async_level, len(self.tokenizer))

    def rollout_func(self) -> Any:
        assert self.queue is not None, "start() first"
        return atropos_rollout_func(self.queue, self.cfg.num_rollouts_per_task, self.cfg.max_completion_length)

    def callbacks(self, trainer_model: Any) -> list[TrainerCallback]:
        """Weight sync after each step and at the start; the queue's counts in each step's log."""
        assert self.endpoint is not None and self.queue is not None, "start() first"
        return [SyncPolicy(self.endpoint, trainer_model), QueueStats(self.queue, self)]

    @contextlib.contextmanager
    def running(self, trainer: Any) -> Iterator[None]:
        """Register with run-api and start the env workers for the length of training; stop everything after."""
        assert self._api is not None and self.fleet is not None and self.endpoint is not None, "start() first"
        cfg = self.cfg
        try:
            self._api.wait_until_up()
            per_step = cfg.batch_size * cfg.gradient_accumulation_steps * trainer.accelerator.num_processes
            max_len = cfg.max_completion_length + 8192  # Prompts (tool schemas) plus the completion cap.
            self._api.register(per_step, max_len, cfg.total_steps, 0, str(self.run.path))
            self.fleet.start_workers(self.endpoint.url)
            yield
        finally:
            self.close()

    def close(self) -> None:
        self._stack.close()

    def summary(self) -> dict[str, Any]:
        """For the run's manifest: groups refused by reason, the trained groups' age, worker restarts."""
        queue, fleet = self.queue, self.fleet
        ages = queue.ages if queue else []
        return {
            "atropos": {
                "groups_trained": len(ages),
                "mean_age_steps": statistics.fmean(ages) if ages else None,
                "refused": dict(queue.refused) if queue else {},
                "worker_restarts": sum(fleet.restarts.values()) if fleet else 0,
                "endpoint_replies": self.endpoint.served if self.endpoint else 0,
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

    def __init__(self, queue: GroupQueue, mode: AtroposMode) -> None:
        self.queue = queue
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
