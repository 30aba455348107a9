"""The curriculum, driven by scripted held-out outcomes: classes from Wilson intervals, unlocks,
a generation plan that generation follows exactly, teacher data for unsolved slices."""

from __future__ import annotations

import doctest
import json
from collections import Counter
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from flywheel.data.columnar import read_rows
from flywheel.environments.generate import GenerationPart, generate_rollouts
from flywheel.environments.task_stream import TaskStream
from flywheel.environments.tasks import tool_use_chain_tasks
from flywheel.evaluation import curriculum as curriculum_module
from flywheel.evaluation.curriculum import CurriculumConfig, build_curriculum, grpo_mix, plan_generation
from flywheel.evaluation.weakness import CurriculumSpec, mine_to_store

CATEGORIES = tool_use_chain_tasks.CATEGORIES  # todo_report, line_count, csv_summary
FAMILIES = {"tool_use_chain": CATEGORIES}


def outcomes(script: dict[tuple[str, str], tuple[int, int]], env: str = "tool_use_chain") -> list[dict]:
    """(category, difficulty) -> (wins, n) as mining's flat rows."""
    rows = []
    for (category, difficulty), (wins, n) in script.items():
        rows += [{"source": env, "category": category, "difficulty": difficulty, "success": i < wins} for i in range(n)]
    return rows


def classes(curriculum: dict, env: str = "tool_use_chain") -> dict[str, str]:
    return {row["slice"]: row["class"] for row in curriculum[env]["slices"]}


def test_doc_examples() -> None:
    failed, attempted = doctest.testmod(curriculum_module)
    assert attempted >= 2 and failed == 0  # `wilson`'s and `largest_remainder`'s examples ran and held.


def test_slices_are_classed_by_their_intervals_and_mastery_unlocks_the_next_difficulty() -> None:
    script = {("todo_report", "easy"): (0, 12), ("line_count", "easy"): (6, 12), ("csv_summary", "easy"): (12, 12)}
    result = build_curriculum(outcomes(script), FAMILIES)
    got = classes(result)
    assert got["todo_report/easy"] == "unsolved" and got["line_count/easy"] == "learnable"
    assert got["csv_summary/easy"] == "mastered"
    # Mastered easy csv_summary unlocks csv_summary/medium; the other categories' harder slices stay locked.
    assert "csv_summary/medium" in result["tool_use_chain"]["unlocked"]
    assert result["tool_use_chain"]["newly_unlocked"] == ["csv_summary/medium"]
    assert got["csv_summary/medium"] != "locked" and got["csv_summary/hard"] == "locked"
    assert got["todo_report/medium"] == got["line_count/hard"] == "locked"


def test_thin_evidence_climbs_to_the_env_and_says_so() -> None:
    # One item of todo_report/easy is not decisive alone; the env's 0 of 13 easy items is.
    script = {("todo_report", "easy"): (0, 1), ("line_count", "easy"): (0, 6), ("csv_summary", "easy"): (0, 6)}
    script[("csv_summary", "hard")] = (5, 5)  # Locked: never counts for its parents.
    row = build_curriculum(outcomes(script), FAMILIES)["tool_use_chain"]["slices"][0]
    assert row["slice"] == "todo_report/easy" and row["class"] == "unsolved"
    assert row["evidence"] == "tool_use_chain/*/easy"
    # 1 of 4 is not decisive; with the locked slice's 0 of 30 the env's 1 of 34 would be (unsolved).
    locked_failures = {("todo_report", "easy"): (1, 4), ("csv_summary", "hard"): (0, 30)}
    row = build_curriculum(outcomes(locked_failures), FAMILIES)["tool_use_chain"]["slices"][0]
    assert (row["class"], row["evidence"]) == ("learnable", "undecided")
    # Mixed results everywhere: nothing decisive at any level -> learnable, "undecided".
    mixed = {(c, "easy"): (1, 2) for c in CATEGORIES}
    row = build_curriculum(outcomes(mixed), FAMILIES)["tool_use_chain"]["slices"][0]
    assert row["class"] == "learnable" and row["evidence"] == "undecided"


def test_a_parents_evidence_decides_only_for_a_slice_whose_own_outcomes_agree() -> None:
    """The env's other easy slices won 24 of 24: a slice that won 2 of its 2 items is mastered by that evidence,
    one that won 1 of 3 is not (nor unlocks its next difficulty); a slice that won 2 of 3 beside 0 of 24 is not
    unsolved."""
    strong = {("line_count", "easy"): (12, 12), ("csv_summary", "easy"): (12, 12)}
    agreeing = build_curriculum(outcomes({**strong, ("todo_report", "easy"): (2, 2)}), FAMILIES)
    row = agreeing["tool_use_chain"]["slices"][0]
    assert (row["slice"], row["class"], row["evidence"]) == ("todo_report/easy", "mastered", "tool_use_chain/*/easy")
    contrary = build_curriculum(outcomes({**strong, ("todo_report", "easy"): (1, 3)}), FAMILIES)
    row = contrary["tool_use_chain"]["slices"][0]
    assert (row["class"], row["evidence"]) == ("learnable", "undecided")
    assert classes(contrary)["todo_report/medium"] == "locked"
    weak = {("line_count", "easy"): (0, 12), ("csv_summary", "easy"): (0, 12)}
    row = build_curriculum(outcomes({**weak, ("todo_report", "easy"): (2, 3)}), FAMILIES)["tool_use_chain"]["slices"][0]
    assert (row["class"], row["evidence"]) == ("learnable", "undecided")


def test_unlocks_persist_and_a_fixed_difficulty_never_locks() -> None:
    first = build_curriculum(outcomes({("todo_report", "easy"): (12, 12)}), FAMILIES)
    assert "todo_report/medium" in first["tool_use_chain"]["unlocked"]
    # Next round the easy slice slips below mastery: medium stays unlocked (mastery is not taken back).
    second = build_curriculum(outcomes({("todo_report", "easy"): (6, 12)}), FAMILIES, previous=first)
    assert classes(second)["todo_report/medium"] != "locked" and second["tool_use_chain"]["newly_unlocked"] == []
    fixed = build_curriculum(outcomes({("todo_report", "hard"): (0, 12)}), FAMILIES, difficulty="hard")
    assert classes(fixed) == {f"{c}/hard": "unsolved" for c in CATEGORIES}  # Unseen: no success yet.
    evidence = [(r["evidence"], r["ci"]) for r in fixed["tool_use_chain"]["slices"]]
    unseen = ("no success yet", [0.0, 1.0])  # No outcome: any rate.
    assert evidence == [("tool_use_chain/todo_report/hard", [0.0, 0.2425]), unseen, unseen]


def test_the_generation_plan_routes_classes_to_actors_and_generation_follows_it_exactly() -> None:
    script = {("todo_report", "easy"): (0, 12), ("line_count", "easy"): (6, 12), ("csv_summary", "easy"): (12, 12)}
    script[("csv_summary", "medium")] = (0, 12)  # Unlocked by the mastered easy slice, and unsolved.
    curriculum = build_curriculum(outcomes(script), FAMILIES)
    plan = plan_generation(curriculum, groups=30, config=CurriculumConfig(replay=0.2))
    rows = {row["slice"]: row for row in curriculum["tool_use_chain"]["slices"]}
    # The 30 groups go to the slices to teach, weights 1 (unsolved) : 1 (learnable) : 1 (unsolved); the
    # mastered slice's replay, 0.2 of a taught slice's 10, comes on top: 32 groups in all.
    assert [rows[s]["groups"] for s in ("todo_report/easy", "line_count/easy", "csv_summary/easy")] == [10, 10, 2]
    assert rows["csv_summary/medium"]["groups"] == 10
    assert not any(row["groups"] for row in rows.values() if row["class"] == "locked")
    teacher, policy = plan["tool_use_chain"]["teacher"], plan["tool_use_chain"]["policy"]
    # The champion's own rollouts: the learnable slice, and the mastered slice's replay (its own way of solving it).
    assert policy["groups"] == 12
    assert {s for s, w in policy["mix"].items() if w} == {"line_count/easy", "csv_summary/easy"}
    assert teacher["groups"] == 20  # Unsolved demonstrations only.
    assert {s for s, w in teacher["mix"].items() if w} == {"todo_report/easy", "csv_summary/medium"}
    # A stream with the part's mix yields exactly the planned count of every slice.
    stream = TaskStream("tool_use_chain", tool_use_chain_tasks.make_task, CATEGORIES, seed=3, mix=teacher["mix"])
    drawn = Counter(f"{c}/{d}" for c, d in (stream.slice_of(i) for i in range(teacher["groups"])))
    assert drawn == {s: w for s, w in teacher["mix"].items() if w}


def test_learnable_slices_get_generation_by_learnability_so_a_nearly_solved_one_does_not_crowd_out_teaching() -> None:
    """A learnable slice's share of the budget is 4p(1 - p) of an unsolved slice's: at even odds the same,
    nearly solved (2 of 2, not yet decisive at z = 1) about half, so the teacher gets the rest."""
    config = CurriculumConfig(z=1.0)
    script = {("todo_report", "easy"): (0, 2), ("line_count", "easy"): (1, 2), ("csv_summary", "easy"): (2, 2)}
    curriculum = build_curriculum(outcomes(script), FAMILIES, config=config)
    easy = ("todo_report/easy", "line_count/easy", "csv_summary/easy")
    assert [classes(curriculum)[s] for s in easy] == ["unsolved", "learnable", "learnable"]
    plan = plan_generation(curriculum, groups=25, config=config)["tool_use_chain"]
    rows = {row["slice"]: row for row in curriculum["tool_use_chain"]["slices"]}
    assert [rows[s]["weight"] for s in easy] == [1.0, 1.0, 0.5556]
    assert [rows[s]["groups"] for s in easy] == [10, 10, 5]
    assert plan["teacher"]["groups"] == 10 and plan["policy"]["groups"] == 15


def test_with_nothing_left_to_teach_the_whole_budget_replays_mastered_slices() -> None:
    everything = {(c, d): (12, 12) for c in CATEGORIES for d in ("easy", "medium", "hard")}
    curriculum = build_curriculum(outcomes(everything), FAMILIES)
    plan = plan_generation(curriculum, groups=9)["tool_use_chain"]
    assert set(plan) == {"policy"} and plan["policy"]["groups"] == 9
    assert set(plan["policy"]["mix"].values()) == {1}  # One group of each of the nine mastered slices.


def test_replay_adds_at_most_the_budget_again() -> None:
    """One slice to teach beside eight mastered ones: replay at 0.5 would be 4x the budget; it is capped at 1x."""
    script = {(c, d): (12, 12) for c in CATEGORIES for d in ("easy", "medium", "hard")}
    script[("todo_report", "hard")] = (0, 12)
    curriculum = build_curriculum(outcomes(script), FAMILIES)
    plan = plan_generation(curriculum, groups=10)["tool_use_chain"]
    assert plan["teacher"]["groups"] == 10 and plan["policy"]["groups"] == 10


def test_the_ablations_uniform_arm_gets_the_mined_plans_budget(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from benchmarks.curriculum_ablation import arm_config
    from flywheel.flows.round_config import load_round_config

    p = load_round_config("tiny", overrides=["generate.groups=12", "sft.total_steps=4"])
    store = ArtifactStore(tmp_path)
    script = {("todo_report", "easy"): (0, 12), ("line_count", "easy"): (12, 12), ("csv_summary", "easy"): (12, 12)}
    curriculum = {"slices": build_curriculum(outcomes(script), FAMILIES, p.curriculum)}
    store.put("weaknesses", "weaknesses-r1", {"curriculum.json": json.dumps(curriculum)})
    # Taught: todo_report/easy and the two unlocked medium slices, 4 groups each; the two mastered
    # slices replay 0.5 x 4 each on top: 16 groups, and SFT steps ceil(4 x 16 / 12).
    uniform = arm_config(store, p, "uniform")
    assert (uniform.curriculum.mode, uniform.generate.groups, uniform.sft.total_steps) == ("uniform", 16, 6)
    mined = arm_config(store, p, "mined")
    assert (mined.curriculum.mode, mined.generate.groups, mined.sft.total_steps) == ("mined", 12, 4)


def test_the_ablation_reuses_only_an_arm_that_finished_from_the_same_round_1_and_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import curriculum_ablation as ablation
    from flywheel.flows.round_config import load_round_config, overridden

    source, workdir = tmp_path / "round-1", tmp_path / "work"
    ArtifactStore(source).put("weaknesses", "weaknesses-r1", {"curriculum.json": "{}"})
    workdir.mkdir()
    rounds: list[int] = []

    def round_2(store: ArtifactStore, n: int, p: object, stage: object, finish: bool = True) -> None:
        rounds.append(n)
        store.put("eval", "agentic-r2", {"metrics.json": json.dumps({"round": len(rounds)})})
        if not finish:
            raise KeyboardInterrupt  # Cut off before the report.
        store.put("report", "report-r2", {"report.md": "round 2"})

    monkeypatch.setattr(ablation, "run_round", round_2)
    p = load_round_config("tiny", overrides=["curriculum.mode=uniform"])
    first = ablation.run_arm(source, workdir, p)[1]
    assert ablation.run_arm(source, workdir, p)[1] == first and len(rounds) == 1  # Finished: reused.
    (workdir / "weak-uniform").mkdir()  # The larger sample of that candidate.
    assert ablation.run_arm(source, workdir, overridden(p, {"sft.total_steps": 3}))[1] != first  # Another budget.
    assert len(rounds) == 2 and not (workdir / "weak-uniform").exists()  # Its old candidate's sample is gone.
    monkeypatch.setattr(ablation, "run_round", lambda *args: round_2(*args, finish=False))
    with pytest.raises(KeyboardInterrupt):
        ablation.run_arm(source, workdir, p)
    monkeypatch.setattr(ablation, "run_round", round_2)
    ablation.run_arm(source, workdir, p)  # The cut-off copy is started again, not reused.
    ArtifactStore(source).put("weaknesses", "weaknesses-r1", {"curriculum.json": '{"slices": {}}'})  # Another round 1.
    ablation.run_arm(source, workdir, p)
    assert len(rounds) == 5
    # The uniform arm reads no curriculum settings: changing them keeps it. The mined arm's plan is in its record.
    ablation.run_arm(source, workdir, overridden(p, {"curriculum.focus": 1}))
    mined = overridden(p, {"curriculum.mode": "mined"})
    ablation.run_arm(source, workdir, mined)
    ablation.run_arm(source, workdir, mined)
    assert len(rounds) == 6
    monkeypatch.setattr(ablation, "plan_round", lambda *args: ({"tool_use_chain": {}}, {}))  # Another curriculum rule.
    ablation.run_arm(source, workdir, mined)
    assert len(rounds) == 7


def test_the_ablation_prints_both_arms_on_the_larger_sample_with_the_paired_bootstrap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.curriculum_ablation import print_larger_sample

    store = ArtifactStore(tmp_path)
    price, bug = "web_navigation/lookup_price/easy", "swe_bench/off_by_one/easy"
    weak = {price, bug}

    def eval_of(successes: dict[str, list[bool]]) -> str:
        rows = [
            {"env": key.split("/")[0], "category": key.split("/")[1], "difficulty": "easy", "item_id": f"{key}-{i}"}
            | {"reward": float(ok), "success": ok}
            for key, items in successes.items()
            for i, ok in enumerate(items)
        ]
        return store.put("eval", "weak", {"samples/all.jsonl": "".join(json.dumps(r) + "\n" for r in rows)}).id

    evals = {
        "mined": (store, eval_of({price: [True, True], bug: [True, False]})),
        "uniform": (store, eval_of({price: [False, True], bug: [False, False]})),
    }
    print_larger_sample(evals, weak)
    out = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert "web_navigation/lookup_price/easy 2/2 1/2" in out and "swe_bench/off_by_one/easy 1/2 0/2" in out
    assert "all weak slices 3/4 1/4" in out
    # Two of the four paired items won, none lost: P(better) 1 - (1/2)^4 in expectation.
    verdict = out[-1]
    assert verdict.startswith("mined - uniform on 4 paired items: +0.500") and float(verdict.split()[-1]) > 0.85


def test_grpo_weights_learnable_slices_by_p_times_one_minus_p() -> None:
    script = {("todo_report", "easy"): (0, 12), ("line_count", "easy"): (6, 12), ("csv_summary", "easy"): (12, 12)}
    mix = grpo_mix(build_curriculum(outcomes(script), FAMILIES))["tool_use_chain"]
    assert mix["line_count/easy"] == 0.25  # p = 0.5: the most to learn.
    assert mix["todo_report/easy"] == mix["csv_summary/easy"] == mix["todo_report/hard"] == 0  # Not learnable.
    nothing_learnable = grpo_mix(build_curriculum(outcomes({("todo_report", "easy"): (0, 12)}), FAMILIES))
    assert {s for s, w in nothing_learnable["tool_use_chain"].items() if w} == {f"{c}/easy" for c in CATEGORIES}
    everything_mastered = {(c, d): (12, 12) for c in CATEGORIES for d in ("easy", "medium", "hard")}
    uniform = grpo_mix(build_curriculum(outcomes(everything_mastered), FAMILIES))["tool_use_chain"]
    assert set(uniform.values()) == {1.0}  # Nothing left to learn: every unlocked slice alike.
    # Across envs, one scale: an env with nothing learnable gets no GRPO tasks while another has some.
    two = {"tool_use_chain": CATEGORIES, "web_navigation": ("under_price", "cheapest", "lookup_price")}
    rows = outcomes(script) + outcomes({("cheapest", "easy"): (0, 12)}, env="web_navigation")
    across = grpo_mix(build_curriculum(rows, two))
    assert sum(across["tool_use_chain"].values()) == 0.25 and not any(across["web_navigation"].values())


def test_unsolved_slices_get_teacher_demonstrations(tmp_path, tiny_model) -> None:
    """The stored curriculum's plan, run with the oracle: every group is from a planned slice, in the planned count."""
    store = ArtifactStore(tmp_path / "store")
    samples = [
        {"env": "tool_use_chain", "item_id": f"{c}{i}", "category": c, "difficulty": "easy",
         "reward": 0.0, "success": False} for c in CATEGORIES for i in range(4)
    ]  # fmt: skip
    jsonl = "".join(json.dumps(s) + "\n" for s in samples)
    evals = store.put("eval", "agentic-base", {"samples/tool_use_chain.jsonl": jsonl})
    spec = CurriculumSpec(families=FAMILIES, groups=3)
    mined = mine_to_store(store, [evals.id], curriculum=spec, name="weaknesses-r0")
    plan = store.read_json(mined.id, "curriculum.json")["generate"]["tool_use_chain"]
    assert set(plan) == {"teacher"}  # Nothing is learnable yet: the policy has nothing to roll.
    part = GenerationPart(env="tool_use_chain", groups=plan["teacher"]["groups"], task_mix=plan["teacher"]["mix"])
    rollouts = generate_rollouts(store, [part], group_size=2, tokenizer=str(tiny_model), seed=1)
    groups = list(read_rows(store, rollouts.id, "rollouts", "tool_use_chain"))
    assert [g["meta"]["item_id"] for g in groups] == sorted(g["meta"]["item_id"] for g in groups)  # Stored in order.
    got = Counter(f"{g['meta']['category']}/{g['meta']['difficulty']}" for g in groups)
    assert got == {s: n for s, n in plan["teacher"]["mix"].items() if n}
    assert all(score >= 0.9 for g in groups for score in g["scores"]), [g["scores"] for g in groups]  # Solved.
    assert mined.metrics["slices_unsolved"] == 3 and mined.metrics["slices_locked"] == 6


def test_a_small_budget_spreads_over_every_env() -> None:
    families = {env: CATEGORIES for env in ("a", "b", "c", "d")}  # 12 unsolved easy slices, 8 groups.
    curriculum = build_curriculum([], families)
    plan = plan_generation(curriculum, groups=8)
    assert {env: part["teacher"]["groups"] for env, part in plan.items()} == {"a": 2, "b": 2, "c": 2, "d": 2}
    left = [
        row
        for spec in curriculum.values()
        for row in spec["slices"]
        if row["class"] == "unsolved" and not row["groups"]
    ]
    assert len(left) == 4 and all(row["waits"].startswith("no group left") for row in left)  # Each says why.


def test_an_env_without_categories_is_one_slice_that_gets_its_share() -> None:
    """A user's env with no task categories still gets a class, generation groups and GRPO tasks."""
    families = {"tool_use_chain": CATEGORIES, "file_stats": ()}
    rows = outcomes({("line_count", "easy"): (6, 12)})
    unknown = {"source": "file_stats", "category": "unknown", "difficulty": "unknown"}
    rows += [unknown | {"success": i < 1} for i in range(3)]
    result = build_curriculum(rows, families, CurriculumConfig(z=1.0))
    (whole,) = result["file_stats"]["slices"]
    assert (whole["slice"], whole["class"], whole["wins"], whole["n"]) == ("*", "learnable", 1, 3)
    plan = plan_generation(result, groups=8)
    assert plan["file_stats"]["policy"] == {"groups": whole["groups"], "mix": {"*": whole["groups"]}}
    assert whole["groups"] >= 1
    assert grpo_mix(result)["file_stats"]["*"] > 0
    never_solved = build_curriculum([{**row, "success": False} for row in rows], families)
    assert never_solved["file_stats"]["slices"][0]["class"] == "unsolved"


def test_teacher_data_goes_to_the_focus_easiest_slices_with_their_turn_budgets() -> None:
    """Of the unsolved slices only `focus` are taught: easiest difficulty first, then fewest teacher turns;
    each records its teacher's turns and its turn budget (1.5 x those, at least the round's); GRPO
    follows the plan."""
    swe = ("off_by_one", "wrong_operator", "wrong_condition")
    long = ("library", "cli_tool", "data_utils")
    families = {"tool_use_chain": CATEGORIES, "swe_bench": swe, "long_horizon": long}
    opened = {"todo_report/medium": 1, "csv_summary/medium": 1}  # Unlocked harder slices, unsolved too.
    previous = {"tool_use_chain": {"unlocked": list(opened)}}
    curriculum = build_curriculum([], families, previous=previous)
    plan = plan_generation(curriculum, groups=12, config=CurriculumConfig(focus=3), max_turns=6)
    rows = {(env, row["slice"]): row for env, spec in curriculum.items() for row in spec["slices"]}
    # Easy oracles: tool_use_chain 3 calls (one script), swe_bench 5, long_horizon 6 (four replies of writes).
    easy = [("tool_use_chain", "todo_report/easy"), ("swe_bench", "off_by_one/easy"), ("long_horizon", "library/easy")]
    assert [rows[key]["teacher_turns"] for key in easy] == [3, 5, 6]
    assert [rows[key]["turns"] for key in easy] == [6, 8, 9]  # The round's 6, or 1.5 x a longer teacher's.
    medium = rows[("tool_use_chain", "csv_summary/medium")]
    assert (medium["teacher_turns"], medium["turns"]) == (6, 9)  # Two projects: the horizon doubles.
    assert all("focus" in rows[("long_horizon", f"{c}/easy")]["waits"] for c in long)
    assert all("focus" in rows[("swe_bench", f"{c}/easy")]["waits"] for c in swe)
    assert "focus" in medium["waits"]  # Unlocked, but medium.
    taught = {key for key, row in rows.items() if row["groups"]}
    assert taught == {("tool_use_chain", f"{c}/easy") for c in CATEGORIES}
    assert set(plan) == {"tool_use_chain"} and plan["tool_use_chain"]["teacher"]["groups"] == 12
    rl = grpo_mix(curriculum)  # Nothing learnable: GRPO on the slices SFT was just shown, not the waiting ones.
    assert {(env, s) for env, mix in rl.items() for s, w in mix.items() if w} == taught
    # Equally easy slices alternate envs: swe_bench's three 5-call slices do not crowd out the web's.
    four = {**families, "web_navigation": ("under_price", "cheapest", "lookup_price")}  # 5 calls each.
    spread = build_curriculum([], four)
    plan_generation(spread, groups=8, config=CurriculumConfig(focus=5), max_turns=6)
    picked = {(env, row["slice"]) for env, spec in spread.items() for row in spec["slices"] if row["groups"]}
    shortest = {("tool_use_chain", f"{c}/easy") for c in CATEGORIES}  # 3 calls.
    assert picked == shortest | {("swe_bench", "off_by_one/easy"), ("web_navigation", "under_price/easy")}
    # A round that allows more turns than a horizon keeps its own budget.
    roomy = build_curriculum([], {"swe_bench": swe})
    plan_generation(roomy, groups=3, max_turns=9)
    assert {row["turns"] for row in roomy["swe_bench"]["slices"] if row["slice"].endswith("/easy")} == {9}


def test_slices_a_kept_out_candidate_solved_with_a_call_are_carried_and_the_focus_moves_past_them() -> None:
    """The champion solves nothing; the kept-out round taught `todo_report/easy` and `line_count/easy`, and its
    candidate solved the first with a call (1 of 2), the second only without one (no sign), and
    `csv_summary/easy`, which it was not taught (no rows carry it): the first alone is carried - no teacher
    groups, not in the focus - so the focus of 2 takes the next two easiest. With nothing else to teach, a
    carried slice is taught anew, and GRPO draws it."""
    families = {"tool_use_chain": CATEGORIES, "swe_bench": ("off_by_one", "wrong_operator", "wrong_condition")}
    candidate = outcomes(
        {("todo_report", "easy"): (1, 2), ("line_count", "easy"): (1, 2), ("csv_summary", "easy"): (1, 2)}
    )
    for row in candidate:
        row["acted"] = row["category"] != "line_count"
    taught_before = [{"slice": "todo_report/easy", "groups": 5}, {"slice": "line_count/easy", "groups": 5}]
    previous = {"tool_use_chain": {"slices": taught_before, "unlocked": []}}
    curriculum = build_curriculum([], families, previous=previous, carried=candidate)
    plan_generation(curriculum, groups=12, config=CurriculumConfig(focus=2), max_turns=6)
    rows = {row["slice"]: row for spec in curriculum.values() for row in spec["slices"]}
    assert rows["todo_report/easy"]["carried"] == "1/2" and rows["todo_report/easy"]["groups"] == 0
    assert rows["todo_report/easy"]["waits"] == "carried: the kept-out candidate solved 1/2"
    assert "carried" not in rows["line_count/easy"] and "carried" not in rows["csv_summary/easy"]
    taught = sorted(name for name, row in rows.items() if row["groups"])
    assert taught == ["csv_summary/easy", "line_count/easy"]  # 3 calls each, before swe_bench's 5.
    assert "carried" not in build_curriculum([], families)["tool_use_chain"]["slices"][0]  # Nothing carried.
    # The next round: the carried slice stays carried (its rows still come); alone, it is taught anew.
    again = {"tool_use_chain": {"slices": [rows["todo_report/easy"]], "unlocked": []}}
    alone = build_curriculum([], {"tool_use_chain": ("todo_report",)}, previous=again, carried=candidate)
    plan = plan_generation(alone, groups=4, max_turns=6)
    row = alone["tool_use_chain"]["slices"][0]
    assert row["carried"] == "1/2" and row["groups"] == 4 and "waits" not in row
    assert plan["tool_use_chain"]["teacher"]["mix"]["todo_report/easy"] == 4
    assert grpo_mix(alone)["tool_use_chain"]["todo_report/easy"] == 1.0


def test_focus_holds_only_while_the_champion_solves_nothing() -> None:
    """From a base model that solves no slice, `focus` slices are taught; once the champion solves one
    (learnable or mastered) with a tool call, every unsolved unlocked slice is. Successes that made no
    call (a model that does nothing passes an irrelevance task) leave the focus in place."""
    swe = ("off_by_one", "wrong_operator", "wrong_condition")
    long = ("library", "cli_tool", "data_utils")
    families = {"tool_use_chain": CATEGORIES, "swe_bench": swe, "long_horizon": long}
    config = CurriculumConfig(z=1.0, focus=3)

    def taught(script: dict[tuple[str, str], tuple[int, int]], acted: bool = True) -> set[tuple[str, str]]:
        rows = [row | {"acted": acted} for row in outcomes(script)]
        curriculum = build_curriculum(rows, families, config=config)
        plan_generation(curriculum, groups=32, config=config, max_turns=6)
        rows = [(env, row) for env, spec in curriculum.items() for row in spec["slices"]]
        return {(env, row["slice"]) for env, row in rows if row["groups"] and row["class"] == "unsolved"}

    easy = {("tool_use_chain", f"{c}/easy") for c in CATEGORIES}
    assert taught({("todo_report", "easy"): (0, 2)}) == easy
    others = {
        (env, f"{c}/easy") for env, categories in (("swe_bench", swe), ("long_horizon", long)) for c in categories
    }
    every = (easy - {("tool_use_chain", "todo_report/easy")}) | others
    assert taught({("todo_report", "easy"): (1, 2)}) == every  # Learnable now: eight taught, not three.
    idle = easy - {("tool_use_chain", "todo_report/easy")} | {("swe_bench", "off_by_one/easy")}
    assert taught({("todo_report", "easy"): (1, 2)}, acted=False) == idle  # Still three.
    mastered = every | {("tool_use_chain", "todo_report/medium")}  # Unlocked by the mastered easy slice.
    assert taught({("todo_report", "easy"): (3, 3)}) == mastered


def test_a_teacher_group_floor_teaches_as_many_unsolved_slices_as_the_budget_gives_it() -> None:
    """`min_teacher_groups` sets how many unsolved slices a round teaches from its budget: four of six at
    8 groups each where a `focus` of 3 would teach three; learnable slices take their share first; a
    budget under the floor still teaches the easiest one."""
    swe = ("off_by_one", "wrong_operator", "wrong_condition")
    families = {"swe_bench": swe, "web_navigation": ("under_price", "cheapest", "lookup_price")}
    easy = {(env, f"{c}/easy") for env, categories in families.items() for c in categories}  # 5 calls each.

    def taught(curriculum: dict) -> dict[tuple[str, str], int]:
        rows = [(env, row) for env, spec in curriculum.items() for row in spec["slices"]]
        return {(env, row["slice"]): row["groups"] for env, row in rows if row["groups"]}

    floor = CurriculumConfig(z=1.0, min_teacher_groups=8)
    curriculum = build_curriculum([], families, config=floor)
    plan = plan_generation(curriculum, groups=32, config=floor, max_turns=6)
    alternating = {("swe_bench", "off_by_one/easy"), ("web_navigation", "under_price/easy"),
                   ("swe_bench", "wrong_operator/easy"), ("web_navigation", "cheapest/easy")}  # fmt: skip
    assert taught(curriculum) == dict.fromkeys(alternating, 8)
    assert plan["swe_bench"]["teacher"]["groups"] == 16 and plan["web_navigation"]["teacher"]["groups"] == 16
    counted = build_curriculum([], families, config=CurriculumConfig(z=1.0, focus=3))
    plan_generation(counted, groups=32, config=CurriculumConfig(z=1.0, focus=3), max_turns=6)
    assert len(taught(counted)) == 3 and set(taught(counted)) < easy
    # One learnable slice takes a quarter of the budget: the three easiest of eight unsolved slices
    # (tool_use_chain's, 3 calls) are left their 8 each; the other five wait.
    six = {**families, "tool_use_chain": CATEGORIES}
    seen = build_curriculum(outcomes({("off_by_one", "easy"): (1, 3)}, env="swe_bench"), six, config=floor)
    plan_generation(seen, groups=32, config=floor, max_turns=6)
    assert classes(seen, "swe_bench")["off_by_one/easy"] == "learnable"
    expected = {("tool_use_chain", f"{c}/easy") for c in CATEGORIES} | {("swe_bench", "off_by_one/easy")}
    assert taught(seen) == dict.fromkeys(expected, 8)
    waiting = [row["slice"] for spec in seen.values() for row in spec["slices"] if "focus of 3" in row.get("waits", "")]
    assert sorted(waiting) == sorted(
        ["wrong_operator/easy", "wrong_condition/easy", *(f"{c}/easy" for c in families["web_navigation"])]
    )
    # Learnable slices count by their weight: three nearly solved ones (2 of 2: 0.56 each) leave room
    # for two unsolved slices at 8 groups, where counting them as 1 each would leave one.
    script = {("todo_report", "easy"): (2, 2), ("line_count", "easy"): (2, 2), ("csv_summary", "easy"): (0, 2)}
    swe_seen = {("off_by_one", "easy"): (2, 2), ("wrong_operator", "easy"): (0, 4)}
    rows = outcomes(script) + outcomes(swe_seen, "swe_bench")
    nearly = build_curriculum(rows, six, config=floor)
    plan_generation(nearly, groups=32, config=floor, max_turns=6)
    taught_classes = Counter(row["class"] for spec in nearly.values() for row in spec["slices"] if row["groups"])
    assert taught_classes == {"learnable": 3, "unsolved": 2}
    # A budget under the floor: the single easiest slice gets all of it.
    small = build_curriculum([], families, config=floor)
    plan_generation(small, groups=4, config=floor, max_turns=6)
    assert list(taught(small).values()) == [4]


def test_an_env_named_by_file_or_class_gets_its_samples_as_evidence() -> None:
    """A round names a user's env by its file (or `module:Class`); its samples carry the class's `name`."""
    spec = "flywheel.environments.tool_use_chain:ToolUseChainEnv"
    script = {("todo_report", "easy"): (12, 12), ("line_count", "easy"): (0, 12)}
    curriculum = build_curriculum(outcomes(script), {spec: CATEGORIES})
    rows = {row["slice"]: row for row in curriculum[spec]["slices"]}
    assert rows["todo_report/easy"]["class"] == "mastered" and rows["todo_report/easy"]["n"] == 12
    assert rows["line_count/easy"]["n"] == 12 and rows["line_count/easy"]["class"] == "unsolved"


def test_the_focus_takes_the_easiest_difficulty_first_and_a_whole_env_counts_as_easy() -> None:
    """Without turn budgets the difficulty alone ranks unsolved slices: an unlocked medium slice waits for
    the next category's easy one. An env without categories (one slice, `*`, nothing to unlock) ranks as
    easy, and the envs after it still get their slices."""
    curriculum = build_curriculum(
        [],
        {"tool_use_chain": ("todo_report", "line_count")},
        previous={"tool_use_chain": {"unlocked": ["todo_report/medium"]}},
    )
    plan_generation(curriculum, groups=4, config=CurriculumConfig(focus=2))
    assert {row["slice"] for row in curriculum["tool_use_chain"]["slices"] if row["groups"]} == {
        "todo_report/easy",
        "line_count/easy",
    }
    whole_first = build_curriculum([], {"file_stats": (), "tool_use_chain": ("todo_report",)})
    assert whole_first["file_stats"]["unlocked"] == ["*"] and whole_first["file_stats"]["newly_unlocked"] == []
    plan_generation(whole_first, groups=4, config=CurriculumConfig(focus=1))
    assert whole_first["file_stats"]["slices"][0]["groups"] == 4
    assert "focus of 1" in whole_first["tool_use_chain"]["slices"][0]["waits"]


def _rows(script: dict[tuple[str, str], tuple[int, int]], config: CurriculumConfig | None = None) -> dict[str, dict]:
    return {
        row["slice"]: row for row in build_curriculum(outcomes(script), FAMILIES, config)["tool_use_chain"]["slices"]
    }


def test_a_slice_unlocked_this_round_is_judged_by_its_own_outcomes_and_the_envs() -> None:
    """Mastered easy todo_report unlocks medium now; no medium slice was open before, so the difficulty level
    has no evidence and the env's decides: 2 of 2 beside 36 of 36 is mastered (and unlocks hard at once),
    1 of 4 beside 12 of 12 stays learnable. A locked slice says so."""
    easy = {(c, "easy"): (12, 12) for c in CATEGORIES}
    rows = _rows({**easy, ("todo_report", "medium"): (2, 2)})
    medium = rows["todo_report/medium"]
    assert (medium["class"], medium["wins"], medium["n"], medium["evidence"]) == (
        "mastered",
        2,
        2,
        "tool_use_chain/*/*",
    )
    assert rows["todo_report/hard"]["class"] == "unsolved"
    assert (rows["line_count/hard"]["class"], rows["line_count/hard"]["evidence"]) == ("locked", "locked")
    rows = _rows({("todo_report", "easy"): (12, 12), ("todo_report", "medium"): (1, 4)}, CurriculumConfig(z=0.5))
    assert (rows["todo_report/medium"]["class"], rows["todo_report/medium"]["evidence"]) == ("learnable", "undecided")


def test_a_parents_evidence_needs_the_slices_own_rate_strictly_beyond_the_threshold() -> None:
    """The env's other easy slices lost 80 of 80 (or won 80 of 80): a slice that won 1 of 5 is unsolved by
    that evidence, one at exactly 3 of 10 (the `low` 0.3) or 7 of 10 (the `high` 0.7) stays learnable."""
    failing = {("line_count", "easy"): (0, 40), ("csv_summary", "easy"): (0, 40)}
    row = _rows({**failing, ("todo_report", "easy"): (1, 5)})["todo_report/easy"]
    assert (row["class"], row["wins"], row["n"], row["evidence"]) == ("unsolved", 1, 5, "tool_use_chain/*/easy")
    assert _rows({**failing, ("todo_report", "easy"): (3, 10)})["todo_report/easy"]["class"] == "learnable"
    solved = {("line_count", "easy"): (40, 40), ("csv_summary", "easy"): (40, 40)}
    assert _rows({**solved, ("todo_report", "easy"): (7, 10)})["todo_report/easy"]["class"] == "learnable"


def test_an_interval_at_the_threshold_decides_nothing() -> None:
    """Unsolved needs the upper bound under `low`, mastered the lower bound over `high`: equal is not enough."""
    at_low = CurriculumConfig(low=curriculum_module.wilson(0, 10)[1])
    row = _rows({("todo_report", "easy"): (0, 10)}, at_low)["todo_report/easy"]
    assert (row["class"], row["evidence"]) == ("unsolved", "no success yet")  # Not by its interval.
    at_high = CurriculumConfig(high=curriculum_module.wilson(10, 10)[0])
    assert _rows({("todo_report", "easy"): (10, 10)}, at_high)["todo_report/easy"]["class"] == "learnable"
    # One item is evidence too: at z = 0.5, 0 of 1 has the interval [0, 0.2].
    row = _rows({("todo_report", "easy"): (0, 1)}, CurriculumConfig(z=0.5))["todo_report/easy"]
    assert (row["class"], row["evidence"], row["ci"]) == ("unsolved", "tool_use_chain/todo_report/easy", [0.0, 0.2])


def test_every_row_records_its_interval_at_the_configured_width() -> None:
    rows = _rows({("todo_report", "easy"): (0, 2), ("line_count", "easy"): (1, 3)}, CurriculumConfig(z=1.0))
    assert rows["todo_report/easy"] | {"slice": ""} == {
        "class": "unsolved",
        "wins": 0,
        "wins_without_calls": 0,
        "n": 2,
        "ci": [0.0, 0.3333],
        "evidence": "no success yet",
        "slice": "",
    }
    assert (rows["line_count/easy"]["evidence"], rows["line_count/easy"]["ci"]) == ("undecided", [0.1356, 0.6144])


def test_a_learnable_slice_left_without_a_group_says_why_and_grpo_weights_have_four_decimals() -> None:
    even = build_curriculum(outcomes({(c, "easy"): (1, 2) for c in CATEGORIES}), FAMILIES)
    plan_generation(even, groups=2)  # Three learnable slices at even odds, two groups.
    last = even["tool_use_chain"]["slices"][6]
    assert (last["slice"], last["class"], last["groups"]) == ("csv_summary/easy", "learnable", 0)
    assert last["waits"] == "no group left: this round's 2 groups went to other slices"
    one_of_three = build_curriculum(outcomes({("todo_report", "easy"): (1, 3)}), {"tool_use_chain": ("todo_report",)})
    assert grpo_mix(one_of_three)["tool_use_chain"]["todo_report/easy"] == 0.2447  # p(1 - p), p the Wilson centre.


def test_equally_easy_slices_are_taken_from_each_env_in_turn() -> None:
    """Four slices to teach of five equally easy ones: swe_bench's first two, then the web's two (its middle
    category is learnable, not taught), never swe_bench's third before the web's second."""
    swe = ("off_by_one", "wrong_operator", "wrong_condition")
    web = ("under_price", "cheapest", "lookup_price")
    half_solved = outcomes({("cheapest", "easy"): (1, 2)}, "web_navigation")
    curriculum = build_curriculum(half_solved, {"swe_bench": swe, "web_navigation": web})
    plan_generation(curriculum, groups=20, config=CurriculumConfig(min_teacher_groups=4))  # 20 / 4 - 1: four.
    waiting = [row["slice"] for row in curriculum["swe_bench"]["slices"] if "focus of 4" in row.get("waits", "")]
    assert waiting == ["wrong_condition/easy"]
    assert all(row["groups"] == 4 for row in curriculum["web_navigation"]["slices"] if row["slice"].endswith("easy"))


def test_a_slice_whose_env_has_no_teacher_keeps_the_rounds_turn_budget() -> None:
    curriculum = build_curriculum([], {"file_stats": ()})
    plan_generation(curriculum, groups=2, max_turns=1)
    row = curriculum["file_stats"]["slices"][0]
    assert (row["teacher_turns"], row["turns"], row["groups"]) == (None, 1, 2)
