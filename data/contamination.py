"""Decontamination against the held-out sets, by an n-gram index of the eval items.

A training task is contaminated when it is a held-out task (its content digest) or carries enough
of a held-out item's rare n-grams. Rare: in fewer than `boilerplate_items` held-out items and in
fewer than that many distinct training tasks (by digest, else by text): text the generator gives
two different tasks is a template, not what identifies one (the digest check still catches the same
task in other words). With one held-out item per category the first count alone would take a
category's prompt template for that item's own text.

It streams: every training task's n-grams that the eval index holds (`eval_grams_in`, where the
task is read) are `absorb`ed first - memory follows the eval sets and the few tasks that share
their n-grams, not the training data - then rows are checked.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

from flywheel.data.text import ngrams


def task_key(text: str, digest: str | None = None) -> str:
    """A training task's identity: its content digest, else a hash of its text."""
    return digest or hashlib.sha256(text.encode()).hexdigest()[:32]


class ContaminationCheck:
    """The eval items' rare n-grams, and whether a training text carries most of one item's."""

    def __init__(self, eval_texts: Iterable[str], n: int, overlap: float, boilerplate_items: int, digests: set[str]):
        self.n, self.overlap, self.limit, self.digests = n, overlap, boilerplate_items, digests
        grams = [set(ngrams(text, n)) for text in eval_texts]
        df = Counter(gram for doc in grams for gram in doc)
        self._docs = [{gram for gram in doc if df[gram] < boilerplate_items} for doc in grams]
        self._candidates = set().union(*self._docs)  # The only n-grams training tasks are counted for.
        self._in_training: Counter[tuple[str, ...]] = Counter()  # Distinct training tasks per eval n-gram.
        self._tasks_seen: set[str] = set()
        self._index: dict[tuple[str, ...], list[int]] | None = None

    def eval_grams_in(self, text: str) -> list[tuple[str, ...]]:
        """The n-grams of `text` the eval index counts (all a training task can add to those counts)."""
        return sorted(gram for gram in set(ngrams(text, self.n)) if gram in self._candidates)

    def absorb(self, tasks: dict[str, list[tuple[str, ...]]]) -> None:
        """Count tasks observed elsewhere (`task_key` -> `eval_grams_in`), each distinct task once."""
        if self._index is not None:
            raise RuntimeError("absorb() after contaminated(): every training task must be seen first")
        for key, grams in tasks.items():
            if key not in self._tasks_seen:
                self._tasks_seen.add(key)
                self._in_training.update(tuple(gram) for gram in grams)

    def contaminated(self, text: str, digest: str | None = None) -> bool:
        if digest is not None and digest in self.digests:  # The same task, whatever its text.
            return True
        index = self._seal()
        hits = Counter(number for gram in set(ngrams(text, self.n)) for number in index.get(gram, ()))
        return any(count >= self.overlap * len(self._docs[number]) for number, count in hits.items())

    def _seal(self) -> dict[tuple[str, ...], list[int]]:
        """Drop the n-grams two training tasks share and index the rest (once, at the first check)."""
        if self._index is None:
            self._docs = [{gram for gram in doc if self._in_training[gram] < self.limit} for doc in self._docs]
            self._index = {}
            for number, doc in enumerate(self._docs):
                for gram in doc:
                    self._index.setdefault(gram, []).append(number)
        return self._index
