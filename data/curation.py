"""Curation: scored rollout groups (Atropos JSONL) -> an SFT set, preference pairs and a data card.

Filters, in order, each counted in the card:
1. `infra`: rollouts whose inference failed never reach the JSONL; groups with none left are counted.
2. `low_reward`: rollouts the env's verifier did not pass (`meta.completed`), or under `min_reward`
   (rejection sampling; groups without `completed` fall back to `score >= 1.0`).
3. `low_spread`: whole groups whose max-min score is under `min_group_spread`.
4. `not_top_n`: all but the best `top_n_per_group` of a group (ties: fewer turns first).
5. `exact_duplicate` / `near_duplicate`: same conversation, or word-shingle Jaccard >= threshold.
6. `contaminated`: the task is an evaluation item's (equal `content_digest`: prompt, files and
   answer, whatever the ids), or its text has most of the n-grams that only one eval item has
   (n-grams two eval items, or two distinct training tasks, share are template text: a held-out set
   of many templates, a few items each or one, must not make every training task of a template look
   contaminated).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field


class CurationConfig(BaseModel):
    """Knobs of rejection sampling, de-duplication, decontamination and pairing."""

    min_reward: float | None = Field(
        default=None, description="Also require at least this score (None: the verifier's pass is enough)."
    )
    top_n_per_group: int = Field(default=1, ge=1, description="Best rollouts kept per group.")
    min_group_spread: float = Field(default=0.0, ge=0, description="Drop groups whose max-min score is lower.")
    near_duplicate_jaccard: float = Field(default=0.9, gt=0, le=1, description="Near-duplicate threshold.")
    shingle_words: int = Field(default=5, ge=1, description="Words per shingle for near-duplicates.")
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
class CurationResult:
    sft: list[dict[str, Any]]
    pairs: list[dict[str, Any]]
    removed: Counter[str] = field(default_factory=Counter)
    groups_seen: int = 0
    rollouts_seen: int = 0
    rewards_seen: list[float] = field(default_factory=list)

    def card(self) -> dict[str, Any]:
        """Counts per slice, reward histogram and what each filter removed."""
        slices = Counter(
            f"{r['meta'].get('env')}/{r['meta'].get('category')}/{r['meta'].get('difficulty')}" for r in self.sft
        )
        bins = Counter(min(9, int(max(0.0, r) * 10)) for r in self.rewards_seen)
        return {
            "groups_seen": self.groups_seen,
            "rollouts_seen": self.rollouts_seen,
            "sft_examples": len(self.sft),
            "preference_pairs": len(self.pairs),
            "removed": dict(self.removed),
            "per_slice": dict(sorted(slices.items())),
            "per_env": dict(sorted(Counter(r["meta"].get("env") for r in self.sft).items())),
            "reward_histogram": {f"{b / 10:.1f}-{(b + 1) / 10:.1f}": bins.get(b, 0) for b in range(10)},
        }


def curate(
    groups: Iterable[dict[str, Any]],
    eval_texts: list[str],
    config: CurationConfig | None = None,
    eval_digests: set[str] | None = None,
) -> CurationResult:
    """Select SFT examples and preference pairs from scored groups (see module docstring);
    `eval_digests`: the held-out items' `content_digest`s."""
    config = config or CurationConfig()
    result = CurationResult(sft=[], pairs=[])
    candidates: list[dict[str, Any]] = []
    training_tasks: dict[str, str] = {}  # Task key -> task text, for what the generator's templates share.
    for group in groups:
        result.groups_seen += 1
        meta = group.get("meta") or {}
        if group.get("messages"):
            text = _task_text(group["messages"][0])
            training_tasks[meta.get("content_digest") or hashlib.sha256(text.encode()).hexdigest()] = text
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
        result.rollouts_seen += len(rollouts)
        result.rewards_seen.extend(r["score"] for r in rollouts)
        if not rollouts:
            result.removed["infra"] += 1
            continue
        pair = preference_pair(rollouts, meta, config.pair_min_gap)
        if pair is not None:
            result.pairs.append(pair)
        scores = [r["score"] for r in rollouts]
        if config.min_group_spread > 0 and max(scores) - min(scores) < config.min_group_spread:
            result.removed["low_spread"] += len(rollouts)
            continue
        floor = config.min_reward
        good = [r for r in rollouts if r["completed"] and (floor is None or r["score"] >= floor)]
        result.removed["low_reward"] += len(rollouts) - len(good)
        good.sort(key=lambda r: (-r["score"], r["turns"]))
        result.removed["not_top_n"] += max(0, len(good) - config.top_n_per_group)
        for rollout in good[: config.top_n_per_group]:
            candidates.append(_sft_row(rollout, meta))
    kept = _deduplicate(candidates, config, result.removed)
    checker = _ContaminationCheck(eval_texts, config, eval_digests or set(), training_tasks.values())
    for row in kept:
        if checker.contaminated(_task_text(row["messages"]), row["meta"].get("content_digest")):
            result.removed["contaminated"] += 1
        else:
            result.sft.append(row)
    result.pairs = [
        p for p in result.pairs if not checker.contaminated(_task_text(p["prompt"]), p["meta"].get("content_digest"))
    ]
    return result


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


def _deduplicate(rows: list[dict[str, Any]], config: CurationConfig, removed: Counter[str]) -> list[dict[str, Any]]:
    seen: set[str] = set()
    kept: list[dict[str, Any]] = []
    kept_shingles: list[set[str]] = []
    for row in rows:
        digest = hashlib.sha256(json.dumps(row["messages"], sort_keys=True).encode()).hexdigest()
        if digest in seen:
            removed["exact_duplicate"] += 1
            continue
        seen.add(digest)
        shingles = _shingles(_conversation_text(row["messages"]), config.shingle_words)
        if any(_jaccard(shingles, other) >= config.near_duplicate_jaccard for other in kept_shingles):
            removed["near_duplicate"] += 1
            continue
        kept.append(row)
        kept_shingles.append(shingles)
    return kept


class _ContaminationCheck:
    """A training task is contaminated when it is a held-out task (its content digest) or carries
    enough of a held-out item's rare n-grams. Rare: in fewer than `boilerplate_items` held-out items
    and in fewer than that many distinct training tasks (by digest, else by text): text the generator
    gives two different tasks is a template, not what identifies one (the digest check still catches
    the same task in other words). With one held-out item per category the first count alone would
    take a category's prompt template for that item's own text."""

    def __init__(
        self, eval_texts: list[str], config: CurationConfig, digests: set[str], training_texts: Iterable[str]
    ) -> None:
        self.n = config.contamination_ngram
        self.overlap = config.contamination_overlap
        grams = [set(_ngrams(text, self.n)) for text in eval_texts]
        df = Counter(g for doc in grams for g in doc)
        df_training = Counter(g for text in training_texts for g in set(_ngrams(text, self.n)))
        limit = config.boilerplate_items
        self.docs = [{g for g in doc if df[g] < limit and df_training[g] < limit} for doc in grams]
        self.digests = digests
        self.index: dict[tuple[str, ...], list[int]] = {}
        for number, doc in enumerate(self.docs):
            for gram in doc:
                self.index.setdefault(gram, []).append(number)

    def contaminated(self, text: str, digest: str | None = None) -> bool:
        if digest is not None and digest in self.digests:  # The same task, whatever its text.
            return True
        hits = Counter(number for gram in set(_ngrams(text, self.n)) for number in self.index.get(gram, ()))
        return any(count >= self.overlap * len(self.docs[number]) for number, count in hits.items())


def _task_text(messages: list[dict[str, Any]]) -> str:
    """What defines the task: the user turns."""
    return "\n".join(m.get("content") or "" for m in messages if m.get("role") == "user")


def _conversation_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(
        (m.get("content") or "") + json.dumps(m.get("tool_calls") or "", sort_keys=True)
        for m in messages
        if m.get("role") != "system"
    )


def _words(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text.lower())


def _ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    words = _words(text)
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def _shingles(text: str, n: int) -> set[str]:
    words = _words(text)
    return {" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def _jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def read_groups(store: Any, ref: str) -> list[dict[str, Any]]:
    """Every group in the JSONL files of a `rollouts` artifact; a bad line is a clear error."""
    from flywheel.data.errors import StoreError

    manifest = store.manifest(ref)
    groups = []
    for relpath in sorted(p for p in manifest.files if p.endswith(".jsonl")):
        for number, line in enumerate(store.read_bytes(manifest.id, relpath).decode().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                group = json.loads(line)
            except json.JSONDecodeError as err:
                raise StoreError(f"{manifest.kind}/{manifest.name}:{relpath} line {number} is not JSON: {err}") from err
            if not isinstance(group, dict) or "scores" not in group or "messages" not in group:
                raise StoreError(f"{manifest.kind}/{manifest.name}:{relpath} line {number} is not a scored group")
            groups.append(group)
    return groups


def eval_texts(store: Any) -> tuple[list[str], set[str], list[str]]:
    """Task texts and content digests of every `evalset` artifact in the store, and those
    artifacts' ids (for lineage)."""
    texts, digests, ids = [], set(), []
    for manifest in store.list("evalset"):
        ids.append(manifest.id)
        for relpath in sorted(p for p in manifest.files if p.endswith(".jsonl")):
            for line in store.read_bytes(manifest.id, relpath).decode().splitlines():
                if line.strip():
                    record = json.loads(line)
                    messages = record.get("messages") or []
                    texts.append(record.get("prompt") or record.get("text") or _task_text(messages) or line)
                    if record.get("content_digest"):
                        digests.add(record["content_digest"])
    return texts, digests, ids


def curate_to_store(
    store: Any, rollout_refs: list[str], sft_name: str, pairs_name: str, config: CurationConfig | None = None
) -> tuple[Any, Any]:
    """Curate rollout artifacts into `dataset/<sft_name>` and `dataset/<pairs_name>` (with data cards)."""
    config = config or CurationConfig()
    groups = [group for ref in rollout_refs for group in read_groups(store, ref)]
    # Groups are written in completion order; sorting makes the dataset (its hash, so every cache
    # key downstream) depend on what was generated, not on which rollout finished first.
    groups.sort(key=lambda group: str((group.get("meta") or {}).get("item_id", "")))
    texts, digests, evalset_ids = eval_texts(store)
    result = curate(groups, texts, config, digests)
    card = result.card()
    parents = [store.resolve(ref) for ref in rollout_refs] + evalset_ids
    common = {"parents": parents, "params": config.model_dump(), "metrics": card}
    sft = store.put(
        "dataset",
        sft_name,
        {
            "train.jsonl": _jsonl(result.sft),
            "data_card.json": json.dumps(card, indent=2),
            "data_card.md": _card_md(card),
        },
        **common,
    )
    pairs = store.put(
        "dataset",
        pairs_name,
        {"train.jsonl": _jsonl(result.pairs), "data_card.json": json.dumps(card, indent=2)},
        **common,
    )
    return sft, pairs


def _jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


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
