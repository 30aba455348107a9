"""Algorithm -> (config class, runner): the one table `flywheel train`, `AtroposRunner` and the round use.

    cfg = load_run_config("training/configs/grpo_tiny.yaml", ["total_steps=20"])
    manifest = run_training(cfg, store)

Configs live beside their trainers (TRL-style); this module only names them and imports the
one a run asks for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.data import ArtifactStore, Manifest
from flywheel.training.config import ConfigError, TrainConfig, read_config, validate_config


@dataclass(frozen=True)
class Algorithm:
    """Where an algorithm's config class and runner function live (`module:name`), and what it does
    (the help of its `flywheel train` command)."""

    config: str
    runner: str
    summary: str

    def config_class(self) -> type[TrainConfig]:
        return _load(self.config)

    def runner_function(self) -> Any:
        return _load(self.runner)


ALGORITHMS: dict[str, Algorithm] = {
    "sft": Algorithm(
        "flywheel.training.sft_config:SFTRunConfig",
        "flywheel.training.sft:run_sft",
        "Supervised fine-tuning on a curated dataset artifact.",
    ),
    "grpo": Algorithm(
        "flywheel.training.grpo_config:GRPORunConfig",
        "flywheel.training.grpo:run_grpo",
        "Online RL (GRPO) on the environments, KL to a reference.",
    ),
    "dpo": Algorithm(
        "flywheel.training.dpo:DPORunConfig",
        "flywheel.training.dpo:run_dpo",
        "Preference optimisation (DPO) on curated pairs, or on pairs sampled online from the envs.",
    ),
}
NOT_SHIPPED = {
    "ppo": "algorithm=ppo is not available: TRL 1.16 ships no PPOTrainer (not even in trl.experimental). "
    "Use algorithm=grpo (online RL on the environments) or algorithm=dpo (preference pairs, stored or sampled online)."
}


def algorithm(name: str) -> Algorithm:
    """The registered algorithm `name`, or a `ConfigError` naming the ones there are."""
    if name in NOT_SHIPPED:
        raise ConfigError(NOT_SHIPPED[name])
    if name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm '{name}': choose {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def load_run_config(path: str | Path | None, overrides: list[str] | None = None, default: str = "grpo") -> TrainConfig:
    """The config a YAML file plus `key=value` overrides describe, of the class its `algorithm` names."""
    data = read_config(path, overrides)  # A broken file fails here, before a trainer module is imported.
    name = data["algorithm"] if isinstance(data.get("algorithm"), str) else default
    return validate_config(algorithm(name).config_class(), data, path)


def run_training(cfg: TrainConfig, store: ArtifactStore, **kwargs: Any) -> Manifest:
    """Run `cfg` with its algorithm's trainer (`kwargs`: callbacks, and envs for RL)."""
    return algorithm(cfg.algorithm).runner_function()(cfg, store, **kwargs)


def _load(location: str) -> Any:
    module, _, name = location.partition(":")
    return getattr(importlib.import_module(module), name)
