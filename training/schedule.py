"""A linear warm-up that never trains at learning rate 0.

transformers' linear schedule warms up as `step / warmup`, so its first optimizer step runs at lr 0
and changes nothing: a 2-step CPU GRPO made one update (its reported KL exactly 0) and SFT lost a
step. Here warm-up step `s` runs at `(s + 1) / (warmup + 1)` of the peak, then the rate decays
linearly to `1 / (total - warmup)` of it at the last step. The trainers get it through
`Trainer.create_scheduler`, the library's override point, which DeepSpeed's set-up calls too.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

T = TypeVar("T")


def warmup_factor(step: int, *, warmup: int, total: int) -> float:
    """Share of the peak learning rate at optimizer step `step` (0-based) of `total`, `warmup` of them warming up."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return max(0.0, (total - step) / max(1, total - warmup))


class FirstStepWarmup:
    """Mixed into a Trainer ahead of it: `warmup_factor` in place of the default linear schedule."""

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        from torch.optim.lr_scheduler import LambdaLR

        if self.lr_scheduler is None:  # type: ignore[attr-defined]
            warmup = self.args.get_warmup_steps(num_training_steps)  # type: ignore[attr-defined]
            factor = functools.partial(warmup_factor, warmup=warmup, total=num_training_steps)
            self.lr_scheduler = LambdaLR(optimizer or self.optimizer, factor)  # type: ignore[attr-defined]
            self._created_lr_scheduler = True
        return self.lr_scheduler  # type: ignore[attr-defined]


@functools.cache
def warming_up_from_the_first_step(trainer_class: type[T]) -> type[T]:
    """`trainer_class` (TRL's `SFTTrainer`, `GRPOTrainer`, `DPOTrainer`) with `FirstStepWarmup`'s schedule."""
    return type(trainer_class.__name__, (FirstStepWarmup, trainer_class), {})  # type: ignore[return-value]
