"""Weakness mining: where does the model fail, with what confidence, and what to generate next.

Samples (agentic and lm-eval, flattened to `{source, category, difficulty, success, errors}`) are
grouped into slices — (source, category, difficulty), (source, category), tool, and error type —
each with its failure rate and a Wilson 95 % interval on success. A slice is flagged weak when it
has at least `min_samples` samples and the *upper* bound of its success rate is under
`threshold`: we are confident it is bad. The curriculum (`evaluation/curriculum.py`) turns the
env slices into the next round's data: what to generate, by whom, and what GRPO trains on.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any

from pydantic import BaseModel, Field

from flywheel.data import ArtifactStore, Manifest
from flywheel.data.columnar import read_rows, splits
from flywheel.environments.generate import GenerationPart
from flywheel.evaluation.curriculum import (
    SOURCES,
    CurriculumConfig,
    build_curriculum,
    grpo_mix,
    plan_generation,
    wilson,
)
from flywheel.evaluation.steering import steer_by_benchmarks


class MiningConfig(BaseModel):
    threshold: float = Field(default=0.5, gt=0, le=1, description="Weak: success upper bound below this.")
    min_samples: int = Field(default=5, ge=1, description="Slices with fewer samples are never flagged.")
    exemplars: int = Field(default=3, ge=0, description="Failure examples kept per weak slice.")


def flatten(source_kind: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Agentic samples (`env`, `reward`, `tool_errors`) or lm-eval samples (`task`, `success`) -> one shape."""
    out = []
    for s in samples:
        if source_kind == "agentic" and s.get("reward") is None:
            continue  # Infra failures say nothing about the model.
        errors = [_error_type(e.get("error", "")) for e in s.get("tool_errors") or []]
        out.append(
            {
                "source": s.get("env") or s.get("task") or "unknown",
                "category": s.get("category") or "unknown",
                "difficulty": s.get("difficulty") or "unknown",
                "success": bool(s.get("success")),
                "acted": made_tool_calls(s.get("messages")),
                "errors": errors,
                "item_id": s.get("item_id") or s.get("doc_id"),
                "excerpt": _excerpt(s),
            }
        )
    return out


def mine(
    samples: list[dict[str, Any]], config: MiningConfig | None = None, previous: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Ranked slices, the weak ones with exemplars, and per-slice history."""
    config = config or MiningConfig()
    slices: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        slices[f"{s['source']}|{s['category']}|{s['difficulty']}"].append(s)
        slices[f"{s['source']}|{s['category']}|*"].append(s)
        for error in set(s["errors"]):
            slices[f"{s['source']}|error:{error}|*"].append(s)
    rows = []
    for key, group in slices.items():
        n, wins = len(group), sum(s["success"] for s in group)
        low, high = wilson(wins, n)
        if key.split("|")[1].startswith("error:"):  # Share of tasks hitting this error: success = not hitting it.
            n_all = len([s for s in samples if s["source"] == key.split("|")[0]])
            low, high = wilson(n_all - n, n_all)
            n, wins = n_all, n_all - n
        weak = n >= config.min_samples and high < config.threshold
        rows.append(
            {
                "slice": key,
                "n": n,
                "success_rate": wins / n if n else 0.0,
                "failure_rate": 1 - wins / n if n else 0.0,
                "success_ci95": [round(low, 4), round(high, 4)],
                "weak": weak,
                "exemplars": [s["excerpt"] for s in group if not s["success"]][: config.exemplars] if weak else [],
            }
        )
    rows.sort(key=lambda r: (not r["weak"], r["success_ci95"][1], -r["n"], r["slice"]))
    history = dict((previous or {}).get("history", {}))
    for row in rows:
        history[row["slice"]] = [*history.get(row["slice"], []), round(row["failure_rate"], 4)]
    return {
        "slices": rows,
        "weak": [r["slice"] for r in rows if r["weak"]],
        "history": history,
    }


def policy_outcomes(store: ArtifactStore, rollouts: str) -> list[dict[str, Any]]:
    """One curriculum outcome per rollout of the `policy` parts of a round's generation: the champion
    solving (the env verifier's `meta.completed`) or failing a training task of a learnable or mastered slice.
    A slice held out once then needs its own rollouts, not more held-out luck, to count as mastered.
    Teacher parts say nothing about the model; rollouts lost to infra failures never reach the file."""
    manifest = store.manifest(rollouts)
    out = []
    for part in (GenerationPart(**part) for part in manifest.params.get("parts", [])):
        if part.label != SOURCES["learnable"] or part.split not in splits(manifest):
            continue  # A teacher part, or one that wrote no group.
        for group in read_rows(store, manifest.id, "rollouts", part.split):
            meta = group.get("meta") or {}
            row = {"source": part.env, "category": meta.get("category") or "unknown"}
            row["difficulty"] = meta.get("difficulty") or "unknown"
            completed = meta.get("completed") or []
            conversations = group.get("messages") or [None] * len(completed)
            out.extend(
                row | {"success": bool(done), "acted": made_tool_calls(messages)}
                for done, messages in zip(completed, conversations, strict=True)
            )
    return out


def made_tool_calls(messages: list[dict[str, Any]] | None) -> bool:
    """Whether a conversation made a tool call (an unknown one counts as made): a success without one
    (declining an irrelevance task) says nothing of whether the model can call tools."""
    if messages is None:
        return True
    return any(m.get("role") == "assistant" and m.get("tool_calls") for m in messages)


class CurriculumSpec(BaseModel):
    """What the curriculum covers: the round's envs (each with its categories), difficulty, budget."""

    families: dict[str, tuple[str, ...]] = Field(description="Env -> its task categories (the round's slices).")
    difficulty: str | None = Field(default=None, description="A fixed difficulty (None: easy first, then unlock).")
    groups: int = Field(
        default=32, ge=1, description="Generation groups to split over the slices to teach (replay comes on top)."
    )
    config: CurriculumConfig = Field(default_factory=CurriculumConfig)
    max_turns: int | None = Field(
        default=None, ge=1, description="The round's turn budget (a slice's is at least this)."
    )


def mine_to_store(
    store: ArtifactStore,
    eval_refs: list[str],
    config: MiningConfig | None = None,
    name: str = "weaknesses",
    curriculum: CurriculumSpec | None = None,
    previous: str | None = None,
    rollouts: str | None = None,
    carried_evals: list[str] | None = None,
) -> Manifest:
    """Mine every sample of the given eval artifacts into weaknesses.json; with a `curriculum` spec, also
    curriculum.json (each slice's class, the generation plan, the GRPO task mix, and each lm-eval task's
    score with the slices it weighted). `previous`: the last
    round's weaknesses artifact (slice history, unlocked difficulties); `rollouts`: the round's
    rollouts artifact, whose policy parts (the champion's own rollouts) are curriculum evidence too;
    `carried_evals`: the evals of a candidate the gate kept out, whose rollouts the next round carries
    (the slices it solved are `carried`, not taught again)."""
    samples, benchmark_samples = flat_samples(store, eval_refs)
    before = store.read_json(previous, "weaknesses.json") if previous else None
    result = mine(samples, config, before)
    files = {"weaknesses.json": json.dumps(result, indent=2)}
    metrics: dict[str, Any] = {"weak_slices": len(result["weak"]), "samples": len(samples)}
    if curriculum is not None:
        last = (stored_curriculum(store, previous) or {}) if previous else {}
        evidence = samples + (policy_outcomes(store, rollouts) if rollouts else [])
        carried = flat_samples(store, carried_evals)[0] if carried_evals else None
        slices = build_curriculum(
            evidence, curriculum.families, curriculum.config, last.get("slices"), curriculum.difficulty, carried
        )
        benchmarks = steer_by_benchmarks(slices, benchmark_samples, curriculum.config, last.get("benchmarks"))
        plan = {
            "slices": slices,
            "generate": plan_generation(slices, curriculum.groups, curriculum.config, curriculum.max_turns),
            "benchmarks": benchmarks,
        }
        plan["rl"] = grpo_mix(slices, curriculum.config)
        files["curriculum.json"] = json.dumps(plan, indent=2)
        classes = Counter(row["class"] for env in slices.values() for row in env["slices"])
        metrics |= {f"slices_{cls}": classes.get(cls, 0) for cls in ("unsolved", "learnable", "mastered", "locked")}
    parents = [store.resolve(ref) for ref in [*eval_refs, previous, rollouts, *(carried_evals or [])] if ref]
    params: dict[str, Any] = {"mining": (config or MiningConfig()).model_dump()}
    if carried_evals:  # Parents too, but not the champion's: `round_inputs` tells them apart by this.
        params["carried_evals"] = [store.resolve(ref) for ref in carried_evals]
    if curriculum is not None:
        params["curriculum"] = curriculum.model_dump()
    return store.put("weaknesses", name, files, parents=parents, params=params, metrics=metrics)


def flat_samples(store: ArtifactStore, eval_refs: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every sample of the eval artifacts, flattened (`flatten`), and the lm-eval ones among them."""
    samples, benchmark_samples = [], []
    for ref in eval_refs:
        manifest = store.manifest(ref)
        for relpath in sorted(p for p in manifest.files if p.startswith("samples/")):
            records = [json.loads(line) for line in store.read_bytes(manifest.id, relpath).decode().splitlines()]
            kind = "agentic" if records and "env" in records[0] else "lm-eval"
            samples.extend(flatten(kind, records))
            benchmark_samples.extend(flatten(kind, records) if kind == "lm-eval" else [])
    return samples, benchmark_samples


def stored_curriculum(store: ArtifactStore, ref: str) -> dict[str, Any] | None:
    """The curriculum.json of a weaknesses artifact (None: mined without a curriculum)."""
    manifest = store.manifest(ref)
    return store.read_json(manifest.id, "curriculum.json") if "curriculum.json" in manifest.files else None


def _error_type(error: str) -> str:
    text = error.lower()
    for key, label in (
        ("unknown tool", "unknown_tool"),
        ("outside the workspace", "path_escape"),
        ("missing required", "missing_argument"),
        ("could not parse", "parse_error"),
        ("not valid json", "parse_error"),
        ("no such file", "missing_file"),
    ):
        if key in text:
            return label
    return "other"


def _excerpt(sample: dict[str, Any]) -> dict[str, Any]:
    messages = sample.get("messages") or []
    last = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), None)
    return {
        "item_id": sample.get("item_id") or sample.get("doc_id"),
        "prompt": (sample.get("prompt") or next((m.get("content") for m in messages if m.get("role") == "user"), ""))[
            :300
        ],
        "response": str(last if last is not None else sample.get("response"))[:300],
    }
