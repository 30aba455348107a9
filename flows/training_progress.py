"""A training stage's steps as a Prefect progress bar and run-log lines: a Trainer callback, in a module
of its own so that only the training stages import transformers for it."""

from __future__ import annotations

import json
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from transformers import TrainerCallback


class ProgressArtifact(TrainerCallback):
    """A Prefect progress artifact that follows a Trainer's steps (SFT, GRPO)."""

    def __init__(self, key: str, description: str) -> None:
        self.artifact_id = create_progress_artifact(0.0, key=key, description=description)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.max_steps:
            update_progress_artifact(self.artifact_id, 100.0 * state.global_step / state.max_steps)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """The step's headline figures in the run log (the full set is in the run's metrics.jsonl)."""
        shown = {k: round(v, 4) for k, v in (logs or {}).items() if isinstance(v, int | float) and _headline(k)}
        if shown:
            get_run_logger().info("step %d: %s", state.global_step, json.dumps(shown))


def _headline(key: str) -> bool:
    return key in ("loss", "reward", "reward_std", "frac_reward_zero_std", "kl", "tokens_per_second") or (
        key.startswith("rewards/") and key.endswith(("/mean", "/std")) and key.count("/") == 2
    )
