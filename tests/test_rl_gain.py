"""`benchmarks/rl_gain.py`'s figure, read back from the matplotlib objects: GRPO's reward per step,
its running mean and the KL."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from benchmarks.rl_gain import reward_figure


def test_the_figure_draws_each_steps_reward_its_running_mean_and_the_kl() -> None:
    steps = [{"step": i + 1, "reward": r, "kl": 0.01 * i} for i, r in enumerate([0.0, 0.5, 1.0, 0.5, 0.0])]
    figure = reward_figure(steps, "title", window=2)
    reward_axis, kl_axis = figure.axes
    dots, running = reward_axis.lines
    assert list(dots.get_xdata()) == [1, 2, 3, 4, 5]
    assert list(dots.get_ydata()) == [0.0, 0.5, 1.0, 0.5, 0.0]
    assert list(running.get_ydata()) == pytest.approx([0.0, 0.25, 0.75, 0.75, 0.25])
    assert list(kl_axis.lines[0].get_ydata()) == pytest.approx([0.0, 0.01, 0.02, 0.03, 0.04])
    assert len(reward_axis.get_legend().get_texts()) == 3
    plt.close(figure)
