"""Per-round reports: HTML + PNG plots + a markdown summary, stored as a `report` artifact.

Figures: held-out success per env across rounds, a heat map of every slice's success per round with
the curriculum class mining gave it, the reward distribution of this round's rollouts, and the
weakest slices with their 95 % intervals (flagged ones in red). The
HTML also lists evaluation samples with their rewards (like Atropos' rollout viewer).
"""

from __future__ import annotations

import html
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from flywheel.data import ArtifactStore, Manifest
from flywheel.data.columnar import read_rows, splits
from flywheel.environments.registry import env_name
from flywheel.evaluation.weakness import stored_curriculum

FLAGGED, UNFLAGGED = "#cc3311", "#777777"
CLASS_MARKS = {"unsolved": "U", "learnable": "L", "mastered": "M", "locked": "-"}
_STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--")]


def success_figure(per_round: dict[int, dict[str, float]]) -> Any:
    """Held-out success per env across rounds: integer round ticks, one marker and line style an env,
    envs at equal values side by side (dodged) rather than on top of each other."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    rounds = sorted(per_round)
    envs = sorted({env for rates in per_round.values() for env in rates})
    for i, env in enumerate(envs):
        marker, line = _STYLES[i % len(_STYLES)]
        dodge = (i - (len(envs) - 1) / 2) * 0.06
        xs = [n + dodge for n in rounds if env in per_round[n]]
        ax.plot(
            xs, [per_round[n][env] for n in rounds if env in per_round[n]], marker=marker, linestyle=line, label=env
        )
    ax.set_xticks(rounds, [("base" if n == 0 else str(n)) for n in rounds])
    ax.set(xlabel="round", ylabel="held-out success", ylim=(-0.05, 1.05), title="Held-out success per env")
    if envs:
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def heatmap_figure(slices: dict[int, dict[str, float]], classes: dict[int, dict[str, str]]) -> Any:
    """Success per env/category (rows) x difficulty (columns), one panel a round; each cell marked with the
    curriculum class the round's mining gave the slice (U unsolved: taught, L learnable, M mastered,
    - locked), so what was taught, learnt and unlocked reads across the panels."""
    plt = pyplot()
    rounds = sorted(slices) or [0]
    keys = sorted({key for per in slices.values() for key in per} | {k for per in classes.values() for k in per})
    rows = sorted({key.rsplit("/", 1)[0] for key in keys}) or ["(no held-out items)"]
    columns = [d for d in ("easy", "medium", "hard") if any(k.endswith(f"/{d}") for k in keys)] or ["all"]
    fig, axes = plt.subplots(1, len(rounds), figsize=(2.2 * len(rounds) + 2, 0.35 * len(rows) + 1.5), squeeze=False)
    for ax, n in zip(axes[0], rounds, strict=True):
        grid = [[slices.get(n, {}).get(f"{row}/{col}", float("nan")) for col in columns] for row in rows]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for r, row in enumerate(rows):
            for c, col in enumerate(columns):
                mark = CLASS_MARKS.get(classes.get(n, {}).get(f"{row}/{col}", ""), "")
                ax.text(c, r, mark, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(columns)), columns, fontsize=7)
        ax.set_yticks(range(len(rows)), rows if ax is axes[0][0] else [], fontsize=7)
        ax.set_title("base" if n == 0 else f"round {n}", fontsize=9)
    fig.colorbar(image, ax=list(axes[0]), label="held-out success", shrink=0.8)
    fig.suptitle("Slices per round (U taught, L learnable, M mastered, - locked)", fontsize=9)
    return fig


def weakest_figure(slices: list[dict[str, Any]]) -> Any:
    """The weakest slices: each point estimate with its 95 % Wilson interval, flagged ones in red."""
    plt = pyplot()
    worst = slices[:10][::-1]
    fig, ax = plt.subplots(figsize=(7, 0.4 * max(3, len(worst)) + 1))
    for y, s in enumerate(worst):
        low, high = s["success_ci95"]
        color = FLAGGED if s["weak"] else UNFLAGGED
        ax.errorbar(s["success_rate"], y, xerr=[[s["success_rate"] - low], [high - s["success_rate"]]], fmt="o",
                    color=color, ecolor=color, capsize=3)  # fmt: skip
    ax.set_yticks(range(len(worst)), [s["slice"] for s in worst], fontsize=7)
    handles = [plt.Line2D([], [], color=c, marker="o", linestyle="") for c in (FLAGGED, UNFLAGGED)]
    ax.legend(handles, ["flagged weak", "not flagged"], fontsize=7, loc="lower right")
    ax.set(xlim=(-0.02, 1.02), xlabel="success rate (95% Wilson interval)", title="Weakest slices")
    fig.tight_layout()
    return fig


def reward_figure(rewards: list[float]) -> Any:
    """The reward distribution of the round's evaluation and rollouts."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(rewards, bins=[i / 10 for i in range(11)], color="#4477aa", edgecolor="white")
    ax.set(xlabel="reward", ylabel="rollouts", title=f"Reward distribution ({len(rewards)} rollouts)")
    fig.tight_layout()
    return fig


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: figures are files, never windows (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(out: Path, figures: dict[str, Any]) -> list[str]:
    """Each figure as `<name>.png` in `out` (closed after); the file names."""
    plt = pyplot()
    for name, fig in figures.items():
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
    return [f"{name}.png" for name in figures]


def build_report(
    store: ArtifactStore, refs: list[str], name: str = "round", rounds: dict[int, dict[str, Any]] | None = None
) -> Manifest:
    """Report on the given eval / weaknesses / gate / rollouts artifacts (kinds are detected); `rounds`:
    every round so far as `{n: {"evals": [candidate eval ids], "weaknesses": id or None}}`, for the
    figures across rounds (None: the given evals as one round)."""
    manifests = [store.manifest(ref) for ref in refs]
    by_kind: dict[str, list[Manifest]] = {}
    for manifest in manifests:
        by_kind.setdefault(manifest.kind, []).append(manifest)
    samples = [
        json.loads(line)
        for m in by_kind.get("eval", [])
        for path in sorted(p for p in m.files if p.startswith("samples/"))
        for line in store.read_bytes(m.id, path).decode().splitlines()
    ]
    agentic = [s for s in samples if "env" in s]
    rewards = [s["reward"] for s in agentic if s.get("reward") is not None]
    for rollouts in by_kind.get("rollouts", []):
        for split in splits(rollouts):
            for group in read_rows(store, rollouts.id, "rollouts", split):
                rewards.extend(group.get("scores") or [])
    mined = by_kind.get("weaknesses", [None])[0]
    weak = store.read_json(mined.id, "weaknesses.json") if mined else {}
    curriculum = (stored_curriculum(store, mined.id) if mined else None) or {}
    slices = weak.get("slices", [])
    gate = store.read_json(by_kind["gate"][0].id, "decision.json") if "gate" in by_kind else None
    if rounds is None:
        rounds = {0: {"evals": [m.id for m in by_kind.get("eval", [])], "weaknesses": mined.id if mined else None}}
    per_env, per_slice, classes = _across_rounds(store, rounds)
    lm_eval = {
        task: values
        for m in by_kind.get("eval", [])
        if "results.json" in m.files and "per_env" not in store.read_json(m.id, "results.json")
        for task, values in store.read_json(m.id, "results.json").get("results", {}).items()
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        figures = {
            "success_per_env": success_figure(per_env),
            "curriculum_heatmap": heatmap_figure(per_slice, classes),
            "reward_distribution": reward_figure(rewards),
            "weakest_slices": weakest_figure(slices),
        }
        images = _save(out, figures)
        summary = _markdown(name, agentic, lm_eval, slices, gate) + _curriculum_markdown(curriculum)
        summary += _costs_markdown(manifests)
        (out / "summary.md").write_text(summary)
        (out / "report.html").write_text(_html(name, summary, images, agentic))
        metrics = {"agentic_samples": len(agentic), "weak_slices": len(weak.get("weak", [])), "rewards": len(rewards)}
        return store.put("report", name, out, parents=[m.id for m in manifests], metrics=metrics)


def agentic_counts(store: ArtifactStore, eval_refs: list[str]) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """[successes, items scored] per env and per `env/category/difficulty` slice in the agentic samples
    of `eval_refs` (lm-eval samples and infra failures left out): the report's and the results table's."""
    per_env: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    per_slice: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for ref in eval_refs:
        manifest = store.manifest(ref)
        for path in (p for p in manifest.files if p.startswith("samples/")):
            for line in store.read_bytes(manifest.id, path).decode().splitlines():
                sample = json.loads(line)
                if "env" not in sample or sample.get("reward") is None:
                    continue
                key = f"{sample['env']}/{sample.get('category')}/{sample.get('difficulty')}"
                for counts in (per_env[sample["env"]], per_slice[key]):
                    counts[0] += bool(sample["success"])
                    counts[1] += 1
    return dict(per_env), dict(per_slice)


def _across_rounds(
    store: ArtifactStore, rounds: dict[int, dict[str, Any]]
) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]], dict[int, dict[str, str]]]:
    """Per round: success per env and per `env/category/difficulty` slice (of its candidate's agentic
    samples, infra failures left out), and the curriculum class its mining gave each slice."""
    per_env: dict[int, dict[str, float]] = {}
    per_slice: dict[int, dict[str, float]] = {}
    classes: dict[int, dict[str, str]] = {}
    for n, evidence in sorted(rounds.items()):
        env_counts, slice_counts = agentic_counts(store, evidence["evals"])
        per_env[n] = {env: won / total for env, (won, total) in env_counts.items()}
        per_slice[n] = {key: won / total for key, (won, total) in slice_counts.items()}
        curriculum = stored_curriculum(store, evidence["weaknesses"]) if evidence.get("weaknesses") else None
        classes[n] = {
            f"{env_name(env)}/{row['slice']}": row["class"]
            for env, spec in ((curriculum or {}).get("slices") or {}).items()
            for row in spec["slices"]
        }
    return per_env, per_slice, classes


def _markdown(name: str, agentic: list[dict], lm_eval: dict[str, Any], slices: list[dict], gate: dict | None) -> str:
    lines = [f"# Flywheel report: {name}", ""]
    if agentic:
        scored = [s for s in agentic if s.get("reward") is not None]
        rate = sum(bool(s["success"]) for s in scored) / max(1, len(scored))
        lines += [
            f"Agentic success: **{rate:.1%}** on {len(scored)} held-out tasks.",
            "",
            "| env | success | n |",
            "|---|---|---|",
        ]
        for env in sorted({s["env"] for s in scored}):
            part = [s for s in scored if s["env"] == env]
            lines.append(f"| {env} | {sum(bool(s['success']) for s in part) / len(part):.1%} | {len(part)} |")
        lines.append("")
    if lm_eval:
        lines += ["| lm-eval task | metrics |", "|---|---|"]
        for task, values in sorted(lm_eval.items()):
            shown = ", ".join(f"{k.split(',')[0]}={v:.3f}" for k, v in values.items() if isinstance(v, float))
            lines.append(f"| {task} | {shown} |")
        lines.append("")
    if slices:
        lines += ["## Weakest slices", "", "| slice | success | 95% CI | n | flagged |", "|---|---|---|---|---|"]
        for s in slices[:10]:
            low, high = s["success_ci95"]
            lines.append(f"| {s['slice']} | {s['success_rate']:.2f} | {low:.2f}-{high:.2f} | {s['n']} | {s['weak']} |")
        lines.append("")
    if gate:
        verdict = "PROMOTED" if gate["promote"] else "not promoted"
        lines += ["## Promotion gate", "", f"Candidate {verdict}: {gate['reason']}", ""]
        if gate.get("guards"):
            lines += ["| guarded metric | change | n | P(worse) | regressed |", "|---|---|---|---|---|"]
            for metric, guard in sorted(gate["guards"].items()):
                p_worse = "" if guard.get("p_worse") is None else guard["p_worse"]  # None: within the tolerance.
                lines.append(f"| {metric} | {guard['delta']:+.3f} | {guard['n']} | {p_worse} | {guard['regressed']} |")
            lines.append("")
    return "\n".join(lines)


def _costs_markdown(manifests: list[Manifest]) -> str:
    """Each artifact's wall time and the peak memory of the stage that made it (cost accounting)."""
    costed = [m for m in manifests if "peak_rss_mb" in m.metrics or "wall_seconds" in m.metrics]
    if not costed:
        return ""

    def gb(m: Manifest, key: str) -> str:
        return f"{m.metrics[key] / 1024:.2f} GB" if key in m.metrics else "-"

    lines = ["## Costs", "", "| artifact | wall time | peak memory | its model server | both |", "|" + "---|" * 5]
    for m in costed:
        wall = f"{m.metrics['wall_seconds']:.0f} s" if "wall_seconds" in m.metrics else "-"
        lines.append(
            f"| {m.kind}/{m.name} | {wall} | {gb(m, 'peak_rss_mb')} | {gb(m, 'server_peak_rss_mb')} "
            f"| {gb(m, 'total_peak_rss_mb')} |"
        )
    peaks = [m.metrics.get("total_peak_rss_mb", m.metrics.get("peak_rss_mb", 0)) for m in costed]
    if any(peaks):
        lines += [
            "",
            f"Peak resident memory of the round: **{max(peaks) / 1024:.2f} GB** (a stage and the model server it "
            "started, their peaks added; training launched on several GPUs not counted).",
            "",
        ]
    return "\n".join(lines)


def _curriculum_markdown(curriculum: dict[str, Any]) -> str:
    """The next round's curriculum: each slice's class, its evidence, and the groups it gets (or why it waits)."""
    if not curriculum:
        return ""
    lines = ["## Next round's curriculum", "", "| env | slice | class | wins/n | interval | decided by | groups |"]
    lines.append("|---|---|---|---|---|---|---|")
    for env, spec in sorted(curriculum["slices"].items()):
        for row in spec["slices"]:
            low, high = row["ci"]
            waits = f" ({row['waits']})" if row.get("waits") else ""
            lines.append(
                f"| {env} | {row['slice']} | {row['class']} | {row['wins']}/{row['n']} | {low:.2f}-{high:.2f} "
                f"| {row['evidence']} | {row.get('groups', 0)}{waits} |"
            )
    unlocked = [f"{env}: {', '.join(spec['newly_unlocked'])}" for env, spec in curriculum["slices"].items()
                if spec["newly_unlocked"]]  # fmt: skip
    lines += ["", f"Unlocked this round: {'; '.join(unlocked) if unlocked else 'nothing'}.", ""]
    return "\n".join(lines + _benchmarks_markdown(curriculum.get("benchmarks") or {}))


def _benchmarks_markdown(benchmarks: dict[str, Any]) -> list[str]:
    """Each lm-eval task the curriculum steers by: its score against the last round's, and the slices it weights."""
    if not benchmarks:
        return []
    lines = [
        "## Benchmarks steering generation",
        "",
        "| lm-eval task | score | last round | weights |",
        "|---|---|---|---|",
    ]
    for task, record in sorted(benchmarks.items()):
        before = (
            "—" if record["before"] is None else f"{record['before']:.2f} ({record['success'] - record['before']:+.2f})"
        )
        weighted = ", ".join(record["weighted"]) or "nothing (mastered, or no env of the round teaches it)"
        lines.append(f"| {task} | {record['success']:.2f} ({record['n']} items) | {before} | {weighted} |")
    return [*lines, ""]


def _html(name: str, summary: str, images: list[str], samples: list[dict]) -> str:
    rows = "".join(
        f"<details><summary>{html.escape(str(s.get('env')))} / {html.escape(str(s.get('item_id')))} — reward "
        f"{s.get('reward')}</summary><pre>{html.escape(json.dumps(s.get('messages'), indent=1)[:4000])}</pre></details>"
        for s in samples[:200]
    )
    figures = "".join(f'<img src="{img}" style="max-width:48%">' for img in images)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(name)}</title></head>"
        f"<body style='font-family:sans-serif'><pre>{html.escape(summary)}</pre>{figures}"
        f"<h2>Evaluation rollouts</h2>{rows}</body></html>"
    )
