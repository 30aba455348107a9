"""Checkpoints of every trainer: step checkpoints mirrored to the store, resume, and the stored final one.

A run with `save_steps` writes the Trainer's `checkpoint-N` folders (weights, optimizer,
scheduler, RNG, `trainer_state.json`) under `logs/run-*/checkpoints/` and mirrors the newest to
the store as `checkpoint/<output_name>-step-<key>`, where the key hashes the run's settings. A
re-run of the same settings (a killed stage re-run by the round) finds it, continues from the
step after it, and carries the logged history over, so no step repeats or goes missing. When
the NaN guard stops a run, the last good step checkpoint becomes the run's output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from flywheel.data import ArtifactStore, Manifest
from flywheel.training.config import TrainConfig
from flywheel.training.distributed import from_rank_zero, is_main, wait_for_everyone
from flywheel.training.models import TRAINING_TEMPLATE_FILE
from flywheel.training.run_logs import NonFiniteError, RunDir

logger = logging.getLogger(__name__)

# Settings that change neither the weights nor the data order: a run resumes across changes to them.
# What a step checkpoint holds beside the model: needed to resume, not to use the model.
_TRAINER_STATE = (
    "optimizer.pt",
    "scheduler.pt",
    "rng_state*.pth",
    "trainer_state.json",
    "training_args.bin",
    "global_step*",
)
_NOT_IN_KEY = {"resume", "logs_root", "report_to", "save_steps", "rollouts_every", "num_threads"}


def resume_key(cfg: TrainConfig) -> str:
    """Which runs may continue each other's checkpoints: those with equal training settings."""
    settings = cfg.model_dump(mode="json", exclude=_NOT_IN_KEY)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def step_ref(cfg: TrainConfig) -> str:
    return f"checkpoint/{cfg.output_name}-step-{resume_key(cfg)}"


class StepCheckpoints(TrainerCallback):
    """Mirrors each step checkpoint the Trainer saves to the store (rank 0), so a new machine can resume."""

    def __init__(self, store: ArtifactStore, cfg: TrainConfig, parents: list[str]) -> None:
        self.store, self.cfg, self.parents = store, cfg, parents

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        name = step_ref(self.cfg).removeprefix("checkpoint/")
        params = {"step": state.global_step, "total_steps": self.cfg.total_steps, "resume_key": resume_key(self.cfg)}
        self.store.put("checkpoint", name, folder, parents=self.parents, params=params)
        logger.info("step %d checkpoint mirrored to %s", state.global_step, step_ref(self.cfg))


def resume_from(store: ArtifactStore, cfg: TrainConfig, run: RunDir) -> Path | None:
    """The step checkpoint to continue from (copied into `run`, its logged history with it), or None."""
    mirrored = store.try_resolve(step_ref(cfg)) if cfg.resume and cfg.save_steps else None
    if mirrored is None:
        return None
    manifest = store.manifest(mirrored)
    step = int(manifest.params["step"])
    if step >= cfg.total_steps:  # That run finished: a re-run trains afresh.
        return None
    folder = run.checkpoints / f"checkpoint-{step}"
    if is_main(local=True):  # One copy per machine, into the run folder its ranks share.
        store.get(manifest.id, folder)
    wait_for_everyone()
    if is_main():
        history = json.loads((folder / "trainer_state.json").read_text()).get("log_history", [])
        for entry in history:
            metrics = {k: v for k, v in entry.items() if k != "step" and isinstance(v, int | float)}
            run.log_metrics(entry["step"], metrics)
    logger.info("resuming %s from its step-%d checkpoint", cfg.output_name, step)
    return folder


def train(trainer: Any, resume: Path | None) -> NonFiniteError | None:
    """`trainer.train()`, continuing from `resume`; a NaN/inf stop is returned for `finish` to handle."""
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except NonFiniteError as err:
        return err
    return None


def last_good_checkpoint(run: RunDir) -> Path | None:
    """The newest step checkpoint of this run (after a NaN/inf stop, the last finite one)."""
    folders = sorted(run.checkpoints.glob("checkpoint-*"), key=lambda p: int(p.name.rpartition("-")[2]))
    return folders[-1] if folders else None


def store_checkpoint(
    store: ArtifactStore,
    folder: Path,
    tokenizer: Any,
    run: RunDir,
    cfg: TrainConfig,
    model_dir: Path,
    parents: list[str],
    metrics: dict[str, Any],
) -> Manifest:
    """Store a model folder as `checkpoint/<output_name>` with lineage, and the run folder beside it."""
    tokenizer.save_pretrained(folder)
    if (model_dir / TRAINING_TEMPLATE_FILE).exists():
        (folder / TRAINING_TEMPLATE_FILE).write_text((model_dir / TRAINING_TEMPLATE_FILE).read_text())
    params = cfg.model_dump(mode="json")
    manifest = store.put("checkpoint", cfg.output_name, folder, parents=parents, params=params, metrics=metrics)
    store.put("run", cfg.output_name, run.path, parents=[manifest.id], metrics=metrics)
    return manifest


def finish(
    store: ArtifactStore,
    trainer: Any,
    run: RunDir,
    cfg: TrainConfig,
    model_dir: Path,
    parents: list[str],
    started: float,
    stopped: Exception | None = None,
    **metrics: Any,
) -> Manifest:
    """Store the trained policy (or, after `stopped`, the last good step checkpoint) with the run's metrics:
    once, by rank 0, after every rank took part in saving it (ZeRO-3 gathers the shards collectively);
    every rank returns the stored manifest."""
    main = trainer.is_world_process_zero()
    if stopped is None:
        folder = run.checkpoints / "final"
        trainer.save_model(str(folder))
    else:
        good = last_good_checkpoint(run)
        if good is None:
            raise stopped
        folder = run.checkpoints / "last-good"
        if main:
            shutil.copytree(good, folder, ignore=shutil.ignore_patterns(*_TRAINER_STATE))
        metrics["stopped_early"] = f"{stopped} (stored the step-{good.name.rpartition('-')[2]} checkpoint)"
        logger.warning("%s: storing the last good checkpoint, %s", cfg.output_name, good.name)
    metrics |= {
        "algorithm": cfg.algorithm,
        "steps": trainer.state.global_step,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "device": cfg.settings().device,
    }
    manifest = None
    if main:
        manifest = store_checkpoint(store, folder, trainer.processing_class, run, cfg, model_dir, parents, metrics)
        logger.info("%s %s: %s", cfg.algorithm, cfg.output_name, json.dumps(metrics, default=str))
    stored = from_rank_zero(manifest.id if manifest else None)
    return manifest or store.manifest(stored)


def model_parents(store: ArtifactStore, spec: str, *more: str | None) -> list[str]:
    """Lineage: the base model's artifact (a built-in's `model/<name>`, or a ref) and any input artifacts."""
    found = [store.try_resolve(f"model/{spec}", spec), *(store.resolve(m) for m in more if m)]
    return [p for p in found if p]
