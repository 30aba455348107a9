"""Training: model resolution (built-in models, store checkpoints), SFT, GRPO, DPO, `AtroposRunner`."""

from typing import Any

from flywheel.training.models import BUILTIN_MODELS, ModelError, prepare_model, resolve_model

__all__ = ["BUILTIN_MODELS", "AtroposRunner", "ModelError", "prepare_model", "resolve_model"]


def __getattr__(name: str) -> Any:
    """`AtroposRunner` on first use: it pulls in atroposlib (seconds), which the CLI's other commands never need."""
    if name == "AtroposRunner":
        from flywheel.training.runner import AtroposRunner

        return AtroposRunner
    raise AttributeError(f"module 'training' has no attribute '{name}'")
