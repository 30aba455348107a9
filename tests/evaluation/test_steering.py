"""Benchmark weaknesses steer generation: an lm-eval task the champion fails weights the env slices that
teach its skill, a mastered one steers nothing, and the next round's record says what its score did."""

from __future__ import annotations

import json
from pathlib import Path

from flywheel.data import ArtifactStore
from flywheel.evaluation.curriculum import CurriculumConfig, build_curriculum, plan_generation
from flywheel.evaluation.report import _curriculum_markdown
from flywheel.evaluation.steering import steer_by_benchmarks
from flywheel.evaluation.weakness import CurriculumSpec, mine_to_store

FAMILIES = {
    "tool_use_chain": ("todo_report", "line_count", "csv_summary"),
    "function_calling": ("single", "parallel", "choose_or_refuse"),
}
CONFIG = CurriculumConfig(z=1.0)


def _rows(source: str, script: dict[tuple[str, str], tuple[int, int]]) -> list[dict]:
    """(category, difficulty) -> (wins, n) as mining's flat rows of `source` (an env or an lm-eval task)."""
    return [
        {"source": source, "category": category, "difficulty": difficulty, "success": i < wins}
        for (category, difficulty), (wins, n) in script.items()
        for i in range(n)
    ]


def _held_out() -> list[dict]:
    solved = {(c, "easy"): (3, 3) for c in FAMILIES["tool_use_chain"]}
    calls = {("single", "easy"): (3, 3), ("parallel", "easy"): (1, 2), ("choose_or_refuse", "easy"): (0, 3)}
    return _rows("tool_use_chain", solved) + _rows("function_calling", calls)


def test_a_failed_benchmark_weights_the_unlocked_slices_that_teach_it() -> None:
    benchmarks = (
        _rows("flywheel_tool_call", {("tool_call/terminal", "easy"): (0, 15), ("tool_call/search", "hard"): (3, 15)})
        + _rows("flywheel_tool_select", {("tool_select/search", "easy"): (28, 30)})
        + _rows("flywheel_reasoning", {("reasoning/arithmetic", "easy"): (0, 30)})
    )
    plain = build_curriculum(_held_out(), FAMILIES, CONFIG)
    steered = build_curriculum(_held_out(), FAMILIES, CONFIG)
    records = steer_by_benchmarks(steered, benchmarks, CONFIG, previous={"flywheel_tool_call": {"success": 0.05}})

    tool_call = records["flywheel_tool_call"]
    assert (tool_call["success"], tool_call["n"], tool_call["before"]) == (0.1, 30, 0.05)
    assert tool_call["categories"] == {"tool_call/search": 0.2, "tool_call/terminal": 0.0}
    # single/easy is mastered, so single/medium is unlocked; parallel/medium and every hard slice stay locked.
    assert tool_call["weighted"] == [
        "function_calling/single/easy", "function_calling/single/medium", "function_calling/parallel/easy",
    ]  # fmt: skip
    rows = {row["slice"]: row for row in steered["function_calling"]["slices"]}
    assert {s: row.get("benchmark_weight") for s, row in rows.items() if "benchmark_weight" in row} == dict.fromkeys(
        ["single/easy", "single/medium", "parallel/easy"], 0.9
    )  # 1 - 3/30 failed, times benchmark_weight 1.
    assert records["flywheel_tool_select"]["weighted"] == []  # 28 of 30: mastered, it steers nothing.
    assert "flywheel_reasoning" not in records  # No env of the shipped mapping teaches arithmetic.

    def groups(curriculum: dict) -> dict[str, int]:
        plan_generation(curriculum, groups=12, config=CONFIG)
        return {f"{env}/{row['slice']}": row["groups"] for env, spec in curriculum.items() for row in spec["slices"]}

    before, after = groups(plain), groups(steered)
    assert after["function_calling/single/medium"] > before["function_calling/single/medium"] > 0
    assert after["function_calling/parallel/easy"] > before["function_calling/parallel/easy"]
    assert after["function_calling/single/easy"] > before["function_calling/single/easy"]  # More replay too.
    assert after["function_calling/choose_or_refuse/easy"] <= before["function_calling/choose_or_refuse/easy"]


def _lm_eval(store: ArtifactStore, wins: int, label: str) -> str:
    records = [
        {"task": "flywheel_tool_call", "doc_id": i, "category": "tool_call/terminal", "difficulty": "easy",
         "success": i < wins}
        for i in range(30)
    ]  # fmt: skip
    jsonl = "".join(json.dumps(r) + "\n" for r in records)
    return store.put("eval", f"lm-eval-{label}", {"samples/flywheel_tool_call.jsonl": jsonl}).id


def _agentic(store: ArtifactStore, label: str) -> str:
    samples = [
        {"env": row["source"], "item_id": f"{row['category']}{i}", "category": row["category"],
         "difficulty": row["difficulty"], "reward": float(row["success"]), "success": row["success"]}
        for i, row in enumerate(_held_out())
    ]  # fmt: skip
    by_env: dict[str, str] = {}
    for sample in samples:
        by_env[sample["env"]] = by_env.get(sample["env"], "") + json.dumps(sample) + "\n"
    return store.put("eval", f"agentic-{label}", {f"samples/{env}.jsonl": text for env, text in by_env.items()}).id


def test_the_next_rounds_record_and_report_say_what_the_score_did(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    spec = CurriculumSpec(families=FAMILIES, groups=8, config=CONFIG)
    first = mine_to_store(store, [_agentic(store, "r0"), _lm_eval(store, 0, "r0")], curriculum=spec, name="w-r0")
    record = store.read_json(first.id, "curriculum.json")["benchmarks"]["flywheel_tool_call"]
    assert (record["success"], record["before"]) == (0.0, None) and record["weighted"]
    planned = store.read_json(first.id, "curriculum.json")["generate"]["function_calling"]
    assert planned["policy"]["mix"]["single/medium"] == 0 and planned["teacher"]["mix"]["single/medium"] > 0

    second = mine_to_store(
        store, [_agentic(store, "r1"), _lm_eval(store, 12, "r1")], curriculum=spec, name="w-r1", previous=first.id
    )
    curriculum = store.read_json(second.id, "curriculum.json")
    assert (
        curriculum["benchmarks"]["flywheel_tool_call"]["success"],
        curriculum["benchmarks"]["flywheel_tool_call"]["before"],
    ) == (0.4, 0.0)
    report = _curriculum_markdown(curriculum)
    assert "| flywheel_tool_call | 0.40 (30 items) | 0.00 (+0.40) | function_calling/single/easy" in report
