"""Training: model resolution (built-in models, store checkpoints), SFT, GRPO, DPO, `AtroposRunner`."""

from training.models import BUILTIN_MODELS, ModelError, prepare_model, resolve_model
from training.runner import AtroposRunner

__all__ = ["BUILTIN_MODELS", "AtroposRunner", "ModelError", "prepare_model", "resolve_model"]
