"""MinHash-LSH de-duplication keeps what the pairwise definition keeps (word-shingle Jaccard with any
row kept before it at least the threshold) on a corpus where the pairwise method is tractable and no
pair sits within the MinHash estimate's error (~0.02 at 128 permutations) of the threshold."""

from __future__ import annotations

import doctest
import random

from flywheel.data import dedup as dedup_module
from flywheel.data import text as text_module
from flywheel.data.dedup import Deduplicator
from flywheel.data.text import shingles


def pairwise_kept(texts: list[str], threshold: float, n: int) -> list[int]:
    """The definition, by comparing each row with every row kept so far."""
    kept: list[tuple[int, set[str]]] = []
    for number, text in enumerate(texts):
        own = shingles(text, n)
        if all(len(own & other) / len(own | other) < threshold for _, other in kept):
            kept.append((number, own))
    return [number for number, _ in kept]


def edited(words: list[str], rng: random.Random, changes: int) -> str:
    copy = list(words)
    for position in rng.sample(range(len(copy)), changes):
        copy[position] = f"edit{rng.randrange(10**6)}"
    return " ".join(copy)


def test_minhash_lsh_keeps_the_rows_the_pairwise_definition_keeps() -> None:
    rng = random.Random(0)
    texts = []
    for _ in range(60):
        words = [f"w{rng.randrange(50_000)}" for _ in range(400)]
        texts.append(" ".join(words))
        texts.append(edited(words, rng, 1))  # Jaccard ~0.975: a near-duplicate.
        texts.append(edited(words, rng, 24))  # ~0.55: a different row.
    rng.shuffle(texts)
    expected = pairwise_kept(texts, 0.9, 5)
    assert 100 < len(expected) < 160  # The corpus holds both kinds.
    dedup = Deduplicator(threshold=0.9, shingle_words=5)
    kept = [n for n, text in enumerate(texts) if dedup.duplicate(*dedup.fingerprint(str(n), text)) is None]
    assert kept == expected


def test_exact_duplicates_are_told_apart_from_near_ones() -> None:
    dedup = Deduplicator(threshold=0.9, shingle_words=5)

    def duplicate(key: str, text: str) -> str | None:
        return dedup.duplicate(*dedup.fingerprint(key, text))

    text = " ".join(f"w{i}" for i in range(400))  # One word changed: Jaccard 391/401.
    assert duplicate("a", text) is None
    assert duplicate("a", text) == "exact_duplicate"
    assert duplicate("b", text.replace("w50", "x")) == "near_duplicate"
    assert duplicate("c", "something else entirely") is None
    assert duplicate("d", "") is None and duplicate("e", "") == "near_duplicate"  # Both one empty shingle.


def test_doc_examples() -> None:
    for module in (dedup_module, text_module):
        failed, attempted = doctest.testmod(module)
        assert attempted >= 1 and failed == 0, module.__name__
