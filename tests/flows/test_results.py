"""The results table (`flows/results.py`; `scripts/results_table.py` writes it into the README)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from flywheel.flows.results import END, START, curriculum_table, difficulty_table, results_table, write_into

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "results_table.py"


def _round(store: ArtifactStore, n: int, solved: dict[str, int], acc: float, decision: dict) -> None:
    """Round n in the store: an agentic eval (4 items an env, easy, medium, hard, easy; `solved` of them
    won, one infra failure), an lm-eval eval, the gate decision naming both, and the round's report."""
    levels = ("easy", "medium", "hard", "easy")
    samples = {
        f"samples/{env}.jsonl": "".join(
            json.dumps({"env": env, "category": "c", "difficulty": levels[i], "reward": float(i < k), "success": i < k})
            + "\n"
            for i in range(4)
        )
        + json.dumps({"env": env, "category": "c", "difficulty": "easy", "reward": None, "success": False})
        + "\n"
        for env, k in solved.items()
    }
    agentic = store.put("eval", f"agentic-r{n}", {"results.json": json.dumps({"per_env": {}}), **samples})
    lm = {"results": {"flywheel_tool_call": {"acc,none": acc, "acc_stderr,none": 0.1}}}
    lm_eval = store.put("eval", f"lm-eval-r{n}", {"results.json": json.dumps(lm)})
    body = decision | {"candidate_evals": [agentic.id, lm_eval.id]}
    store.put("gate", f"gate-r{n}", {"decision.json": json.dumps(body)})
    if n:
        store.put("report", f"report-r{n}", {"summary.md": "round"})


@pytest.fixture
def two_rounds(tmp_path: Path) -> ArtifactStore:
    store = ArtifactStore(tmp_path / "store")
    _round(store, 0, {"web_navigation": 0, "tool_use_chain": 0}, 0.0, {"promote": True})
    _round(store, 1, {"web_navigation": 1, "tool_use_chain": 4}, 0.25,
           {"promote": True, "primary_delta": 0.625, "p_better": 1.0})  # fmt: skip
    _round(store, 2, {"web_navigation": 2, "tool_use_chain": 3}, 0.5,
           {"promote": False, "primary_delta": 0.0, "p_better": 0.5})  # fmt: skip
    return store


def test_the_table_has_a_row_a_round_from_the_store(two_rounds: ArtifactStore) -> None:
    lines = results_table(two_rounds).splitlines()
    assert lines[0] == (
        "| round | held-out success | tool_use_chain | web_navigation | lm-eval flywheel_tool_call | gate |"
    )
    assert lines[2] == "| base | **0.000** (0/8) | 0/4 | 0/4 | 0.00 | — |"
    assert lines[3] == "| 1 | **0.625** (5/8) | 4/4 | 1/4 | 0.25 | promoted, +0.625 (P 1.00) |"
    assert lines[4] == "| 2 | **0.625** (5/8) | 3/4 | 2/4 | 0.50 | kept out, +0.000 (P 0.50) |"
    assert len(lines) == 5


def test_the_script_writes_between_the_markers_only(two_rounds: ArtifactStore, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{START}\nold table\n{END}\n\nAfter.\n")
    command = [sys.executable, str(SCRIPT), "--store", two_rounds.url, "--write", str(readme)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=SCRIPT.parents[1])
    assert done.returncode == 0, done.stderr
    text = readme.read_text()
    assert text.startswith("# Title\n\n") and text.endswith(f"{END}\n\nAfter.\n") and "old table" not in text
    assert results_table(two_rounds) in text
    runs = subprocess.run([*command[:4], "--runs"], capture_output=True, text=True, cwd=SCRIPT.parents[1])
    assert runs.returncode == 0 and difficulty_table(two_rounds) in runs.stdout, runs.stderr
    other = tmp_path / "other.md"
    other.write_text("no markers\n")
    with pytest.raises(SystemExit, match="has no <!-- results:start -->"):
        write_into(other, "t")
    assert other.read_text() == "no markers\n"


def test_the_runs_tables_split_by_difficulty_and_show_each_curriculum(two_rounds: ArtifactStore) -> None:
    """Per env, `easy · medium · hard` a round (the infra failure left out); per mined round, the groups of
    each source, the carried slices, the unlocks and what the next round trained on."""
    assert difficulty_table(two_rounds).splitlines() == [
        "| env (easy · medium · hard) | base | round 1 | round 2 |",
        "|---|---:|---:|---:|",
        "| tool_use_chain | 0/2 · 0/1 · 0/1 | 2/2 · 1/1 · 1/1 | 1/2 · 1/1 · 1/1 |",
        "| web_navigation | 0/2 · 0/1 · 0/1 | 1/2 · 0/1 · 0/1 | 1/2 · 1/1 · 0/1 |",
    ]
    rows = [
        {"slice": "a/easy", "class": "unsolved", "groups": 5},
        {"slice": "b/easy", "class": "unsolved", "groups": 0, "carried": "1/2"},
        {"slice": "c/easy", "class": "learnable", "groups": 3},
        {"slice": "d/easy", "class": "mastered", "groups": 2},
        {"slice": "a/medium", "class": "locked", "groups": 0},
    ]
    curriculum = {"slices": {"tool_use_chain": {"slices": rows, "newly_unlocked": ["d/medium"]}}}
    two_rounds.put("weaknesses", "weaknesses-r1", {"curriculum.json": json.dumps(curriculum)})
    two_rounds.put("weaknesses", "weaknesses-r0", {"weaknesses.json": "{}"})  # Mined without a curriculum.
    made = (("dataset", "sft-r2", {"sft_examples": 12}), ("checkpoint", "sft-r2", {"steps": 6}))
    for kind, name, metrics in made:
        two_rounds.put(kind, name, {"x": "1"}, metrics=metrics)
    lines = curriculum_table(two_rounds).splitlines()
    assert len(lines) == 3 and lines[2] == (
        "| round 1 | tool_use_chain/a/easy 5 | tool_use_chain/c/easy 3 | tool_use_chain/d/easy 2 "
        "| tool_use_chain/b/easy (1/2) | tool_use_chain/d/medium | — |"  # Round 2 ran no GRPO stage.
    )
    two_rounds.put("checkpoint", "rl-r2", {"x": "2"}, metrics={"steps": 2})
    assert curriculum_table(two_rounds).splitlines()[2].endswith("| 12 rows, 6 steps; 2 steps |")
