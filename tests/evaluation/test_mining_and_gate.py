"""Weakness mining ranks a planted weak slice first and up-weights it; the gate refuses a planted
regression and accepts a planted improvement."""

from __future__ import annotations

import io
import json
import random

from flywheel.data import ArtifactStore
from flywheel.evaluation import gate as gate_module
from flywheel.evaluation.gate import GateConfig, decide, gate
from flywheel.evaluation.weakness import CurriculumSpec, MiningConfig, flatten, mine, mine_to_store


def _samples(rates: dict[tuple[str, str, str], float], n: int = 20, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for (env, category, difficulty), rate in rates.items():
        for i in range(n):
            ok = rng.random() < rate
            out.append(
                {
                    "env": env,
                    "item_id": f"{env}-{category}-{difficulty}-{i}",
                    "category": category,
                    "difficulty": difficulty,
                    "reward": float(ok),
                    "success": ok,
                    "turns_used": 3,
                    "tool_errors": [] if ok else [{"error": "unknown tool 'x'"}],
                    "messages": [{"role": "user", "content": "task"}, {"role": "assistant", "content": "no"}],
                }
            )
    return out


KEY = ("tool_use_chain", "todo_report", "easy")
PLANTED = {
    ("tool_use_chain", "todo_report", "easy"): 0.95,
    ("tool_use_chain", "todo_report", "hard"): 0.05,  # The planted weak slice.
    ("tool_use_chain", "csv_summary", "easy"): 0.9,
    ("swe_bench", "off_by_one", "medium"): 0.8,
}


def test_miner_ranks_the_planted_weak_slice_first() -> None:
    result = mine(flatten("agentic", _samples(PLANTED)), MiningConfig(threshold=0.5, min_samples=5))
    assert result["slices"][0]["slice"] == "tool_use_chain|todo_report|hard"
    assert result["slices"][0]["weak"] and result["slices"][0]["exemplars"]
    assert "tool_use_chain|todo_report|easy" not in result["weak"]
    assert "tool_use_chain|error:unknown_tool|*" in {r["slice"] for r in result["slices"]}


def test_small_slices_are_never_flagged() -> None:
    result = mine(flatten("agentic", _samples({("x", "c", "easy"): 0.0}, n=3)), MiningConfig(min_samples=5))
    assert result["weak"] == []


def test_mining_tracks_slices_across_rounds(store: ArtifactStore) -> None:
    spec = CurriculumSpec(families={"tool_use_chain": ("todo_report", "line_count", "csv_summary")})
    first = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl(_samples(PLANTED))})
    mined = mine_to_store(store, [first.id], curriculum=spec, name="weaknesses-r0")
    better = dict(PLANTED) | {("tool_use_chain", "todo_report", "hard"): 0.6}
    second = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl(_samples(better, seed=1))})
    manifest = mine_to_store(store, [second.id], curriculum=spec, name="weaknesses-r1", previous=mined.id)
    history = store.read_json(manifest.id, "weaknesses.json")["history"]["tool_use_chain|todo_report|hard"]
    assert len(history) == 2 and history[1] < history[0]
    assert manifest.parents == [second.id, mined.id]
    slices = store.read_json(manifest.id, "curriculum.json")["slices"]["tool_use_chain"]
    assert {r["slice"]: r["class"] for r in slices["slices"]}["todo_report/easy"] == "mastered"
    assert "todo_report/medium" in slices["unlocked"]


def test_the_champions_own_rollouts_count_toward_mastery(store: ArtifactStore) -> None:
    """Held out once and solved (1/1), a slice stays learnable; its policy rollouts, all solved, make it
    mastered and unlock the next difficulty. The teacher's rollouts say nothing about the model."""
    spec = CurriculumSpec(families={"tool_use_chain": ("line_count",)})
    slice_ = {"category": "line_count", "difficulty": "easy"}
    held_out = {"env": "tool_use_chain", "item_id": "h0", "reward": 1.0, "success": True} | slice_
    evals = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl([held_out])})
    meta = {"env": "tool_use_chain", "completed": [True, True]} | slice_
    group = {"scores": [1.0, 1.0], "messages": [], "meta": meta}

    def classes(label: str) -> tuple[dict[str, str], list[str]]:
        part = {"env": "tool_use_chain", "label": label, "groups": 4}
        files = {f"tool_use_chain-{label}.jsonl": _jsonl([group] * 4)}
        rollouts = store.put("rollouts", f"round1-{label}", files, params={"parts": [part]})
        mined = mine_to_store(store, [evals.id], curriculum=spec, name=f"w-{label}", rollouts=rollouts.id)
        assert mined.parents == [evals.id, rollouts.id]
        env = store.read_json(mined.id, "curriculum.json")["slices"]["tool_use_chain"]
        return {r["slice"]: r["class"] for r in env["slices"]}, env["unlocked"]

    by_teacher, unlocked = classes("teacher")
    assert by_teacher["line_count/easy"] == "learnable" and unlocked == ["line_count/easy"]
    by_policy, unlocked = classes("policy")
    assert by_policy["line_count/easy"] == "mastered" and "line_count/medium" in unlocked


def test_successes_without_a_tool_call_are_counted_apart(store: ArtifactStore) -> None:
    """A held-out success or a policy rollout that made no tool call (declining an irrelevance task) is a
    win the curriculum records as `wins_without_calls`: what keeps a do-nothing base in `focus`."""
    spec = CurriculumSpec(families={"function_calling": ("choose_or_refuse",)})
    slice_ = {"env": "function_calling", "category": "choose_or_refuse", "difficulty": "easy"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    declined = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "None fits."}]
    held_out = [
        slice_ | {"item_id": f"h{i}", "reward": 1.0, "success": True, "messages": messages}
        for i, messages in enumerate([declined, declined, [*declined[:1], call]])
    ]
    evals = store.put("eval", "agentic", {"samples/function_calling.jsonl": _jsonl(held_out)})
    group = {"scores": [1.0, 1.0], "messages": [declined, [call]], "meta": slice_ | {"completed": [True, True]}}
    part = {"env": "function_calling", "label": "policy", "groups": 1}
    rollouts = store.put("rollouts", "r1", {"function_calling-policy.jsonl": _jsonl([group])}, params={"parts": [part]})
    mined = mine_to_store(store, [evals.id], curriculum=spec, name="w", rollouts=rollouts.id)
    row = store.read_json(mined.id, "curriculum.json")["slices"]["function_calling"]["slices"][0]
    assert (row["slice"], row["wins"], row["wins_without_calls"], row["n"]) == ("choose_or_refuse/easy", 5, 3, 5)


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _outcomes(rates: dict[str, float], n: int = 60, seed: int = 0) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    groups: dict[str, dict[str, float]] = {"primary": {}}
    for env, rate in rates.items():
        groups[f"env/{env}"] = {}
        for i in range(n):
            value = float(rng.random() < rate)
            groups["primary"][f"{env}:{i}"] = value
            groups[f"env/{env}"][f"{env}:{i}"] = value
    return groups


def test_gate_accepts_an_improvement_and_refuses_a_regression() -> None:
    champion = _outcomes({"a": 0.3, "b": 0.6})
    better = _outcomes({"a": 0.8, "b": 0.62}, seed=1)
    worse_guard = _outcomes({"a": 0.95, "b": 0.2}, seed=2)  # Primary up, env b collapses.
    assert decide(better, champion)["promote"]
    refused = decide(worse_guard, champion, GateConfig(tolerance=0.05))
    assert not refused["promote"] and "env/b" in refused["reason"] and refused["guards"]["env/b"]["regressed"]
    assert not decide(champion, better)["promote"]


def _wins(wins: int, n: int = 30) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Candidate and champion on `n` shared items: the candidate alone solves `wins`, the rest are ties."""
    keys = [f"tool_use_chain:{i}" for i in range(n)]
    return {"primary": {k: float(i < wins) for i, k in enumerate(keys)}}, {"primary": dict.fromkeys(keys, 0.0)}


def test_gate_promotes_only_at_the_bootstrap_confidence() -> None:
    """A resample of 30 items beats the champion iff it draws a won item: P(better) = 1 - (1 - wins/30)^30,
    0.874 for 2 wins (under the default 0.9: refused although the mean is up) and 0.958 for 3 (promoted)."""
    below, above = decide(*_wins(2)), decide(*_wins(3))
    assert below["primary_delta"] > 0 and abs(below["p_better"] - (1 - (28 / 30) ** 30)) < 0.02
    assert not below["promote"] and "< 0.9" in below["reason"]
    assert abs(above["p_better"] - (1 - (27 / 30) ** 30)) < 0.02 and above["promote"]
    # A confidence equal to the estimate is met.
    assert decide(*_wins(3), GateConfig(confidence=above["p_better"]))["promote"]
    assert not decide(*_wins(3), GateConfig(confidence=above["p_better"] + 0.0005))["promote"]


def test_a_guard_refuses_only_a_drop_beyond_the_tolerance_that_the_bootstrap_is_sure_of() -> None:
    """The primary metric is clearly up (env a: +10 of 20); env b loses 1 of its 20 items (exactly the 0.05
    tolerance: allowed unexamined), 2 (beyond it, but a resample misses both with (18/20)^20: P(worse) 0.88,
    under 0.9: allowed) and 3 (P(worse) 1 - (17/20)^20 = 0.96: refused)."""

    def outcomes(a: int, b: int) -> dict[str, dict[str, float]]:
        """Successes on the first `a` of env a's 20 items and the last `b` of env b's."""
        envs = {
            "env/a": {f"a:{i}": float(i < a) for i in range(20)},
            "env/b": {f"b:{i}": float(i >= 20 - b) for i in range(20)},
        }
        return {"primary": envs["env/a"] | envs["env/b"], **envs}

    champion = outcomes(0, 20)
    within = decide(outcomes(10, 19), champion)
    assert within["promote"] and within["guards"] == {
        "env/a": {"delta": 0.5, "n": 20, "p_worse": None, "regressed": False},
        "env/b": {"delta": -0.05, "n": 20, "p_worse": None, "regressed": False},
    }
    unsure = decide(outcomes(10, 18), champion)
    assert unsure["promote"] and unsure["guards"]["env/b"]["delta"] == -0.1
    assert abs(unsure["guards"]["env/b"]["p_worse"] - (1 - (18 / 20) ** 20)) < 0.02
    assert not unsure["guards"]["env/b"]["regressed"]
    beyond = decide(outcomes(10, 17), champion)
    assert beyond["p_better"] >= 0.9 and not beyond["promote"] and "env/b" in beyond["reason"]
    assert beyond["guards"]["env/b"]["delta"] == -0.15 and beyond["guards"]["env/b"]["regressed"]
    assert abs(beyond["guards"]["env/b"]["p_worse"] - (1 - (17 / 20) ** 20)) < 0.02
    # The guard's confidence is the gate's: at 0.85, two items lost are sure enough to refuse.
    assert not decide(outcomes(10, 18), champion, GateConfig(confidence=0.85))["promote"]
    # Each guard draws its own resamples: another guard's drop (sorted before it) leaves its P(worse) as it was.
    another = {f"0:{i}": 1.0 for i in range(10)}
    with_another = decide(outcomes(10, 18) | {"env/0": {k: 0.0 for k in another}}, champion | {"env/0": another})
    assert with_another["guards"]["env/0"]["regressed"]
    assert with_another["guards"]["env/b"]["p_worse"] == unsure["guards"]["env/b"]["p_worse"]


def test_a_metric_without_shared_items_is_reported_unguarded() -> None:
    """Nothing to compare is no regression, but the decision says which metrics went unguarded."""
    candidate, champion = _wins(3)
    candidate["task/arc"], champion["task/arc"] = {"0#new": 1.0}, {"0#old": 1.0}  # The task changed: no pair.
    candidate["task/mmlu"] = {"0#a": 0.0}  # Only the candidate ran it.
    decision = decide(candidate, champion)
    assert decision["promote"] and decision["guards"] == {} and decision["unguarded"] == ["task/arc", "task/mmlu"]
    assert decision["reason"].endswith("; not guarded (no shared items): task/arc, task/mmlu")


def test_gate_moves_the_champion_ref_and_records_the_decision(store: ArtifactStore) -> None:
    weak, strong = store.put("checkpoint", "m1", {"w": b"1"}), store.put("checkpoint", "m2", {"w": b"2"})
    base = {("tool_use_chain", "todo_report", "easy"): 0.3}
    e1 = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl(_samples(base, n=60))})
    first = gate(store, [e1.id], weak.id)
    assert store.resolve("champion") == weak.id and store.read_json(first.id, "decision.json") == {
        "promote": True,
        "reason": "no champion yet: the first candidate becomes champion",
        "candidate": weak.id,
        "candidate_evals": [e1.id],
        "champion_before": None,
    }
    e2 = store.put(
        "eval",
        "agentic",
        {
            "samples/tool_use_chain.jsonl": _jsonl(
                _samples({("tool_use_chain", "todo_report", "easy"): 0.9}, n=60, seed=3)
            )
        },
    )
    second = gate(store, [e2.id], strong.id)
    assert store.read_json(second.id, "decision.json")["promote"] and store.resolve("champion") == strong.id
    e3 = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl(_samples(base, n=60, seed=4))})
    third = gate(store, [e3.id], weak.id)
    assert not store.read_json(third.id, "decision.json")["promote"] and store.resolve("champion") == strong.id
    assert [m.metrics for m in (first, second, third)] == [{"promote": True}, {"promote": True}, {"promote": False}]


def test_a_champion_moved_while_the_gate_ran_leaves_no_claimed_promotion(store: ArtifactStore, monkeypatch) -> None:
    weak, strong, other = (store.put("checkpoint", f"m{i}", {"w": str(i).encode()}) for i in range(3))
    e1 = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl(_samples({KEY: 0.3}, n=60))})
    gate(store, [e1.id], weak.id)
    e2 = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl(_samples({KEY: 0.9}, n=60, seed=3))})

    def decide_while_another_gate_promotes(*args, **kwargs):  # type: ignore[no-untyped-def]
        store.set_ref("champion", other.id)  # A concurrent round's gate wins the race.
        return decide(*args, **kwargs)

    monkeypatch.setattr(gate_module, "decide", decide_while_another_gate_promotes)
    lost = store.read_json(gate(store, [e2.id], strong.id).id, "decision.json")
    assert not lost["promote"] and "moved" in lost["reason"] and store.resolve("champion") == other.id
    assert store.read_json("champion-evals", "decision.json")["candidate"] == weak.id  # Not re-pointed.


def test_report_renders_html_and_non_empty_plots(store: ArtifactStore) -> None:
    from PIL import Image

    from flywheel.evaluation.report import build_report

    evals = store.put(
        "eval",
        "agentic",
        {"samples/tool_use_chain.jsonl": _jsonl(_samples(PLANTED))},
        metrics={"tool_use_chain/success_rate": 0.4},
    )
    weak = mine_to_store(store, [evals.id])
    checkpoint = store.put("checkpoint", "m", {"w": b"1"})
    decision = gate(store, [evals.id], checkpoint.id)
    report = build_report(store, [evals.id, weak.id, decision.id], "r1")
    assert {"report.html", "summary.md", "success_per_env.png", "reward_distribution.png", "weakest_slices.png"} <= set(
        report.files
    )
    for png in ("success_per_env.png", "reward_distribution.png", "weakest_slices.png"):
        image = Image.open(io.BytesIO(store.read_bytes(report.id, png))).convert("L")
        assert image.size[0] > 100 and len(set(image.getdata())) > 5  # Something was drawn.
    text = store.read_bytes(report.id, "summary.md").decode()
    assert "tool_use_chain|todo_report|hard" in text and "PROMOTED" in text
    assert "<img" in store.read_bytes(report.id, "report.html").decode()


def test_gate_judges_the_champion_again_when_the_held_out_items_changed(store: ArtifactStore) -> None:
    from flywheel.evaluation.gate import recorded_evals, shares_items

    old, new = store.put("checkpoint", "old", {"w": b"1"}), store.put("checkpoint", "new", {"w": b"2"})
    slice_ = ("tool_use_chain", "todo_report", "easy")
    first = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl(_samples({slice_: 0.2}, n=40))})
    gate(store, [first.id], old.id)
    moved = [{**s, "item_id": "v2-" + s["item_id"]} for s in _samples({slice_: 0.9}, n=40, seed=5)]
    candidate = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl(moved)})
    recorded = recorded_evals(store, old.id)
    assert recorded == [first.id] and not shares_items(store, [candidate.id], recorded)
    assert recorded_evals(store, new.id) == []  # What was recorded is the champion's, not any model's.
    unfair = store.read_json(gate(store, [candidate.id], new.id, name="unfair").id, "decision.json")
    assert not unfair["promote"] and "no shared primary items" in unfair["reason"]
    assert store.resolve("champion") == old.id
    # The champion judged on the candidate's items (here: it solves a fifth of them).
    rejudged = [{**s, "item_id": "v2-" + s["item_id"]} for s in _samples({slice_: 0.2}, n=40, seed=6)]
    champion_eval = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl(rejudged)})
    assert shares_items(store, [candidate.id], [champion_eval.id])
    fair = store.read_json(gate(store, [candidate.id], new.id, champion_evals=[champion_eval.id]).id, "decision.json")
    assert fair["promote"] and fair["n_shared"] == 40 and store.resolve("champion") == new.id
    # The same gate again (a resumed round) finds its candidate champion already and keeps it.
    again = gate(store, [candidate.id], new.id, champion_evals=[champion_eval.id], champion=old.id, name="again")
    assert store.read_json(again.id, "decision.json")["promote"] and store.resolve("champion") == new.id


def test_an_item_whose_task_changed_is_not_the_same_item(store: ArtifactStore) -> None:
    """Same ids, new task content (a task family changed between rounds): the champion is judged again."""
    from flywheel.evaluation.gate import shares_items

    def with_prompt(rows: list[dict], task: str) -> list[dict]:
        return [{**r, "task_digest": task} for r in rows]  # What eval samples record (environments/agent/records.py).

    def stored(name: str, rows: list[dict]) -> str:
        return store.put("eval", name, {"samples/tool_use_chain.jsonl": _jsonl(rows)}).id

    rows = _samples({KEY: 0.5}, n=10)
    before = stored("agentic", with_prompt(rows, "a1b2c3"))
    same = stored("agentic-again", with_prompt(rows, "a1b2c3"))
    after = stored("agentic-typed", with_prompt(rows, "d4e5f6"))
    assert shares_items(store, [same], [before]) and not shares_items(store, [after], [before])


def test_without_primary_items_on_either_side_nothing_is_promoted() -> None:
    """Only lm-eval tasks on one side (no agentic eval): there is nothing to pair, so no promotion."""
    agentic, _ = _wins(3)
    tasks_only = {"task/arc": {"0#a": 1.0}}
    for candidate, champion in ((tasks_only, agentic), (agentic, tasks_only)):
        assert decide(candidate, champion) == {
            "promote": False,
            "reason": "no shared primary items between candidate and champion",
        }


def test_the_bootstrap_is_seeded_so_a_decision_can_be_reproduced() -> None:
    """One won item of 30 is a coin flip for the bootstrap: the same `GateConfig.seed` gives the same
    P(better) every time (the gate artifact records it), another value another estimate."""
    estimates = {decide(*_wins(1), GateConfig(seed=0))["p_better"] for _ in range(3)}
    assert estimates == {0.6495}
    assert decide(*_wins(1), GateConfig(seed=1))["p_better"] == 0.638


def test_a_guard_delta_is_recorded_to_four_decimals() -> None:
    candidate = {"primary": dict.fromkeys(("a:0", "a:1", "a:2"), 1.0), "env/x": {"x:0": 0.0, "x:1": 1.0, "x:2": 1.0}}
    champion = {
        "primary": dict.fromkeys(("a:0", "a:1", "a:2"), 0.0),
        "env/x": dict.fromkeys(("x:0", "x:1", "x:2"), 1.0),
    }
    [guard] = decide(candidate, champion)["guards"].values()
    assert (guard["delta"], guard["n"], guard["regressed"]) == (-0.3333, 3, False)  # 1 of 3: P(worse) ~ 0.70.
    assert abs(guard["p_worse"] - (1 - (2 / 3) ** 3)) < 0.03 and len(str(guard["p_worse"]).split(".")[1]) <= 4


def _lm_eval_samples(target: object, prompt: str = "2 + 2 =") -> str:
    """One lm-eval task's per-document samples (`evaluation/lm_eval_runner.py` writes these fields)."""
    return _jsonl([{"task": "arith", "doc_id": 0, "prompt": prompt, "target": target, "success": True}])


def test_lm_eval_documents_pair_by_id_and_content(store: ArtifactStore) -> None:
    """A document is the same item when its id, prompt and target are (the target's key order aside): a
    changed prompt or target (a new suite version) pairs nothing. An eval with lm-eval tasks only shares
    no agentic item with any other."""
    from flywheel.evaluation.gate import paired_outcomes, shares_items

    def keys(target: object, prompt: str = "2 + 2 =") -> list[str]:
        files = {"samples/arith.jsonl": _lm_eval_samples(target, prompt)}
        outcomes = paired_outcomes(store, store.put("eval", "lm-eval", files).id)
        assert set(outcomes) == {"task/arith"} and set(outcomes["task/arith"].values()) == {1.0}
        return list(outcomes["task/arith"])

    [key] = keys({"answer": "4", "unit": "none"})
    assert key.startswith("0#") and len(key) == 2 + 12 and int(key[2:], 16) >= 0
    assert keys({"unit": "none", "answer": "4"}) == [key]
    assert keys({"answer": "5", "unit": "none"}) != [key]
    assert keys({"answer": "4", "unit": "none"}, prompt="2 + 2 = ?") != [key]
    lm_only = store.put("eval", "lm-eval", {"samples/arith.jsonl": _lm_eval_samples("4")}).id
    agentic = store.put("eval", "agentic", {"samples/tool_use_chain.jsonl": _jsonl(_samples({KEY: 0.5}, n=4))}).id
    assert not shares_items(store, [lm_only], [agentic]) and not shares_items(store, [agentic], [lm_only])


def test_the_decision_names_every_reason_and_rounds_to_four_decimals() -> None:
    primary_up, champion = _wins(30)
    candidate = primary_up | {"env/a": {"a:0": 0.0}, "env/b": {"b:0": 0.0}, "task/arc": {"0#new": 1.0}}
    champion |= {"env/a": {"a:0": 1.0}, "env/b": {"b:0": 1.0}, "task/arc": {"0#old": 1.0}}
    assert decide(candidate, champion)["reason"] == (
        "guarded metrics regressed beyond 0.05 (P(worse) >= 0.9): env/a, env/b; not guarded (no shared items): task/arc"
    )
    one_of_three = decide(*_wins(1, n=3), GateConfig(bootstrap=300))  # 1/3 up, P(better) 215/300.
    assert (one_of_three["primary_delta"], one_of_three["p_better"]) == (0.3333, 0.7167)
