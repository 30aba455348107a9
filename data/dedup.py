"""Duplicate detection that streams: exact duplicates by hash, near-duplicates by MinHash-LSH.

A row is a near-duplicate when the Jaccard similarity of its word shingles with a row kept before
it reaches `threshold` - the pairwise definition, answered without comparing every pair. datasketch
computes each row's MinHash; an LSH band index finds the kept rows that may be that close (its
bands are chosen so a row exactly at the threshold is found with probability >= 99 %), and their
MinHash estimates decide (error ~ sqrt(J(1 - J) / num_perm): rows within a few hundredths of the
threshold can go either way). Per kept row the index holds its MinHash (4 bytes a permutation) and
12 bytes a band in sorted numpy runs, never its text: time linear in the rows, about 0.7 KB a kept
row at 128 permutations (datasketch's own `MinHashLSH` keeps Python sets per band, ~2.6 KB).
A `scope` partitions the near-duplicate search: rows of different scopes are never near-duplicates.
"""

from __future__ import annotations

import hashlib

import numpy as np
from datasketch import MinHash

from flywheel.data.text import shingles

RECALL_AT_THRESHOLD = 0.99
BLOCK = 4096  # Signatures a block.


class Deduplicator:
    """Says of each row, in order, whether it repeats one seen before (and remembers it if not)."""

    def __init__(self, threshold: float, shingle_words: int, num_perm: int = 128) -> None:
        self.threshold = threshold
        self.shingle_words = shingle_words
        self._template = MinHash(num_perm=num_perm)  # Its permutations, drawn once (seed 1), for every row.
        self.rows_per_band = band_rows(threshold, num_perm)
        self._bands = _BandIndex()
        self._signatures: list[np.ndarray] = []  # Blocks of BLOCK rows: grown without copying.
        self._kept = 0
        self._digests: set[bytes] = set()

    def fingerprint(self, exact_key: str, text: str) -> tuple[bytes, np.ndarray]:
        """What `duplicate` compares: a digest of `exact_key` and the MinHash of `text`'s shingles (the
        costly part, so it can run where the row is read, apart from the decisions)."""
        digest = hashlib.blake2b(exact_key.encode(), digest_size=16).digest()
        template = self._template
        minhash = MinHash(len(template), permutations=template.permutations, scheme=template.scheme)
        minhash.update_batch([shingle.encode() for shingle in shingles(text, self.shingle_words)])
        return digest, minhash.hashvalues.astype(np.uint32)

    def duplicate(self, digest: bytes, signature: np.ndarray, scope: bytes = b"") -> str | None:
        """`exact_duplicate` when the digest was seen, `near_duplicate` when the signature is within the
        threshold of a kept row's within the same `scope`, None for a new row (now kept)."""
        if digest in self._digests:
            return "exact_duplicate"
        self._digests.add(digest)
        keys = self._band_keys(signature, scope)
        for row in self._bands.rows(keys):
            if np.mean(self._signatures[row // BLOCK][row % BLOCK] == signature) >= self.threshold:
                return "near_duplicate"
        if self._kept % BLOCK == 0:
            self._signatures.append(np.empty((BLOCK, len(signature)), dtype=np.uint32))
        self._signatures[-1][self._kept % BLOCK] = signature
        self._bands.add(keys, self._kept)
        self._kept += 1
        return None

    def _band_keys(self, signature: np.ndarray, scope: bytes) -> np.ndarray:
        """One uint64 per band: its values and the scope hashed with the band's number (equal only within a
        band and a scope)."""
        r = self.rows_per_band
        starts = range(0, len(signature) - r + 1, r)
        keys = [_hash64(scope + signature[start : start + r].tobytes(), start) for start in starts]
        return np.array(keys, dtype=np.uint64)


def _hash64(data: bytes, salt: int) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=salt.to_bytes(2, "little")).digest(), "little")


def band_rows(threshold: float, num_perm: int) -> int:
    """Rows a band: the most (fewest false candidates) that still find a row at `threshold` with
    probability `RECALL_AT_THRESHOLD` in `num_perm // rows` bands: 1 - (1 - t^r)^b.

    >>> band_rows(0.9, 128), band_rows(0.5, 128)
    (10, 3)
    """
    return max(
        (r for r in range(1, num_perm + 1) if 1 - (1 - threshold**r) ** (num_perm // r) >= RECALL_AT_THRESHOLD),
        default=1,
    )


class _BandIndex:
    """Band key -> kept rows: sorted (key, row) numpy runs merged like a binomial heap (each entry is
    re-sorted O(log n) times), 12 bytes an entry, and a small dict of the latest entries."""

    BUFFER = 4096

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []
        self._buffer: dict[int, list[int]] = {}
        self._buffered = 0

    def rows(self, keys: np.ndarray) -> set[int]:
        found = {row for key in keys.tolist() for row in self._buffer.get(key, ())}
        for run_keys, run_rows in self._runs:
            left, right = np.searchsorted(run_keys, keys, "left"), np.searchsorted(run_keys, keys, "right")
            for start, stop in zip(left.tolist(), right.tolist(), strict=True):
                found.update(run_rows[start:stop].tolist())
        return found

    def add(self, keys: np.ndarray, row: int) -> None:
        for key in keys.tolist():
            self._buffer.setdefault(key, []).append(row)
        self._buffered += len(keys)
        if self._buffered >= self.BUFFER:
            self._flush()

    def _flush(self) -> None:
        pairs = [(key, row) for key, rows in self._buffer.items() for row in rows]
        run = (np.array([k for k, _ in pairs], dtype=np.uint64), np.array([r for _, r in pairs], dtype=np.uint32))
        self._buffer, self._buffered = {}, 0
        while self._runs and len(self._runs[-1][0]) <= len(run[0]):  # Merge equal-sized runs: log n of them.
            keys, rows = self._runs.pop()
            run = (np.concatenate([keys, run[0]]), np.concatenate([rows, run[1]]))
        order = np.argsort(run[0], kind="stable")
        self._runs.append((run[0][order], run[1][order]))
