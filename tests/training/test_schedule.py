"""The warm-up never trains at learning rate 0 (transformers' own linear warm-up starts there)."""

from __future__ import annotations

import pytest

from flywheel.training.schedule import warmup_factor


def test_every_step_trains_and_the_peak_comes_after_the_warmup() -> None:
    factors = [warmup_factor(step, warmup=2, total=6) for step in range(6)]
    assert factors == pytest.approx([1 / 3, 2 / 3, 1.0, 3 / 4, 2 / 4, 1 / 4])
    assert warmup_factor(0, warmup=1, total=2) == 0.5  # A CPU round's 2-step GRPO: both steps update.
    assert warmup_factor(0, warmup=0, total=4) == 1.0  # No warm-up: the peak at once.
