"""Task screening for GRPO: keep the tasks whose groups carry signal, before they cost a step.

A group whose rollouts all score the same (all solved, or all failed) has zero advantage: GRPO
spends a step's compute on it and learns nothing. Screening rolls each candidate task's group
once with the initial policy (DAPO's dynamic sampling, done up front) and keeps the tasks whose
rewards differ: the slices the policy *sometimes* solves. A slice (env / category / difficulty)
whose first `drop_after` groups all scored one same reward (mastered, or hopeless) is not
drawn again, so it costs little; a slice that has shown any variance stays in. The kept groups
were rolled with the weights step 1 starts from, so they are step 1's rollouts
(`flywheel.training.rollouts.agent_rollout_func(screened=...)`): only flat groups are extra.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flywheel.training.rollouts import Outcome, Task

logger = logging.getLogger(__name__)


@dataclass
class SliceScreen:
    """What screening saw of one slice."""

    groups: int = 0
    kept: int = 0
    rewards: list[float] = field(default_factory=list)
    dropped: bool = False

    def summary(self) -> dict[str, Any]:
        mean = statistics.fmean(self.rewards) if self.rewards else None
        return {"groups": self.groups, "kept": self.kept, "mean_reward": mean, "dropped": self.dropped}


@dataclass
class Screening:
    """Kept tasks with their screening groups, the flat ones, and per-slice counts."""

    kept: list[tuple[Task, list[Outcome]]] = field(default_factory=list)
    flat: list[tuple[Task, list[Outcome]]] = field(default_factory=list)
    slices: dict[str, SliceScreen] = field(default_factory=dict)
    draws: int = 0

    def summary(self) -> dict[str, Any]:
        """For the run's logs and the checkpoint's metrics."""
        return {
            "screened": len(self.kept) + len(self.flat),
            "kept": len(self.kept),
            "draws": self.draws,
            "slices": {name: s.summary() for name, s in sorted(self.slices.items())},
        }


def slice_of(task: Task) -> str:
    """`env/category/difficulty` of a task (`all` where an env's items do not say)."""
    item = task.item
    return f"{task.env.name}/{item.get('category') or 'all'}/{item.get('difficulty') or 'all'}"


def screen_tasks(
    draw: Callable[[], Task],
    roll: Callable[[list[Task]], list[Outcome]],
    group_size: int,
    needed: int,
    budget: int,
    drop_after: int = 2,
) -> Screening:
    """Screen up to `budget` tasks from `draw()` until `needed` have groups with differing rewards.

    `roll(tasks)` returns one outcome per task given (each task is given `group_size` times).
    A group with an infra failure (reward None) counts only its scored rollouts.
    """
    found = Screening()
    max_draws = 20 * budget  # Every slice dropped: stop drawing.
    while len(found.kept) < needed and len(found.kept) + len(found.flat) < budget and found.draws < max_draws:
        wanted = min(needed - len(found.kept), budget - len(found.kept) - len(found.flat))
        batch: list[Task] = []
        while len(batch) < wanted and found.draws < max_draws:
            task = draw()
            found.draws += 1
            if not found.slices.setdefault(slice_of(task), SliceScreen()).dropped:
                batch.append(task)
        if not batch:
            break
        outcomes = roll([task for task in batch for _ in range(group_size)])
        for index, task in enumerate(batch):
            group = outcomes[index * group_size : (index + 1) * group_size]
            _record(found, task, group, drop_after)
        dropped = sorted(name for name, s in found.slices.items() if s.dropped)
        logger.info("screening: %d kept of %d screened; slices dropped: %s", len(found.kept),
                    len(found.kept) + len(found.flat), ", ".join(dropped) or "none")  # fmt: skip
    return found


def _record(found: Screening, task: Task, group: list[Outcome], drop_after: int) -> None:
    stats = found.slices[slice_of(task)]
    rewards = [reward for _, reward, _ in group if reward is not None]
    stats.groups += 1
    stats.rewards.extend(rewards)
    if len(set(rewards)) > 1:
        found.kept.append((task, group))
        stats.kept += 1
    else:
        found.flat.append((task, group))
    stats.dropped = stats.groups >= drop_after and len(set(stats.rewards)) <= 1
