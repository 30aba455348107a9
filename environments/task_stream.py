"""Deterministic, endless task streams: item `i` of seed `s` is always the same task.

A task family is a function `make_task(rng, category, difficulty) -> dict`; the stream picks the
slice (category, difficulty) by the config's filters and the task mix from the curriculum, so
the next round can ask for more of a weak slice. Slices follow their weights exactly, not by
chance: after any n items each slice has had its share of n, rounded (a weighted round robin),
so a held-out set with no mix is stratified and a generation budget is split as the mix says.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any

DIFFICULTIES = ("easy", "medium", "hard")
HORIZON_SLACK = 1.5  # A task's turn budget over its oracle's calls: room for a slip.
MakeTask = Callable[[random.Random, str, str], dict[str, Any]]


def turn_budget(oracle_calls: int, base: int) -> int:
    """Model calls a task may take: the round's `base`, or its horizon where that is longer (1.5 x the
    calls of its oracle, a procedure a student can imitate).

    >>> turn_budget(3, base=6), turn_budget(11, base=6)
    (6, 17)
    """
    return max(base, math.ceil(HORIZON_SLACK * oracle_calls))


def weighted_round_robin(weights: list[float]) -> Iterator[int]:
    """Endless indices into `weights`, each next one the furthest below its share so far (ties: the
    first), so after any n draws every index has had its share of n, rounded; weight 0 never comes.

    >>> import itertools; list(itertools.islice(weighted_round_robin([2, 1, 0]), 6))
    [0, 1, 0, 0, 1, 0]
    """
    total = sum(weights)
    if total <= 0:
        raise ValueError("weighted_round_robin needs a positive weight")
    counts = [0] * len(weights)
    n = 0
    while True:
        n += 1
        chosen = max(range(len(weights)), key=lambda i: (weights[i] > 0, weights[i] / total * n - counts[i], -i))
        counts[chosen] += 1
        yield chosen


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
        # Easiest first, categories interleaved: a held-out set of a few items covers every category's easy slice.
        self.slices = [
            (c, d) for d in ((difficulty,) if difficulty else DIFFICULTIES) for c in (only_categories or categories)
        ]
        mix = mix or {}
        self.weights = [max(0.0, mix.get(f"{c}/{d}", 1.0)) for c, d in self.slices]
        if not any(self.weights):
            raise ValueError(f"task_mix gives every slice of {env} zero weight")
        self._order = weighted_round_robin(self.weights)
        self._schedule: list[int] = []  # Slice index of each item drawn so far.

    def slice_of(self, index: int) -> tuple[str, str]:
        """(category, difficulty) of item `index`: the slice furthest below its share so far."""
        while len(self._schedule) <= index:
            self._schedule.append(next(self._order))
        return self.slices[self._schedule[index]]

    def item(self, index: int) -> dict[str, Any]:
        """The task at `index`, with id, env, category, difficulty and seed filled in."""
        rng = random.Random(f"{self.env}:{self.seed}:{index}")
        category, difficulty = self.slice_of(index)
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
