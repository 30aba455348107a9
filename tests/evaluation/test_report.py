"""The report's figures, read back from the matplotlib objects: integer round ticks and envs that do not
hide each other, the slices' heat map with their curriculum classes, flagged slices in red."""

from __future__ import annotations

import json

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import pytest

from flywheel.data import ArtifactStore
from flywheel.evaluation.report import FLAGGED, UNFLAGGED, build_report, heatmap_figure, success_figure, weakest_figure


def test_success_per_env_has_round_ticks_and_distinguishable_lines() -> None:
    fig = success_figure({0: {"web": 0.0, "tool": 0.0, "swe": 0.0}, 1: {"web": 0.5, "tool": 1.0, "swe": 0.0}})
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == [0, 1]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["base", "1"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["swe", "tool", "web"]
    lines = ax.get_lines()
    assert len({(line.get_marker(), line.get_linestyle()) for line in lines}) == 3  # Each env its own style.
    at_base = sorted(line.get_xdata()[0] for line in lines)
    assert at_base[0] < at_base[1] < at_base[2] and all(abs(x) < 0.2 for x in at_base)  # Side by side at 0.0.
    plt.close(fig)


def test_weakest_slices_mark_flagged_ones_red_with_their_point_estimates() -> None:
    slices = [
        {"slice": "env|a|hard", "success_rate": 0.1, "success_ci95": [0.0, 0.4], "weak": True},
        {"slice": "env|b|easy", "success_rate": 0.6, "success_ci95": [0.3, 0.8], "weak": False},
    ]
    fig = weakest_figure(slices)
    ax = fig.axes[0]
    points = {line.get_xdata()[0]: line.get_color() for line in ax.get_lines() if line.get_marker() == "o"}
    assert mcolors.same_color(points[0.1], FLAGGED) and mcolors.same_color(points[0.6], UNFLAGGED)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["flagged weak", "not flagged"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["env|b|easy", "env|a|hard"]  # Weakest on top.
    plt.close(fig)


def test_the_heat_map_has_a_panel_a_round_and_each_slices_class() -> None:
    slices = {0: {"tool/todo/easy": 0.0, "tool/todo/medium": 0.0}, 1: {"tool/todo/easy": 1.0, "tool/todo/medium": 0.0}}
    classes = {0: {"tool/todo/easy": "unsolved", "tool/todo/medium": "locked"},
               1: {"tool/todo/easy": "mastered", "tool/todo/medium": "unsolved"}}  # fmt: skip
    fig = heatmap_figure(slices, classes)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["base", "round 1"]
    assert [t.get_text() for t in panels[1].get_xticklabels()] == ["easy", "medium"]
    marks = [{(t.get_position(), t.get_text()) for t in ax.texts} for ax in panels]
    assert marks[0] == {((0, 0), "U"), ((1, 0), "-")} and marks[1] == {((0, 0), "M"), ((1, 0), "U")}
    assert panels[1].images[0].get_array().tolist() == [[1.0, 0.0]]
    plt.close(fig)


@pytest.fixture
def two_rounds(tmp_path) -> tuple[ArtifactStore, dict[int, dict]]:
    store = ArtifactStore(tmp_path)
    rounds = {}
    for n, won in ((0, 0), (1, 2)):
        rows = [{"env": "tool_use_chain", "category": "todo_report", "difficulty": "easy", "item_id": f"i{i}",
                 "reward": float(i < won), "success": i < won} for i in range(2)]  # fmt: skip
        rows.append({"env": "tool_use_chain", "category": "todo_report", "difficulty": "easy", "reward": None})
        evals = store.put(
            "eval", f"agentic-r{n}", {"samples/tool_use_chain.jsonl": "".join(json.dumps(r) + "\n" for r in rows)}
        )
        curriculum = {"slices": {"tool_use_chain": {"slices": [{"slice": "todo_report/easy", "class": "unsolved"}]}}}
        weak = store.put("weaknesses", f"weaknesses-r{n}", {"curriculum.json": json.dumps(curriculum)})
        rounds[n] = {"evals": [evals.id], "weaknesses": weak.id}
    return store, rounds


def test_the_report_draws_every_round(two_rounds: tuple[ArtifactStore, dict[int, dict]]) -> None:
    store, rounds = two_rounds
    report = build_report(store, rounds[1]["evals"], "report-r1", rounds)
    assert {"success_per_env.png", "curriculum_heatmap.png", "weakest_slices.png"} <= set(report.files)
    html = store.read_bytes(report.id, "report.html").decode()
    assert html.count("<img") == 4
