"""Deterministic, endless task streams: item `i` of seed `s` is always the same task.

A task family is a function `make_task(rng, category, difficulty) -> dict`; the stream picks the
slice (category, difficulty) by the config's filters and the task mix from weakness mining, so
the next round can ask for more of a weak slice.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

DIFFICULTIES = ("easy", "medium", "hard")
MakeTask = Callable[[random.Random, str, str], dict[str, Any]]


class TaskStream:
    """Items of one env for one seed, drawn from weighted (category, difficulty) slices."""

    def __init__(
        self,
        env: str,
        make_task: MakeTask,
        categories: tuple[str, ...],
        seed: int,
        difficulty: str | None = None,
        only_categories: list[str] | None = None,
        mix: dict[str, float] | None = None,
    ) -> None:
        if difficulty is not None and difficulty not in DIFFICULTIES:
            raise ValueError(f"unknown difficulty '{difficulty}'; choose from {', '.join(DIFFICULTIES)}")
        unknown = sorted(set(only_categories or []) - set(categories))
        if unknown:
            raise ValueError(f"unknown categories {unknown} for {env}; known: {', '.join(categories)}")
        self.env = env
        self.make_task = make_task
        self.seed = seed
        self.slices = [
            (c, d) for c in (only_categories or categories) for d in ((difficulty,) if difficulty else DIFFICULTIES)
        ]
        mix = mix or {}
        self.weights = [max(0.0, mix.get(f"{c}/{d}", 1.0)) for c, d in self.slices]
        if not any(self.weights):
            raise ValueError(f"task_mix gives every slice of {env} zero weight")

    def item(self, index: int) -> dict[str, Any]:
        """The task at `index`, with id, env, category, difficulty and seed filled in."""
        rng = random.Random(f"{self.env}:{self.seed}:{index}")
        category, difficulty = rng.choices(self.slices, weights=self.weights)[0]
        task = self.make_task(rng, category, difficulty)
        task.update(
            item_id=f"{self.env}-{self.seed}-{index}",
            env=self.env,
            category=category,
            difficulty=difficulty,
            seed=self.seed,
            index=index,
        )
        return task

    def items(self, count: int, start: int = 0) -> list[dict[str, Any]]:
        return [self.item(i) for i in range(start, start + count)]
