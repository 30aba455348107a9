"""Benchmark weaknesses steer generation: an lm-eval task the champion has not mastered adds weight to
the env slices that train the same skill (`CurriculumConfig.teaches`), and the next round's record says
what its score did.

The weight a slice gains is `benchmark_weight` times the task's failure rate, on every unlocked slice
of the mapped categories, on top of its own (an unsolved slice 1, a learnable one 4p(1 - p), a
mastered one its replay), so a flywheel whose held-out slices are solved still generates for the
benchmark it fails. A task is mastered, and steers nothing, once the lower bound of its success
interval is over `high`, as a slice is.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from flywheel.evaluation.curriculum import CurriculumConfig, wilson


def steer_by_benchmarks(
    curriculum: dict[str, Any],
    benchmark_samples: list[dict[str, Any]],
    config: CurriculumConfig,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Add each unmastered lm-eval task's weight to the slices that teach it (`row["benchmark_weight"]`)
    and return, per task of `config.teaches` that ran, its score, interval, score per category, the
    slices it weighted and its score in the `previous` record (the last round's)."""
    outcomes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sample in benchmark_samples:
        outcomes[sample["source"]].append(sample)
    records = {}
    for task, targets in config.teaches.items():
        if not outcomes[task]:
            continue
        wins, n = sum(s["success"] for s in outcomes[task]), len(outcomes[task])
        low, high = wilson(wins, n, config.z)
        record: dict[str, Any] = {
            "success": round(wins / n, 4),
            "n": n,
            "ci": [round(low, 4), round(high, 4)],
            "categories": _by_category(outcomes[task]),
            "before": ((previous or {}).get(task) or {}).get("success"),
            "weighted": [],
        }
        if low <= config.high:
            boost = config.benchmark_weight * (1 - wins / n)
            for env, row in _teaching_rows(curriculum, targets):
                row["benchmark_weight"] = round(row.get("benchmark_weight", 0.0) + boost, 4)
                record["weighted"].append(f"{env}/{row['slice']}")
        records[task] = record
    return records


def _teaching_rows(curriculum: dict[str, Any], targets: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The unlocked slices of the `env/category` targets (a target env not in the round teaches nothing)."""
    rows = []
    for target in targets:
        env, _, category = target.partition("/")
        for row in curriculum.get(env, {}).get("slices", []):
            if row["slice"].split("/", 1)[0] == category and row["class"] != "locked":
                rows.append((env, row))
    return rows


def _by_category(samples: list[dict[str, Any]]) -> dict[str, float]:
    groups: dict[str, list[bool]] = defaultdict(list)
    for sample in samples:
        groups[sample["category"]].append(bool(sample["success"]))
    return {category: round(sum(hits) / len(hits), 4) for category, hits in sorted(groups.items())}
