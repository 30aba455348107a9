"""`run_round` with scripted stages (evaluations whose outcomes the test decides; gate and mine for
real): round 1 starts from round 0's curriculum (and its rollouts), round 2 from round 1's, and mastery
unlocks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from flywheel.data import ArtifactStore
from flywheel.environments.task_stream import DIFFICULTIES
from flywheel.environments.tasks.tool_use_chain_tasks import CATEGORIES
from flywheel.flows.flywheel import run_round
from flywheel.flows.round_config import load_round_config, overridden
from flywheel.flows.stages import STAGES
from flywheel.flows.work import round_name

# envs: tool_use_chain; 10 turns keep todo_report/medium (9 oracle turns) in reach once it unlocks.
CONFIG = load_round_config("tiny", overrides=["generate.groups=40", "max_agent_turns=10"])
SOLVED_BY_R1 = {"rl-r1": {("todo_report", "easy"): 12}}  # What the round-1 candidate learns: items a slice.


def scripted_round_stages(
    store: ArtifactStore, solved: dict[str, dict[tuple[str, str], int]] = SOLVED_BY_R1
) -> tuple[Any, list[tuple[str, dict[str, Any]]]]:
    """A `stage` callable for `run_round` and the calls it received; `solved`: checkpoint name -> how many
    of a slice's 12 held-out items it solves. Gate and mine run for real."""
    calls: list[tuple[str, dict[str, Any]]] = []

    def stage(name: str, /, **fields: Any) -> str:
        calls.append((name, fields))
        n = fields["round_no"]
        if name in ("gate", "mine"):
            params = STAGES[name].params(store_url=store.root_url, config=CONFIG, **fields)
            return STAGES[name].work(params).id
        if name == "evaluate":
            wins = solved.get(store.manifest(fields["model"]).name, {})
            rows = [
                {"env": "tool_use_chain", "item_id": f"{c}-{d}-{i}", "category": c, "difficulty": d,
                 "reward": float(i < wins.get((c, d), 0)), "success": i < wins.get((c, d), 0)}
                for c in CATEGORIES for d in DIFFICULTIES for i in range(12)
            ]  # fmt: skip
            return store.put("eval", fields["name"], {"samples/tool_use_chain.jsonl": _jsonl(rows)}).id
        if name == "lm_eval":
            rows = [{"task": "flywheel_reasoning", "doc_id": i, "success": i % 2 == 0} for i in range(10)]
            return store.put("eval", fields["name"], {"samples/flywheel_reasoning.jsonl": _jsonl(rows)}).id
        made = {
            "generate": ("rollouts", round_name("rollouts", n), []),
            "curate": ("dataset", round_name("sft", n), [fields.get("rollouts"), *fields.get("carried", [])]),
            "sft": ("checkpoint", round_name("sft", n), [fields.get("base"), fields.get("dataset")]),
            "rl": ("checkpoint", round_name("rl", n), [fields.get("policy")]),
            "report": ("report", round_name("report", n), fields.get("refs", [])),
        }[name]
        kind, artifact, parents = made
        planned = sum(part["groups"] for parts in (fields.get("plan") or {}).values() for part in parts.values())
        metrics = {"groups_written": planned} if name == "generate" else {}
        files = {"x": json.dumps(fields, default=str)}
        return store.put(kind, artifact, files, parents=[p for p in parents if p], metrics=metrics).id

    return stage, calls


def _jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_each_round_follows_the_curriculum_mined_before_it(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    store.put("model", "tiny", {"config.json": "{}"})
    stage, calls = scripted_round_stages(store)

    report, decision = run_round(store, 1, CONFIG, stage)
    assert decision["promote"]  # todo_report/easy: 0/12 -> 12/12, no lm-eval guard dropped.
    names = [name for name, _ in calls]
    assert names[:4] == ["evaluate", "lm_eval", "gate", "mine"]  # Round 0: the base judged and mined.
    assert names[4:] == ["generate", "curate", "sft", "rl", "evaluate", "lm_eval", "gate", "mine", "report"]
    curriculum_r0 = store.read_json("weaknesses/weaknesses-r0", "curriculum.json")
    generate_r1 = dict(calls)["generate"]
    assert generate_r1["plan"] == curriculum_r0["generate"]
    assert generate_r1["plan"]["tool_use_chain"]["teacher"]["mix"]["todo_report/medium"] == 0  # Locked.
    assert set(generate_r1["plan"]["tool_use_chain"]) == {"teacher"}  # The base solved nothing: all teacher.
    mined_r1 = store.manifest("weaknesses/weaknesses-r1")
    assert store.resolve("rollouts/rollouts-r1") in mined_r1.parents  # The round's own rollouts are evidence too.

    calls_r1 = list(calls)
    calls.clear()
    run_round(store, 2, CONFIG, stage)
    curriculum_r1 = store.read_json("weaknesses/weaknesses-r1", "curriculum.json")
    got = dict(calls)
    assert got["generate"]["plan"] == curriculum_r1["generate"] and got["rl"]["task_mix"] == curriculum_r1["rl"]
    classes = {r["slice"]: r["class"] for r in curriculum_r1["slices"]["tool_use_chain"]["slices"]}
    assert classes["todo_report/easy"] == "mastered" and classes["todo_report/medium"] == "unsolved"
    assert curriculum_r1["slices"]["tool_use_chain"]["newly_unlocked"] == ["todo_report/medium"]
    plan = got["generate"]["plan"]["tool_use_chain"]
    teacher, policy = plan["teacher"]["mix"], plan["policy"]["mix"]
    assert teacher["todo_report/medium"] > 0 and teacher["todo_report/easy"] == 0  # New work from the teacher...
    assert teacher["todo_report/medium"] > policy["todo_report/easy"] > 0  # ...a little replay of the champion's own.
    # The replay comes on top of the config's groups, and SFT's steps grow with the plan: rows seen as often.
    planned = sum(part["groups"] for part in plan.values())
    groups = CONFIG.generate.groups
    assert planned > groups and got["sft"]["steps"] == math.ceil(CONFIG.sft.total_steps * planned / groups)
    assert dict(calls_r1)["sft"]["steps"] is None  # Round 1 teaches only: the config's steps.
    assert got["rl"]["task_mix"]["tool_use_chain"]["todo_report/easy"] == 0  # GRPO leaves the mastered slice.
    assert store.manifest(report).parents  # The report is built from the round's artifacts.


def test_a_round_plans_once_unless_its_config_changed(tmp_path: Path, monkeypatch) -> None:
    """Mining stores the next round's plan; the round reads it rather than planning again, and plans
    anew only when its config plans differently (here a smaller generation budget)."""
    import flywheel.flows.flywheel

    store = ArtifactStore(tmp_path)
    store.put("model", "tiny", {"config.json": "{}"})
    stage, calls = scripted_round_stages(store)
    planned: list[int] = []
    plan_generation = flywheel.flows.flywheel.plan_generation
    monkeypatch.setattr(
        flywheel.flows.flywheel, "plan_generation", lambda *a, **k: planned.append(1) or plan_generation(*a, **k)
    )
    run_round(store, 1, CONFIG, stage)
    assert planned == []  # Round 0's mining planned round 1 with this very config.
    smaller = overridden(CONFIG, {"generate.groups": 8})
    calls.clear()
    run_round(store, 2, smaller, stage)
    assert planned == [1]
    plan = dict(calls)["generate"]["plan"]["tool_use_chain"]
    assert plan["teacher"]["groups"] <= 8 != store.read_json("weaknesses/weaknesses-r1", "curriculum.json")[
        "generate"]["tool_use_chain"]["teacher"]["groups"]  # fmt: skip


def test_a_kept_out_round_carries_its_rollouts_and_the_focus_moves_on(tmp_path: Path) -> None:
    """Round 1's candidate solves 1 of 12 `todo_report/easy` items (P(better) ~0.6: kept out), round 2's as
    well: round 2 curates round 1's rollouts again beside its own, round 3 both rounds', each SFT's steps
    grow with them; the slice they taught is `carried` (no new teacher groups), the champion's evals stay
    the bar, and once a round is promoted nothing is carried, nor after a round that was surely worse."""
    store = ArtifactStore(tmp_path)
    store.put("model", "tiny", {"config.json": "{}"})
    one = {("todo_report", "easy"): 1}
    stage, calls = scripted_round_stages(store, {"rl-r1": one, "rl-r2": one, "rl-r3": {("line_count", "easy"): 12}})
    assert not run_round(store, 1, CONFIG, stage)[1]["promote"]
    assert dict(calls)["curate"]["carried"] == []
    calls.clear()

    assert not run_round(store, 2, CONFIG, stage)[1]["promote"]
    got, r1 = dict(calls), store.resolve("rollouts/rollouts-r1")
    assert got["curate"]["carried"] == [r1]
    base_evals = [store.resolve("eval/agentic-r0"), store.resolve("eval/lm-eval-r0")]
    assert got["gate"]["champion_evals"] == base_evals  # The kept-out candidate's evals are no bar.
    row = next(r for r in store.read_json("weaknesses/weaknesses-r1", "curriculum.json")["slices"]["tool_use_chain"]
               ["slices"] if r["slice"] == "todo_report/easy")  # fmt: skip
    assert row["class"] == "unsolved" and row["carried"] == "1/12" and row["waits"].startswith("carried")
    teacher = got["generate"]["plan"]["tool_use_chain"]["teacher"]["mix"]
    assert teacher["todo_report/easy"] == 0 and teacher["line_count/easy"] > 0
    planned = sum(part["groups"] for part in got["generate"]["plan"]["tool_use_chain"].values())
    carried_groups = store.manifest(r1).metrics["groups_written"]
    assert carried_groups > 0
    assert got["sft"]["steps"] == math.ceil(
        CONFIG.sft.total_steps * (planned + carried_groups) / CONFIG.generate.groups
    )
    calls.clear()

    assert run_round(store, 3, CONFIG, stage)[1]["promote"]  # line_count/easy: 12 of 12.
    assert set(dict(calls)["curate"]["carried"]) == {r1, store.resolve("rollouts/rollouts-r2")}
    calls.clear()
    decision = run_round(store, 4, CONFIG, stage)[1]  # Round 4's candidate solves nothing: surely worse.
    assert dict(calls)["curate"]["carried"] == [] and not decision["promote"] and decision["primary_delta"] < 0
    assert "carried_evals" not in store.manifest("weaknesses/weaknesses-r3").params
    assert "carried_evals" not in store.manifest("weaknesses/weaknesses-r4").params
    calls.clear()
    run_round(store, 5, CONFIG, stage)
    assert dict(calls)["curate"]["carried"] == []  # A round kept out for a regression passes nothing on.
