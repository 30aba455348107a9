"""Curation: scored rollout groups (Atropos') -> an SFT set, preference pairs and a data card.

It streams: groups pass one at a time, de-duplication is MinHash-LSH (`dedup.py`), decontamination an
n-gram index of the eval sets (`contamination.py`), and the datasets are written as Parquet shards
as their rows come (`columnar.py`): time linear in the rollouts, memory bounded by the index.

Filters, in order, each counted in the card:
1. `infra`: rollouts whose inference failed are never stored; groups with none left are counted.
2. `low_reward`: rollouts the env's verifier did not pass (`meta.completed`), or under `min_reward`
   (rejection sampling; groups without `completed` fall back to `score >= 1.0`).
3. `low_spread`: whole groups whose max-min score is under `min_group_spread`.
4. `not_top_n`: all but the best `top_n_per_group` of a group (ties: fewer turns first).
5. `exact_duplicate` / `near_duplicate`: same conversation, or word-shingle Jaccard >= threshold with
   a row of the same task (`content_digest`; rows without one: each other) kept before it. Two tasks a
   generator made from one template, solved by one procedure, are two examples of it, which is what
   SFT learns a procedure from: a global search took 4 of 5 teacher demonstrations of `todo_report`
   easy (their text is the template's, the files they list differ) and the round learnt nothing there.
6. `contaminated`: the task is an evaluation item's (equal `content_digest`: prompt, files and
   answer, whatever the ids), or its text has most of the n-grams that only one eval item has
   (n-grams two eval items, or two distinct training tasks, share are template text: a held-out set
   of many templates, a few items each or one, must not make every training task of a template look
   contaminated).
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from flywheel.data.columnar import (
    ShardMap,
    ShardWriter,
    format_params,
    item_order,
    read_rows,
    read_shard,
    shard_paths,
    splits,
)
from flywheel.data.contamination import ContaminationCheck, task_key
from flywheel.data.dedup import Deduplicator
from flywheel.data.errors import StoreError
from flywheel.data.store import ArtifactStore


class CurationConfig(BaseModel):
    """Knobs of rejection sampling, de-duplication, decontamination and pairing."""

    min_reward: float | None = Field(
        default=None, description="Also require at least this score (None: the verifier's pass is enough)."
    )
    top_n_per_group: int = Field(default=1, ge=1, description="Best rollouts kept per group.")
    min_group_spread: float = Field(default=0.0, ge=0, description="Drop groups whose max-min score is lower.")
    near_duplicate_jaccard: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Near-duplicate: word-shingle Jaccard with a kept row of the same task at least this.",
    )
    shingle_words: int = Field(default=5, ge=1, description="Words per shingle for near-duplicates.")
    minhash_permutations: int = Field(
        default=128, ge=16, description="MinHash size: the Jaccard estimate's error shrinks as 1/sqrt of it."
    )
    contamination_ngram: int = Field(default=8, ge=3, description="n for the contamination n-gram check.")
    contamination_overlap: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Share of an eval item's rare n-grams that flags a training item.",
    )
    boilerplate_items: int = Field(
        default=2,
        ge=2,
        description="n-grams in at least this many eval items, or distinct training tasks, are template text: "
        "what identifies an item is what no other has (a share of the set would let a template shared by a few "
        "of many items count).",
    )
    pair_min_gap: float = Field(default=0.5, ge=0, description="Min score gap between chosen and rejected.")


META_KEYS = ("item_id", "content_digest", "env", "category", "difficulty")  # What a row keeps of its group.


@dataclass
class CurationStats:
    """What the data card reports, counted as the rows stream past (nothing here grows with them)."""

    removed: Counter[str] = field(default_factory=Counter)
    groups_seen: int = 0
    rollouts_seen: int = 0
    reward_bins: Counter[int] = field(default_factory=Counter)
    per_slice: Counter[str] = field(default_factory=Counter)
    per_env: Counter[str] = field(default_factory=Counter)
    preference_pairs: int = 0

    def screened(self) -> dict[str, Any]:
        """What screening counted (a shard's share of the card)."""
        return {"removed": dict(self.removed), "groups_seen": self.groups_seen, "rollouts_seen": self.rollouts_seen,
                "reward_bins": dict(self.reward_bins)}  # fmt: skip

    def add_screened(self, screened: dict[str, Any]) -> None:
        self.removed.update(screened["removed"])
        self.groups_seen += screened["groups_seen"]
        self.rollouts_seen += screened["rollouts_seen"]
        self.reward_bins.update({int(b): n for b, n in screened["reward_bins"].items()})

    def card(self) -> dict[str, Any]:
        """Counts per slice, reward histogram and what each filter removed."""
        return {
            "groups_seen": self.groups_seen,
            "rollouts_seen": self.rollouts_seen,
            "sft_examples": sum(self.per_env.values()),
            "preference_pairs": self.preference_pairs,
            "removed": dict(self.removed),
            "per_slice": dict(sorted(self.per_slice.items())),
            "per_env": dict(sorted(self.per_env.items())),
            "reward_histogram": {f"{b / 10:.1f}-{(b + 1) / 10:.1f}": self.reward_bins.get(b, 0) for b in range(10)},
        }


@dataclass
class Candidate:
    """A row past the filters, waiting for de-duplication (`sft`: its fingerprint) and decontamination."""

    kind: str  # "sft" or "pairs"
    row: dict[str, Any]
    digest: bytes = b""
    signature: np.ndarray | None = None

    def to_record(self) -> dict[str, Any]:
        signature = self.signature.tolist() if self.signature is not None else None
        return {"kind": self.kind, "row": self.row, "digest": self.digest, "signature": signature}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Candidate:
        signature = record["signature"]
        return cls(
            record["kind"],
            record["row"],
            record["digest"],
            None if signature is None else np.array(signature, np.uint32),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_record() | {"digest": self.digest.hex()}, ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Candidate:
        record = json.loads(line)
        return cls.from_record(record | {"digest": bytes.fromhex(record["digest"])})


class Curator:
    """Curation that streams, in two steps that can run apart: `screen` a group (filters, fingerprints,
    the training task noted for decontamination) into candidates, then `select` from the candidates in
    order (de-duplication, decontamination). `add` and `rows()` do both here, the candidates waiting
    in a spool file, not in memory: decontamination needs every training task seen first (what two
    share is template). Sharded, each shard screens its groups and one merge selects (`curate_shards`)."""

    def __init__(
        self, eval_texts: Iterable[str], config: CurationConfig | None = None, eval_digests: set[str] | None = None
    ) -> None:
        self.config = config = config or CurationConfig()
        self.stats = CurationStats()
        self.dedup = Deduplicator(config.near_duplicate_jaccard, config.shingle_words, config.minhash_permutations)
        self.contamination = ContaminationCheck(
            eval_texts,
            config.contamination_ngram,
            config.contamination_overlap,
            config.boilerplate_items,
            eval_digests or set(),
        )
        self.tasks: dict[str, list[tuple[str, ...]]] = {}  # Training tasks screened: key -> eval n-grams in it.
        self._spool = tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115 - lives as long as self; rows() closes it.

    def add(self, group: dict[str, Any]) -> None:
        """Screen one group; its candidates wait in the spool."""
        for candidate in self.screen(group):
            self._spool.write(candidate.to_json() + "\n")

    def rows(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(`sft` | `pairs`, row) of the groups added, in order, de-duplicated and decontaminated."""
        self._spool.seek(0)
        yield from self.select(Candidate.from_json(line) for line in self._spool)
        self._spool.close()

    def screen(self, group: dict[str, Any]) -> Iterator[Candidate]:
        """Rejection sampling, spread and top-n of one scored group (counted in `stats`): its preference
        pair and SFT rows, each SFT row fingerprinted."""
        config, stats = self.config, self.stats
        stats.groups_seen += 1
        meta = group.get("meta") or {}
        if group.get("messages"):  # Only a task that shares n-grams with an eval item can change what is rare.
            text = _task_text(group["messages"][0])
            if grams := self.contamination.eval_grams_in(text):
                self.tasks.setdefault(task_key(text, meta.get("content_digest")), grams)
        scores = [float(s) for s in group.get("scores") or []]
        completed = meta.get("completed") or [s >= 1.0 for s in scores]
        rollouts = [
            {
                "messages": m,
                "score": s,
                "completed": bool(c),
                "turns": sum(1 for x in m if x.get("role") == "assistant"),
            }
            for m, s, c in zip(group.get("messages") or [], scores, completed, strict=False)
        ]
        stats.rollouts_seen += len(rollouts)
        stats.reward_bins.update(min(9, int(max(0.0, r["score"]) * 10)) for r in rollouts)
        if not rollouts:
            stats.removed["infra"] += 1
            return
        pair = preference_pair(rollouts, meta, config.pair_min_gap)
        if pair is not None:
            yield Candidate("pairs", pair)
        scores = [r["score"] for r in rollouts]
        if config.min_group_spread > 0 and max(scores) - min(scores) < config.min_group_spread:
            stats.removed["low_spread"] += len(rollouts)
            return
        floor = config.min_reward
        good = [r for r in rollouts if r["completed"] and (floor is None or r["score"] >= floor)]
        stats.removed["low_reward"] += len(rollouts) - len(good)
        good.sort(key=lambda r: (-r["score"], r["turns"]))
        stats.removed["not_top_n"] += max(0, len(good) - config.top_n_per_group)
        for rollout in good[: config.top_n_per_group]:
            row = _sft_row(rollout, meta)
            exact_key = json.dumps(row["messages"], sort_keys=True)
            yield Candidate("sft", row, *self.dedup.fingerprint(exact_key, _conversation_text(row["messages"])))

    def select(self, candidates: Iterable[Candidate]) -> Iterator[tuple[str, dict[str, Any]]]:
        """De-duplicate the SFT candidates against those kept before them and decontaminate every
        candidate against the tasks screened (here, or absorbed from the shards' `tasks`)."""
        self.contamination.absorb(self.tasks)
        for candidate in candidates:
            kind, row = candidate.kind, candidate.row
            if kind == "sft":
                assert candidate.signature is not None  # Every SFT candidate is fingerprinted.
                task = (row["meta"].get("content_digest") or "").encode()
                duplicate = self.dedup.duplicate(candidate.digest, candidate.signature, scope=task)
                if duplicate:
                    self.stats.removed[duplicate] += 1
                    continue
            meta = row["meta"]
            prompt = row["messages"] if kind == "sft" else row["prompt"]
            if self.contamination.contaminated(_task_text(prompt), meta.get("content_digest")):
                if kind == "sft":  # The card counts rollouts removed; a dropped pair is no rollout lost.
                    self.stats.removed["contaminated"] += 1
                continue
            if kind == "sft":
                self.stats.per_slice[f"{meta.get('env')}/{meta.get('category')}/{meta.get('difficulty')}"] += 1
                self.stats.per_env[meta.get("env")] += 1
            else:
                self.stats.preference_pairs += 1
            yield kind, row


@dataclass
class CurationResult:
    """A curation kept in memory (small sets, tests): the rows and the card's counts."""

    sft: list[dict[str, Any]]
    pairs: list[dict[str, Any]]
    stats: CurationStats

    @property
    def removed(self) -> Counter[str]:
        return self.stats.removed

    def card(self) -> dict[str, Any]:
        return self.stats.card()


def curate(
    groups: Iterable[dict[str, Any]],
    eval_texts: list[str],
    config: CurationConfig | None = None,
    eval_digests: set[str] | None = None,
) -> CurationResult:
    """Select SFT examples and preference pairs from scored groups (see module docstring), in memory;
    `eval_digests`: the held-out items' `content_digest`s."""
    curator = Curator(eval_texts, config, eval_digests)
    for group in groups:
        curator.add(group)
    kept: dict[str, list[dict[str, Any]]] = {"sft": [], "pairs": []}
    for kind, row in curator.rows():
        kept[kind].append(row)
    return CurationResult(kept["sft"], kept["pairs"], curator.stats)


def _sft_row(rollout: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [_clean(m) for m in rollout["messages"]],
        "tools": meta.get("tools") or [],
        "meta": {k: meta.get(k) for k in META_KEYS} | {"reward": rollout["score"]},
    }


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    """TRL's conversational format: tool-call arguments as dicts, no empty optional fields."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": _as_dict(call["function"].get("arguments")),
                },
            }
            for call in message["tool_calls"]
        ]
    if message["role"] == "tool" and message.get("name"):
        out["name"] = message["name"]
    return out


def _as_dict(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def preference_pair(rollouts: list[dict[str, Any]], meta: dict[str, Any], gap: float) -> dict[str, Any] | None:
    """Best vs worst of a group, split after the prompt (system + user), if their scores differ enough."""
    best = max(rollouts, key=lambda r: (r["score"], -r["turns"]))
    worst = min(rollouts, key=lambda r: (r["score"], r["turns"]))
    if best["score"] - worst["score"] < gap or best is worst:
        return None
    cut = next((i for i, m in enumerate(best["messages"]) if m.get("role") == "assistant"), len(best["messages"]))
    prompt = [_clean(m) for m in best["messages"][:cut]]
    return {
        "prompt": prompt,
        "chosen": [_clean(m) for m in best["messages"][cut:]],
        "rejected": [_clean(m) for m in worst["messages"][cut:]],
        "tools": meta.get("tools") or [],
        "meta": {k: meta.get(k) for k in META_KEYS}
        | {"chosen_reward": best["score"], "rejected_reward": worst["score"]},
    }


def _task_text(messages: list[dict[str, Any]]) -> str:
    """What defines the task: the user turns."""
    return "\n".join(m.get("content") or "" for m in messages if m.get("role") == "user")


def _conversation_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(
        (m.get("content") or "") + json.dumps(m.get("tool_calls") or "", sort_keys=True)
        for m in messages
        if m.get("role") != "system"
    )


def read_groups(store: Any, ref: str) -> Iterator[dict[str, Any]]:
    """The groups of a `rollouts` artifact, a part at a time, in task-stream order; a bad row is a
    clear error."""
    for shard in rollout_shards(store, [ref]):
        yield from shard_groups(store, shard)


def rollout_shards(store: Any, refs: list[str]) -> list[tuple[str, str]]:
    """(artifact id, file) of every shard of the rollouts, in reading order: a Parquet shard, or a
    whole JSONL part from before them."""
    shards = []
    for ref in refs:
        manifest = store.manifest(ref)
        for split in splits(manifest):
            legacy = f"{split}.jsonl"
            shards += [(manifest.id, path) for path in shard_paths(manifest, split) or [legacy]]
    return shards


def shard_groups(store: Any, shard: tuple[str, str]) -> Iterator[dict[str, Any]]:
    """One shard's groups; a JSONL part (in completion order) sorted like the Parquet ones."""
    ref, relpath = shard
    manifest = store.manifest(ref)
    where = f"{manifest.kind}/{manifest.name}:{relpath}"
    if relpath.endswith(".jsonl"):
        yield from sorted(_scored(read_rows(store, ref, "rollouts", relpath[:-6]), where), key=item_order)
    else:
        yield from _scored(read_shard(store, ref, relpath, "rollouts"), where)


def _scored(groups: Iterable[Any], where: str) -> Iterator[dict[str, Any]]:
    for number, group in enumerate(groups, start=1):
        if not isinstance(group, dict) or "scores" not in group or "messages" not in group:
            raise StoreError(f"{where} group {number} is not a scored group")
        yield group


def screen_shard(store_url: str, shard: tuple[str, str], *, config: CurationConfig, name: str) -> str:
    """Screen one rollouts shard into a `candidates` artifact (a task on any worker that reaches the
    store): its rows with fingerprints, what screening counted, the tasks noted for decontamination."""
    store = ArtifactStore(store_url)
    texts, digests, _ = eval_texts(store)
    curator = Curator(texts, config, digests)
    with tempfile.TemporaryDirectory(prefix="flywheel-screen-") as tmp:
        writer = ShardWriter(Path(tmp), "candidates", split="candidates")
        for group in shard_groups(store, shard):
            for candidate in curator.screen(group):
                writer.write(candidate.to_record())
        files: dict[str, Any] = {path.name: path for path in writer.close()}
        files["screened.json"] = json.dumps({"stats": curator.stats.screened(), "tasks": curator.tasks})
        # One ref a shard, of whichever rollouts artifact: `<sft>-screened-<rollouts>-<part>-00000`.
        shard_name = f"{name}-{store.manifest(shard[0]).name}-{Path(shard[1]).stem}"
        return store.put("candidates", shard_name, files, parents=[shard[0]], params=config.model_dump()).id


def eval_texts(store: Any) -> tuple[list[str], set[str], list[str]]:
    """Task texts and content digests of every `evalset` artifact in the store, each item once, and
    those artifacts' ids (for lineage). Once: every round stores its held-out set again, and an item
    counted twice would make all its n-grams "shared by two eval items" - template text - and turn
    the n-gram check off from the second round on."""
    texts, digests, ids, seen = [], set(), [], set()
    for manifest in store.list("evalset"):
        ids.append(manifest.id)
        for relpath in sorted(p for p in manifest.files if p.endswith(".jsonl")):
            for line in store.read_bytes(manifest.id, relpath).decode().splitlines():
                if line.strip():
                    record = json.loads(line)
                    messages = record.get("messages") or []
                    text = record.get("prompt") or record.get("text") or _task_text(messages) or line
                    if (key := record.get("content_digest") or text) not in seen:
                        seen.add(key)
                        texts.append(text)
                    if record.get("content_digest"):
                        digests.add(record["content_digest"])
    return texts, digests, ids


def curate_to_store(
    store: Any,
    rollout_refs: list[str],
    sft_name: str,
    pairs_name: str,
    config: CurationConfig | None = None,
    map_shards: ShardMap | None = None,
) -> tuple[Any, Any]:
    """Curate rollout artifacts into `dataset/<sft_name>` and `dataset/<pairs_name>` (Parquet shards
    and data cards), streaming: a rollouts shard, the index and a dataset shard in memory at a time.
    With `map_shards`, each rollouts shard is screened by it (`screen_shard`, e.g. on a cluster) and
    the candidates are selected here, in the same order: the same datasets either way."""
    config = config or CurationConfig()
    texts, digests, evalset_ids = eval_texts(store)
    curator = Curator(texts, config, digests)
    parents = [store.resolve(ref) for ref in rollout_refs] + evalset_ids
    if map_shards is None:
        for ref in rollout_refs:
            for group in read_groups(store, ref):
                curator.add(group)
        rows = curator.rows()
    else:
        screen = functools.partial(screen_shard, store.url, config=config, name=f"{sft_name}-screened")
        screened = map_shards(screen, rollout_shards(store, rollout_refs))
        for ref in screened:
            record = store.read_json(ref, "screened.json")
            curator.stats.add_screened(record["stats"])
            for key, grams in record["tasks"].items():
                curator.tasks.setdefault(key, grams)
        records = (row for ref in screened for row in read_rows(store, ref, "candidates", "candidates"))
        rows = curator.select(Candidate.from_record(record) for record in records)
        parents += screened
    with tempfile.TemporaryDirectory(prefix="flywheel-curate-") as tmp:
        writers = {kind: ShardWriter(Path(tmp, kind), kind) for kind in ("sft", "pairs")}
        for kind, row in rows:
            writers[kind].write(row)
        shards = {kind: writer.close() for kind, writer in writers.items()}
        card = curator.stats.card()
        cards = {"data_card.json": json.dumps(card, indent=2), "data_card.md": _card_md(card)}
        made = []
        for kind, name in (("sft", sft_name), ("pairs", pairs_name)):
            files = {path.name: path for path in shards[kind]} | cards
            params = config.model_dump() | format_params(kind)
            made.append(store.put("dataset", name, files, parents=parents, params=params, metrics=card))
    return made[0], made[1]


def _card_md(card: dict[str, Any]) -> str:
    lines = [
        "# Data card",
        "",
        f"{card['sft_examples']} SFT examples and {card['preference_pairs']} preference pairs from "
        f"{card['rollouts_seen']} rollouts in {card['groups_seen']} groups.",
        "",
        "| removed by | rollouts |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in sorted(card["removed"].items())],
        "",
        "| slice | examples |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in card["per_slice"].items()],
    ]
    return "\n".join(lines) + "\n"
