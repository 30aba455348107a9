"""Run logs in the standard layout, `logs/run-<date>/{metrics.jsonl, rollouts/, checkpoints/}`, plus the
Trainer callbacks that fill them and stop a run whose loss or reward stops being finite."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from flywheel.training.distributed import from_rank_zero, launched

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Training produced a NaN/inf loss or reward; the last good checkpoint is kept."""


class RunDir:
    """One run's folder: `logs/run-<date>-<time>-<name>/` with metrics, rollouts and checkpoints."""

    def __init__(self, root: Path | str = "logs", name: str = "train") -> None:
        stamp = from_rank_zero(datetime.now(UTC).strftime("%Y-%m-%d-%H%M%S"))  # One folder for every rank.
        self.path = Path(root) / f"run-{stamp}-{name}"
        for sub in ("rollouts", "checkpoints"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def rollouts(self) -> Path:
        return self.path / "rollouts"

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        with open(self.metrics_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def log_rollouts(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Sampled rollouts of a step, for periodic human review of rollouts."""
        rank = f"-rank{os.environ.get('RANK', 0)}" if launched() else ""  # Each rank rolls out its own share.
        path = self.rollouts / f"step-{step:06d}{rank}.jsonl"
        path.write_text("".join(json.dumps(s, ensure_ascii=False, default=str) + "\n" for s in samples))

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]


class MetricsCallback(TrainerCallback):
    """Appends every Trainer log (loss, reward, kl, ...) to the run's metrics.jsonl."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and state.is_world_process_zero:
            self.run.log_metrics(state.global_step, {k: v for k, v in logs.items() if isinstance(v, int | float)})


class NonFiniteGuard(TrainerCallback):
    """Stops training on a NaN/inf loss or reward, naming the step; earlier checkpoints stay."""

    watched = ("loss", "reward", "rewards/mean", "kl", "grad_norm")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        for key, value in (logs or {}).items():
            watched = any(key == w or key.endswith(f"/{w}") or key.startswith(w) for w in self.watched)
            if watched and isinstance(value, int | float) and not math.isfinite(value):
                raise NonFiniteError(
                    f"{key} became {value} at step {state.global_step}: training stopped; the last good "
                    f"checkpoint is kept in {args.output_dir}"
                )
