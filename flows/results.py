"""The results tables, from a store: held-out success per round and env, lm-eval scores and the gate;
per env and difficulty; and what each round's curriculum taught.

Round 0 is the base model; round n is that round's candidate, judged on the same held-out items
(successes / items scored; infra failures are left out, never counted as failures). `flywheel
round` ends with the first, `scripts/results_table.py` writes it into the README and prints all three
for `docs/runs.md` (`--runs`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from flywheel.data import ArtifactStore
from flywheel.environments.task_stream import DIFFICULTIES
from flywheel.evaluation.report import agentic_counts
from flywheel.evaluation.weakness import stored_curriculum
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


def difficulty_table(store: ArtifactStore) -> str:
    """Held-out successes per env (rows) and round (columns), as `easy · medium · hard`."""
    rounds = range(completed_rounds(store) + 1)
    per_round = [_slice_counts(store, n) for n in rounds]
    envs = sorted({key.split("/")[0] for counts in per_round for key in counts})
    header = ["env (easy · medium · hard)", *("base" if n == 0 else f"round {n}" for n in rounds)]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * len(rounds)]
    for env in envs:
        cells = []
        for counts in per_round:
            levels = [[0, 0] for _ in DIFFICULTIES]
            for key, (won, scored) in counts.items():
                name, _, level = key.split("/")
                if name == env and level in DIFFICULTIES:
                    levels[DIFFICULTIES.index(level)][0] += won
                    levels[DIFFICULTIES.index(level)][1] += scored
            cells.append(" · ".join(f"{won}/{scored}" for won, scored in levels))
        lines.append(f"| {env} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _slice_counts(store: ArtifactStore, n: int) -> dict[str, list[int]]:
    decision = store.read_json(f"gate/{round_name('gate', n)}", "decision.json")
    return agentic_counts(store, decision["candidate_evals"])[1]


def curriculum_table(store: ArtifactStore) -> str:
    """What each round's mining planned for the next round (generation groups a slice: the teacher's
    demonstrations, the champion's own rollouts, replay of mastered slices; slices carried from a
    kept-out round; difficulties unlocked) and what that round trained on (SFT rows and steps, GRPO steps)."""
    header = "| mined after | teacher | champion's rollouts | replay | carried | unlocked | next round's SFT; GRPO |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for n in range(completed_rounds(store) + 1):
        mined = store.try_resolve(f"weaknesses/{round_name('weaknesses', n)}")
        curriculum = (stored_curriculum(store, mined) or {}).get("slices") if mined else None
        if not curriculum:
            continue
        cells: dict[str, list[str]] = {"unsolved": [], "learnable": [], "mastered": [], "carried": [], "unlocked": []}
        for env, spec in curriculum.items():
            for row in spec["slices"]:
                name = f"{env}/{row['slice']}"
                if row.get("carried"):
                    cells["carried"].append(f"{name} ({row['carried']})")
                elif row.get("groups") and row["class"] in cells:
                    cells[row["class"]].append(f"{name} {row['groups']}")
            cells["unlocked"] += [f"{env}/{name}" for name in spec.get("newly_unlocked", [])]
        trained = _trained(store, n + 1)
        columns = ("unsolved", "learnable", "mastered", "carried", "unlocked")
        row_cells = [", ".join(cells[c]) or "—" for c in columns]
        lines.append(f"| round {n} | " + " | ".join([*row_cells, trained]) + " |")
    return "\n".join(lines)


def _trained(store: ArtifactStore, n: int) -> str:
    """Round n's SFT rows and steps and GRPO steps ("—": the round did not run)."""
    found = [store.try_resolve(f"{kind}/{round_name(what, n)}") for kind, what in
             (("dataset", "sft"), ("checkpoint", "sft"), ("checkpoint", "rl"))]  # fmt: skip
    if not all(found):
        return "—"
    dataset, sft, rl = (store.manifest(ref).metrics for ref in found)  # type: ignore[arg-type]
    return f"{dataset.get('sft_examples', 0)} rows, {sft.get('steps', 0)} steps; {rl.get('steps', 0)} steps"


def write_into(readme: Path, table: str) -> None:
    """Replace the text between the results markers in `readme` with `table`."""
    text = readme.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"error: {readme} has no {START} ... {END} markers")
    readme.write_text(pattern.sub(lambda _: f"{START}\n{table}\n{END}", text), encoding="utf-8")
