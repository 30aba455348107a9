"""The results table: held-out success per round and env, lm-eval scores and the gate, from a store.

Round 0 is the base model; round n is that round's candidate, judged on the same held-out items
(successes / items scored; infra failures are left out, never counted as failures). `flywheel
round` ends with it, and `scripts/results_table.py` writes it into the README.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from flywheel.data import ArtifactStore
from flywheel.evaluation.report import agentic_counts
from flywheel.flows.flywheel import completed_rounds
from flywheel.flows.work import round_name

START, END = "<!-- results:start -->", "<!-- results:end -->"


def round_row(store: ArtifactStore, n: int) -> dict[str, Any]:
    """Round n's candidate: successes and items per env and overall, lm-eval scores, the gate's verdict."""
    decision = store.read_json(f"gate/{round_name('gate', n)}", "decision.json")
    envs, _ = agentic_counts(store, decision["candidate_evals"])
    lm_eval: dict[str, float] = {}
    for ref in decision["candidate_evals"]:
        results = store.read_json(ref, "results.json")
        if "per_env" not in results:  # An lm-eval artifact: one score a task.
            for task, values in results.get("results", {}).items():
                score = values.get("acc,none", values.get("exact_match,none"))
                if isinstance(score, float):
                    lm_eval[task] = score
    gate = "—" if n == 0 else ("promoted" if decision["promote"] else "kept out")
    if n and "primary_delta" in decision:
        gate += f", {decision['primary_delta']:+.3f} (P {decision['p_better']:.2f})"
    return {"envs": envs, "lm_eval": lm_eval, "gate": gate}


def results_table(store: ArtifactStore) -> str:
    """The markdown table of every finished round of `store` (round 0: the base model)."""
    if store.try_resolve(f"gate/{round_name('gate', 0)}") is None:
        return f"no round has finished in {store.url} yet"
    rows = [round_row(store, n) for n in range(completed_rounds(store) + 1)]
    envs = sorted({env for row in rows for env in row["envs"]})
    tasks = sorted({task for row in rows for task in row["lm_eval"]})
    header = ["round", "held-out success", *envs, *(f"lm-eval {t}" for t in tasks), "gate"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for n, row in enumerate(rows):
        counts = row["envs"]
        won, scored = sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())
        cells = ["base" if n == 0 else str(n), f"**{won / scored:.3f}** ({won}/{scored})" if scored else "—"]
        cells += [f"{counts[e][0]}/{counts[e][1]}" if e in counts else "—" for e in envs]
        cells += [f"{row['lm_eval'][t]:.2f}" if t in row["lm_eval"] else "—" for t in tasks]
        lines.append("| " + " | ".join([*cells, str(row["gate"])]) + " |")
    return "\n".join(lines)


def write_into(readme: Path, table: str) -> None:
    """Replace the text between the results markers in `readme` with `table`."""
    text = readme.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"error: {readme} has no {START} ... {END} markers")
    readme.write_text(pattern.sub(lambda _: f"{START}\n{table}\n{END}", text), encoding="utf-8")
