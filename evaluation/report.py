"""Per-round reports: HTML + PNG plots + a markdown summary, stored as a `report` artifact.

Plots: success per env across every agentic eval in the store (one line per env), the reward
distribution of this round's rollouts, and the weakest slices with their 95 % intervals. The
HTML also lists evaluation samples with their rewards (like Atropos' rollout viewer).
"""

from __future__ import annotations

import html
import json
import tempfile
from pathlib import Path
from typing import Any

from data import ArtifactStore, Manifest
from evaluation.weakness import stored_curriculum


def _plots(out: Path, history: dict[str, list[float]], rewards: list[float], slices: list[dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for env, values in sorted(history.items()):
        ax.plot(range(1, len(values) + 1), values, marker="o", label=env)
    ax.set(xlabel="evaluation (round)", ylabel="success rate", ylim=(-0.05, 1.05), title="Agentic success per env")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "success_per_env.png", dpi=100)
    names.append("success_per_env.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(rewards, bins=[i / 10 for i in range(11)], color="#4477aa", edgecolor="white")
    ax.set(xlabel="reward", ylabel="rollouts", title=f"Reward distribution ({len(rewards)} rollouts)")
    fig.tight_layout()
    fig.savefig(out / "reward_distribution.png", dpi=100)
    names.append("reward_distribution.png")
    plt.close(fig)

    worst = slices[:10]
    fig, ax = plt.subplots(figsize=(7, 0.4 * max(3, len(worst)) + 1))
    labels = [s["slice"] for s in worst][::-1]
    rates = [s["success_rate"] for s in worst][::-1]
    low = [s["success_rate"] - s["success_ci95"][0] for s in worst][::-1]
    high = [s["success_ci95"][1] - s["success_rate"] for s in worst][::-1]
    colors = ["#cc3311" if s["weak"] else "#999999" for s in worst][::-1]
    ax.barh(labels, rates, xerr=[low, high], color=colors)
    ax.set(xlim=(0, 1), xlabel="success rate (95% Wilson interval)", title="Weakest slices (red: flagged)")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "weakest_slices.png", dpi=100)
    names.append("weakest_slices.png")
    plt.close(fig)
    return names


def build_report(store: ArtifactStore, refs: list[str], name: str = "round") -> Manifest:
    """Report on the given eval / weaknesses / gate / rollouts artifacts (kinds are detected)."""
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
        for path in (p for p in rollouts.files if p.endswith(".jsonl")):
            for line in store.read_bytes(rollouts.id, path).decode().splitlines():
                rewards.extend(json.loads(line).get("scores", []))
    mined = by_kind.get("weaknesses", [None])[0]
    weak = store.read_json(mined.id, "weaknesses.json") if mined else {}
    curriculum = (stored_curriculum(store, mined.id) if mined else None) or {}
    slices = weak.get("slices", [])
    gate = store.read_json(by_kind["gate"][0].id, "decision.json") if "gate" in by_kind else None
    history = _success_history(store)
    lm_eval = {
        task: values
        for m in by_kind.get("eval", [])
        if "results.json" in m.files and "per_env" not in store.read_json(m.id, "results.json")
        for task, values in store.read_json(m.id, "results.json").get("results", {}).items()
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        images = _plots(out, history, rewards, slices)
        summary = _markdown(name, agentic, lm_eval, slices, gate) + _curriculum_markdown(curriculum)
        summary += _costs_markdown(manifests)
        (out / "summary.md").write_text(summary)
        (out / "report.html").write_text(_html(name, summary, images, agentic))
        metrics = {"agentic_samples": len(agentic), "weak_slices": len(weak.get("weak", [])), "rewards": len(rewards)}
        return store.put("report", name, out, parents=[m.id for m in manifests], metrics=metrics)


def _success_history(store: ArtifactStore) -> dict[str, list[float]]:
    """Each env's success rate in every agentic eval in the store, oldest first."""
    history: dict[str, list[float]] = {}
    for manifest in store.list("eval"):
        for key, value in manifest.metrics.items():
            if key.endswith("/success_rate") and "/" in key:
                history.setdefault(key.split("/")[0], []).append(value)
    return history


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
            lines += ["| guarded metric | change | n | regressed |", "|---|---|---|---|"]
            for metric, guard in sorted(gate["guards"].items()):
                lines.append(f"| {metric} | {guard['delta']:+.3f} | {guard['n']} | {guard['regressed']} |")
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
    return "\n".join(lines)


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
