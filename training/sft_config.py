"""SFT's run config, apart from its trainer (TRL's layout): a round's config, `flywheel plan` and the CLI
read it without importing transformers or TRL."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from flywheel.training.config import TrainConfig


class SFTRunConfig(TrainConfig):
    """One SFT run: the shared training knobs plus what to train on."""

    algorithm: Literal["sft"] = Field(default="sft", description="Always sft.")
    dataset: str = Field(description="Store ref of a curated `dataset` artifact, or a local JSONL file.")
    learning_rate: float = Field(default=5e-5, gt=0, description="Peak learning rate.")
    batch_size: int = Field(default=8, ge=1, description="Per-device batch size.")
    total_steps: int = Field(default=20, ge=1, description="Optimizer steps.")
    max_length: int = Field(default=1024, ge=16, description="Tokens per example (see `overlong`).")
    overlong: Literal["drop", "truncate"] = Field(
        default="drop",
        description="A longer example: left out (a cut multi-turn conversation never shows its answer), or cut.",
    )
    output_name: str = Field(default="sft", description="Name of the checkpoint artifact.")


def sft_kwargs(cfg: SFTRunConfig, output_dir: Path | str) -> dict[str, Any]:
    """`SFTConfig` fields for the run's device (pure: `flywheel plan` shows them without a GPU)."""
    settings = cfg.settings()
    kwargs: dict[str, Any] = {
        **cfg.trainer_kwargs(output_dir),
        "max_length": cfg.max_length,
        # Assistant-only loss comes from our `assistant_masks` column (TRL turns it into labels); TRL's own
        # flag is for untokenised conversational datasets.
        "assistant_only_loss": False,
        "dataloader_num_workers": 0,
    }
    if settings.device == "cuda":
        kwargs["packing"] = True
    return kwargs
