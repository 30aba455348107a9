"""Training: model resolution (built-in models, store checkpoints), SFT, GRPO, DPO."""

from training.models import BUILTIN_MODELS, ModelError, prepare_model, resolve_model

__all__ = ["BUILTIN_MODELS", "ModelError", "prepare_model", "resolve_model"]
