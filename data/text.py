"""The word tokenisation that de-duplication and decontamination share: lower-cased words and
punctuation marks, as n-grams (decontamination) or space-joined shingles (near-duplicates)."""

from __future__ import annotations

import re

_TOKEN = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Lower-cased words and single punctuation marks.

    >>> words("Run `wc -l`!")
    ['run', '`', 'wc', '-', 'l', '`', '!']
    """
    return _TOKEN.findall(text.lower())


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """Every run of `n` consecutive words (none in a text shorter than `n`)."""
    tokens = words(text)
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def shingles(text: str, n: int) -> set[str]:
    """The set of `n`-word shingles; a text shorter than `n` is one shingle (an empty one is `{""}`)."""
    tokens = words(text)
    return {" ".join(tokens[i : i + n]) for i in range(max(1, len(tokens) - n + 1))}
