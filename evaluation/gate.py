"""The promotion gate: a candidate becomes `champion` only if it wins on the same eval sets.

Per-item successes of candidate and champion are paired by (env, item_id, the task's digest). The primary metric
(overall agentic success) must improve with paired-bootstrap confidence; no guarded metric (each
env's success rate, each lm-eval task's accuracy) may drop by more than `tolerance` when the same
paired bootstrap is as sure that it dropped at all (an env of 18 held-out items loses 0.056 with one
item: noise, not a regression). The
decision and its numbers are stored as a `gate` artifact, and `champion` moves by compare-and-swap.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import defaultdict
from typing import Any

from pydantic import BaseModel, Field

from flywheel.data import ArtifactNotFound, ArtifactStore, Manifest, RefConflict


class GateConfig(BaseModel):
    tolerance: float = Field(
        default=0.05,
        ge=0,
        description="Max drop of any guarded metric; a larger one refuses the candidate when the paired "
        "bootstrap is `confidence` sure it dropped at all.",
    )
    confidence: float = Field(
        default=0.9,
        gt=0.5,
        lt=1,
        description="Bootstrap P(candidate > champion) a promotion requires, and P(worse) a guard's regression.",
    )
    bootstrap: int = Field(default=2000, ge=100, description="Bootstrap resamples.")
    seed: int = Field(default=0, description="Bootstrap seed.")


def paired_outcomes(store: ArtifactStore, eval_ref: str) -> dict[str, dict[str, float]]:
    """`{metric group: {item key: success}}` from an eval artifact's samples."""
    manifest = store.manifest(eval_ref)
    groups: dict[str, dict[str, float]] = defaultdict(dict)
    for relpath in sorted(p for p in manifest.files if p.startswith("samples/")):
        for line in store.read_bytes(manifest.id, relpath).decode().splitlines():
            sample = json.loads(line)
            if "env" in sample:
                if sample.get("reward") is None:
                    continue
                key, value = _item_key(sample), float(bool(sample["success"]))
                groups["primary"][key] = value
                groups[f"env/{sample['env']}"][key] = value
            else:
                groups[f"task/{sample['task']}"][_doc_key(sample)] = float(bool(sample["success"]))
    return groups


def _item_key(sample: dict[str, Any]) -> str:
    """`env:item_id#task_digest`: an item whose task changed between two evals (a changed task family)
    is not the same item. Samples from before digests were recorded pair by id alone."""
    digest = sample.get("task_digest")
    return f"{sample['env']}:{sample['item_id']}" + (f"#{digest}" if digest else "")


def _doc_key(sample: dict[str, Any]) -> str:
    """`doc_id#digest(prompt, target)`: a changed lm-eval task (suite version, size) pairs no document."""
    seen = json.dumps([sample.get("prompt"), sample.get("target")], sort_keys=True, default=str)
    return f"{sample['doc_id']}#{hashlib.sha256(seen.encode()).hexdigest()[:12]}"


def decide(
    candidate: dict[str, dict[str, float]], champion: dict[str, dict[str, float]], config: GateConfig | None = None
) -> dict[str, Any]:
    """Promote or not, with the numbers: primary difference and its bootstrap confidence, guard deltas."""
    config = config or GateConfig()
    rng = random.Random(config.seed)
    shared = sorted(set(candidate.get("primary", {})) & set(champion.get("primary", {})))
    if not shared:
        return {"promote": False, "reason": "no shared primary items between candidate and champion"}
    diffs = [candidate["primary"][k] - champion["primary"][k] for k in shared]
    mean = sum(diffs) / len(diffs)
    p_better = _p_positive(diffs, rng, config.bootstrap)
    guards = {}
    for group in sorted(set(candidate) & set(champion) - {"primary"}):
        keys = sorted(set(candidate[group]) & set(champion[group]))
        if keys:
            drops = [champion[group][k] - candidate[group][k] for k in keys]
            delta = -sum(drops) / len(keys)
            p_worse = None  # A drop within the tolerance is allowed unexamined.
            if delta < -config.tolerance:  # Its own stream: one guard's draws never move another's.
                p_worse = round(_p_positive(drops, random.Random(f"{config.seed}:{group}"), config.bootstrap), 4)
            guards[group] = {
                "delta": round(delta, 4),
                "n": len(keys),
                "p_worse": p_worse,
                "regressed": p_worse is not None and p_worse >= config.confidence,
            }
    regressed = [g for g, v in guards.items() if v["regressed"]]
    unguarded = sorted((set(candidate) | set(champion)) - set(guards) - {"primary"})  # No shared item: no guard.
    promote = mean > 0 and p_better >= config.confidence and not regressed
    if promote:
        reason = (
            f"primary +{mean:.3f} (P(better)={p_better:.2f}), no guard dropped more than {config.tolerance} "
            f"with P(worse) >= {config.confidence}"
        )
    elif regressed:
        reason = (
            f"guarded metrics regressed beyond {config.tolerance} (P(worse) >= {config.confidence}): "
            f"{', '.join(regressed)}"
        )
    else:
        reason = f"primary change {mean:+.3f} with P(better)={p_better:.2f} < {config.confidence}"
    if unguarded:
        reason += f"; not guarded (no shared items): {', '.join(unguarded)}"
    return {
        "promote": promote,
        "reason": reason,
        "primary_delta": round(mean, 4),
        "p_better": round(p_better, 4),
        "n_shared": len(shared),
        "guards": guards,
        "unguarded": unguarded,
    }


def _p_positive(diffs: list[float], rng: random.Random, resamples: int) -> float:
    """Paired bootstrap: the share of resamples of `diffs` whose sum is above 0."""
    return sum(sum(rng.choice(diffs) for _ in diffs) > 0 for _ in range(resamples)) / resamples


def gate(
    store: ArtifactStore,
    candidate_evals: list[str],
    candidate_model: str,
    config: GateConfig | None = None,
    name: str = "gate",
    champion_evals: list[str] | None = None,
    champion: str | None = None,
) -> Manifest:
    """Compare with the champion's evals (first round: promote), record the decision, move `champion`.

    `champion`: the model the candidate must beat (None: whatever `champion` points at now);
    `champion_evals`: its evals on the candidate's items (None: those recorded when it was promoted).
    `champion` moves by compare-and-swap from that model before the decision is stored, so a gate
    that loses a race records a refusal; a re-run finding the candidate already champion keeps it.
    """
    candidate = _merge(store, candidate_evals)
    champion_model = store.resolve(champion) if champion else store.try_resolve("champion")
    if champion_evals is None:
        champion_evals = recorded_evals(store, champion_model) if champion_model else []
    else:
        champion_evals = [store.resolve(ref) for ref in champion_evals]
    if champion_model is None:
        decision = {"promote": True, "reason": "no champion yet: the first candidate becomes champion"}
    else:
        decision = decide(candidate, _merge(store, champion_evals), config)
    candidate_id = store.resolve(candidate_model)
    candidate_eval_ids = [store.resolve(r) for r in candidate_evals]
    if decision["promote"] and store.try_resolve("champion") != candidate_id:
        try:
            store.set_ref("champion", candidate_id, expected=champion_model)
        except RefConflict:
            moved = store.try_resolve("champion")
            decision |= {"promote": False, "reason": f"champion moved to {str(moved)[:12]} while this gate ran"}
    decision |= {"candidate": candidate_id, "champion_before": champion_model, "candidate_evals": candidate_eval_ids}
    parents = candidate_eval_ids + champion_evals + [candidate_id]
    manifest = store.put(
        "gate",
        name,
        {"decision.json": json.dumps(decision, indent=2)},
        parents=parents,
        params=(config or GateConfig()).model_dump(),
        metrics={"promote": decision["promote"]},
    )
    if decision["promote"]:
        store.set_ref("champion-evals", manifest.id)
    return manifest


def _merge(store: ArtifactStore, refs: list[str]) -> dict[str, dict[str, float]]:
    merged: dict[str, dict[str, float]] = defaultdict(dict)
    for ref in refs:
        for group, values in paired_outcomes(store, ref).items():
            merged[group].update(values)
    return merged


def shares_items(store: ArtifactStore, candidate_evals: list[str], champion_evals: list[str]) -> bool:
    """Whether the two sets of evals judged any primary item in common (else a changed profile or
    held-out set: the champion must be judged again on the candidate's items for a fair gate)."""
    candidate = _merge(store, candidate_evals).get("primary", {})
    return bool(set(candidate) & set(_merge(store, champion_evals).get("primary", {})))


def recorded_evals(store: ArtifactStore, model_id: str) -> list[str]:
    """The eval artifacts the gate recorded when `model_id` was promoted."""
    try:
        decision = store.read_json("champion-evals", "decision.json")
    except ArtifactNotFound:
        return []
    return decision["candidate_evals"] if decision.get("candidate") == model_id else []
