"""Curation on a hand-built rollout file: each filter removes exactly what it should."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore, StoreError
from flywheel.data.columnar import format_params, read_rows, rollouts_to_shards
from flywheel.data.curation import CurationConfig, curate, curate_to_store

LONG = " ".join(f"word{i}" for i in range(60))
EVAL_PROMPT = "Find 3 products in the toys department priced under $35 at shop zq81x and list ids p-4f2a1c p-77e0b2"


def convo(prompt: str, answer: str, tool_turns: int = 0) -> list[dict]:
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": prompt}]
    for turn in range(tool_turns):
        function = {"name": "read_file", "arguments": '{"path": "a"}'}
        call = {"id": f"c{turn}", "type": "function", "function": function}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{turn}", "name": "read_file", "content": "x"})
    messages.append({"role": "assistant", "content": answer})
    return messages


def group(item: str, rollouts: list[tuple[list[dict], float]], content_digest: str | None = None) -> dict:
    return {
        "tokens": [[1]] * len(rollouts),
        "masks": [[1]] * len(rollouts),
        "scores": [s for _, s in rollouts],
        "messages": [m for m, _ in rollouts],
        "meta": {"item_id": item, "env": "tool_use_chain", "category": "todo_report", "difficulty": "easy",
                 "content_digest": content_digest,
                 "tools": [{"type": "function", "function": {"name": "read_file"}}]},
    }  # fmt: skip


def hand_built() -> list[dict]:
    best = convo("Task one: summarise " + LONG, "answer one " + LONG, tool_turns=1)
    return [
        group(
            "g1",
            [
                (best, 1.0),
                (convo("Task one: summarise " + LONG, "slow " + LONG, 3), 1.0),
                (convo("Task one", "wrong"), 0.0),
                (convo("Task one", "meh"), 0.5),
            ],
        ),
        group("g2", [(convo("Task two", "bad"), 0.0), (convo("Task two", "worse"), 0.0)]),
        group("g3", [(best, 1.0)]),
        group(
            "g4",
            [(convo("Task one: summarise " + LONG, "answer one " + LONG.replace("word59", "x"), 1), 1.0)],
        ),
        group("g5", [(convo(EVAL_PROMPT, "p-4f2a1c: Toy 1"), 1.0)]),
        group("g6", []),
        group("g7", [(convo("Task seven is different", "fine answer here"), 1.0)]),
    ]


def test_each_filter_removes_exactly_what_it_should() -> None:
    evals = [EVAL_PROMPT] + [f"Find 3 products in the toys department priced under ${n}" for n in range(20)]
    result = curate(hand_built(), evals, CurationConfig(min_reward=1.0, top_n_per_group=1))
    assert dict(result.removed) == {
        "low_reward": 4,  # g1: 0.0 and 0.5; g2: both.
        "not_top_n": 1,  # g1: the slower of the two 1.0 rollouts.
        "exact_duplicate": 1,  # g3 repeats g1's best.
        "near_duplicate": 1,  # g4 differs from it by one word.
        "contaminated": 1,  # g5 is an evaluation task.
        "infra": 1,  # g6 lost every rollout to infra failures.
    }
    assert [row["meta"]["item_id"] for row in result.sft] == ["g1", "g7"]
    first = result.sft[0]
    assert first["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"path": "a"}  # A dict for TRL.
    assert first["tools"][0]["function"]["name"] == "read_file"
    assert [p["meta"]["item_id"] for p in result.pairs] == ["g1"]
    pair = result.pairs[0]
    assert [m["role"] for m in pair["prompt"]] == ["system", "user"]
    assert pair["chosen"][-1]["content"].startswith("answer one") and pair["rejected"][-1]["content"] == "wrong"
    card = result.card()
    assert card["sft_examples"] == 2 and card["groups_seen"] == 7 and card["rollouts_seen"] == 10
    assert sum(card["reward_histogram"].values()) == 10


def test_near_duplicates_are_searched_within_a_task_so_one_procedure_on_other_files_is_kept() -> None:
    """Two tasks of one template, solved by one procedure, their conversations one word apart: both kept when
    their `content_digest`s differ (two examples of the procedure); the same task twice is one."""
    text = "Task one: summarise " + LONG
    twins = [convo(text, "answer one " + LONG), convo(text, "answer one " + LONG.replace("word59", "x"))]
    other_tasks = [group(f"t{i}", [(m, 1.0)], content_digest=f"task-{i}") for i, m in enumerate(twins)]
    assert [row["meta"]["item_id"] for row in curate(other_tasks, []).sft] == ["t0", "t1"]
    one_task = [group(f"t{i}", [(m, 1.0)], content_digest="task-0") for i, m in enumerate(twins)]
    result = curate(one_task, [])
    assert [row["meta"]["item_id"] for row in result.sft] == ["t0"] and result.removed["near_duplicate"] == 1


def test_shared_templates_alone_are_not_contamination() -> None:
    evals = [f"Find 3 products in the toys department priced under ${n}" for n in range(30)]
    rows = [group("t", [(convo("Find 3 products in the toys department priced under $99", "ok"), 1.0)])]
    assert len(curate(rows, evals).sft) == 1


def test_a_template_a_few_eval_items_share_is_not_contamination_but_their_task_is() -> None:
    """A held-out set over many slices: each template is in only a few of its items. A task whose
    text is all template (its files differ) is contaminated only when it is the same task."""
    templates = [f"Template {t}: " + " ".join(f"w{t}x{i}" for i in range(12)) + " for {p}" for t in range(12)]
    evals = [template.format(p=f"item p{t}-{k} now") for t, template in enumerate(templates) for k in range(3)]
    todo = "Collect every TODO comment in the Python files of this repository and write report.md"
    evals += [todo] * 3  # Three held-out items, their files differ.
    rows = [
        group("fresh", [(convo(templates[0].format(p="item p0-99 now"), "ok"), 1.0)]),
        group("same", [(convo(templates[0].format(p="item p0-1 now"), "ok"), 1.0)]),
        group("other-files", [(convo(todo, "wrote report.md with 3 rows"), 1.0)], content_digest="b"),
        group("same-files", [(convo(todo, "found no TODO at all " + LONG), 1.0)], content_digest="a"),
    ]
    result = curate(rows, evals, eval_digests={"a"})
    assert [row["meta"]["item_id"] for row in result.sft] == ["fresh", "other-files"]
    assert result.removed["contaminated"] == 2  # An eval item's own parameters; an eval item's task.


def test_a_template_two_training_tasks_share_is_not_contamination_with_one_eval_item() -> None:
    """One held-out item per category (the quick profile): its prompt is the category's template,
    which every generated task of the category repeats. Two distinct generated tasks sharing the text
    make it a template; one task that alone carries it, or the held-out task itself, stays out."""
    todo = "Collect every TODO comment in the Python files of this repository and write report.md"
    rows = [
        group("b", [(convo(todo, "wrote report.md with 3 rows"), 1.0)], content_digest="b"),
        group("c", [(convo(todo, "wrote report.md with 5 rows"), 1.0)], content_digest="c"),
        group("held-out", [(convo(todo, "wrote report.md with 4 rows " + LONG), 1.0)], content_digest="a"),
    ]
    result = curate(rows, [todo], eval_digests={"a"})
    assert [row["meta"]["item_id"] for row in result.sft] == ["b", "c"]
    alone = curate(rows[:1], [todo], eval_digests={"a"})
    assert alone.sft == [] and alone.removed["contaminated"] == 1  # One task: nothing says it is a template.
    same_text = [group("d", [(convo(todo, "wrote report.md with 3 rows"), 1.0)])] * 2  # No digest: one task.
    assert curate(same_text, [todo]).removed["contaminated"] == 1


def test_low_spread_groups_are_dropped_when_asked() -> None:
    rows = [group("flat", [(convo("a", "x"), 1.0), (convo("a", "y"), 1.0)]),
            group("spread", [(convo("b", "x"), 1.0), (convo("b", "y"), 0.0)])]  # fmt: skip
    result = curate(rows, [], CurationConfig(min_group_spread=0.5))
    assert result.removed["low_spread"] == 2 and [r["meta"]["item_id"] for r in result.sft] == ["spread"]


def test_curate_to_store_records_lineage_and_card(store: ArtifactStore) -> None:
    body = "".join(json.dumps(g) + "\n" for g in hand_built())
    rollouts = store.put("rollouts", "r1", {"tool_use_chain.jsonl": body})
    evalset = store.put("evalset", "agentic", {"items.jsonl": json.dumps({"prompt": EVAL_PROMPT}) + "\n"})
    sft, pairs = curate_to_store(store, ["rollouts/r1"], "sft-r1", "pairs-r1")
    assert (sft.name, pairs.name) == ("sft-r1", "pairs-r1")
    assert set(sft.parents) == {rollouts.id, evalset.id} and sft.metrics["sft_examples"] == 2
    rows = list(read_rows(store, sft.id, "sft"))
    assert [r["meta"]["item_id"] for r in rows] == ["g1", "g7"]
    assert rows[0]["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"path": "a"}  # A dict again.
    assert "contaminated" in store.read_bytes(sft.id, "data_card.md").decode()
    assert len(list(read_rows(store, pairs.id, "pairs"))) == 1
    assert sft.params["format"]["version"] == 1 and "messages: string" in sft.params["format"]["schema"]


def test_a_held_out_set_stored_every_round_still_flags_its_items(store: ArtifactStore) -> None:
    """Each round stores its held-out set again: the items count once, so what only one item has
    stays rare (counted twice, every n-gram of the set looked like template text, and nothing was
    flagged from round 2 on)."""
    store.put("rollouts", "r1", {"tool_use_chain.jsonl": "".join(json.dumps(g) + "\n" for g in hand_built())})
    for _ in range(2):
        store.put("evalset", "agentic", {"items.jsonl": json.dumps({"prompt": EVAL_PROMPT}) + "\n"})
    sft, _ = curate_to_store(store, ["rollouts/r1"], "sft-r2", "pairs-r2")
    assert sft.metrics["removed"]["contaminated"] == 1 and len(sft.parents) == 3  # g5; both evalsets in lineage.


def test_curation_screened_in_shards_makes_the_same_datasets(tmp_path: Path) -> None:
    """Each rollouts shard screened apart (as on a cluster), the candidates selected in one merge: the
    rows, their order and the card equal a curation in one pass (near-duplicates across shards too)."""
    store = ArtifactStore(tmp_path / "store")
    source = tmp_path / "tool_use_chain-teacher.jsonl"
    source.write_text("".join(json.dumps(g) + "\n" for g in hand_built()))
    files = {p.name: p for p in rollouts_to_shards(source, tmp_path / "shards", rows_per_shard=2)}
    files["web-teacher.jsonl"] = json.dumps(group("w1", [(convo("Web task", "answer"), 1.0)])) + "\n"  # A JSONL part.
    store.put("rollouts", "r1", files, params=format_params("rollouts"))
    store.put("evalset", "agentic", {"items.jsonl": json.dumps({"prompt": EVAL_PROMPT}) + "\n"})
    whole = curate_to_store(store, ["rollouts/r1"], "sft-whole", "pairs-whole")
    ran: list[tuple[str, str]] = []

    def in_turn(screen, shards):
        ran.extend(shards)
        return [screen(shard) for shard in shards]

    sharded = curate_to_store(store, ["rollouts/r1"], "sft-sharded", "pairs-sharded", map_shards=in_turn)
    assert len(ran) == 5 and ran[-1][1] == "web-teacher.jsonl"  # 4 Parquet shards of 7 groups, 1 JSONL part.
    for kind, (a, b) in (("sft", (whole[0], sharded[0])), ("pairs", (whole[1], sharded[1]))):
        assert list(read_rows(store, b.id, kind)) == list(read_rows(store, a.id, kind))
    assert sharded[0].metrics == whole[0].metrics and whole[0].metrics["removed"]["near_duplicate"] == 1
    assert {store.manifest(p).kind for p in sharded[0].parents} == {"rollouts", "evalset", "candidates"}
    # A round that carries a kept-out round's rollouts curates two artifacts of the same part names: a
    # screened ref each, and the same rows as in one pass.
    store.put("rollouts", "r2", {"tool_use_chain-teacher.jsonl": json.dumps(group("g9", [(convo("New", "a"), 1.0)]))})
    both = ["rollouts/r2", "rollouts/r1"]
    whole = curate_to_store(store, both, "sft-whole-2", "pairs-whole-2")
    sharded = curate_to_store(store, both, "sft-sharded-2", "pairs-sharded-2", map_shards=in_turn)
    assert list(read_rows(store, sharded[0].id, "sft")) == list(read_rows(store, whole[0].id, "sft"))
    screened = [store.manifest(p).name for p in sharded[0].parents if store.manifest(p).kind == "candidates"]
    assert len(screened) == len(set(screened)) == 6 and "sft-sharded-2-screened-r2-tool_use_chain-teacher" in screened


def test_a_bad_rollout_line_fails_clearly_and_stores_nothing(store: ArtifactStore) -> None:
    store.put("rollouts", "bad", {"x.jsonl": json.dumps(hand_built()[0]) + "\n{not json\n"})
    before = len(store.list())
    with pytest.raises(StoreError, match=r"rollouts/bad:x.jsonl line 2 is not JSON"):
        curate_to_store(store, ["rollouts/bad"], "broken-sft", "broken-pairs")
    assert len(store.list()) == before
