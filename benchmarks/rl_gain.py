"""What GRPO adds: SFT-only vs SFT+GRPO from the same SFT checkpoint, judged on the same held-out tasks.

Run: .venv/bin/python benchmarks/rl_gain.py [--store DIR] [--sft REF] [--rl REF] [--profile default]
     [--rl-steps 6] [--env web_navigation] [--categories a,b] [--difficulty easy] [--eval-size 10]
     [--figure docs/rl_gain.png] [rl.learning_rate=5e-5 ...]   (round-config overrides, as `flywheel round`)

Without `--sft`, the profile's generate -> curate -> SFT makes the checkpoint first. GRPO runs the
round's own `rl` stage (the env's agent loop, task screening as the profile sets it) for
`--rl-steps` steps, unless `--rl` names a GRPO checkpoint trained from that SFT checkpoint (a
round's `checkpoint/rl-r1` with `--sft checkpoint/sft-r1`). Both models are evaluated by the
round's own `evaluate` stage on the same held-out items of the slices GRPO drew from. Prints
success per slice for both, which slices screening kept (learnable: the SFT policy solved some
of a group, not all), the gain on those slices and overall, and GRPO's own signal (reward per
step, the share of zero-variance groups). Goal: >= 10 points on the learnable slices. `--figure`
draws GRPO's curve: the mean reward of each step's groups, its running mean, and the KL to the
reference, titled with the held-out success of both models.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flywheel.data import ArtifactStore
from flywheel.evaluation.report import pyplot
from flywheel.flows import work
from flywheel.flows.round_config import load_round_config, profile_names
from flywheel.training.models import base_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", default=None, help="artifact store (default: $FLYWHEEL_STORE or ./.flywheel)")
    parser.add_argument("--sft", default=None, help="SFT checkpoint ref to start from (default: make one)")
    parser.add_argument("--rl", default=None, help="GRPO checkpoint ref trained from --sft (default: train one)")
    parser.add_argument("--profile", default="default", choices=profile_names())
    parser.add_argument("--rl-steps", type=int, default=6)
    parser.add_argument("--env", default=None)
    parser.add_argument("--categories", default=None, help="comma-separated (default: the profile's)")
    parser.add_argument("--difficulty", default=None)
    parser.add_argument("--eval-size", type=int, default=None)
    parser.add_argument("--figure", default=None, help="write the reward-per-step curve to this PNG")
    parser.add_argument("overrides", nargs="*", help="round-config overrides, key=value (applied last)")
    args = parser.parse_args()
    fields = {
        "envs": args.env and [args.env],
        "difficulty": args.difficulty,
        "eval.eval_size": args.eval_size,
        "categories": args.categories and args.categories.split(","),
    }
    changes = [f"rl.total_steps={args.rl_steps}"]
    changes += [f"{field}={json.dumps(value)}" for field, value in fields.items() if value is not None]
    changes += args.overrides
    p = load_round_config(args.profile, overrides=changes)
    store = ArtifactStore(args.store)
    common: dict[str, Any] = {"store_url": store.root_url, "round_no": 90, "config": p}
    if args.sft:
        sft_id = store.resolve(args.sft)
    else:
        base = base_model(p.model, store).id
        rollouts = work.generate(work.GenerateParams(**common, tokenizer_model=base)).id
        dataset = work.curate(work.CurateParams(**common, rollouts=rollouts)).id
        sft_id = work.sft(work.SFTParams(**common, base=base, dataset=dataset)).id
    if args.rl:
        rl = store.manifest(args.rl)
        if sft_id not in rl.parents:
            parser.error(f"{args.rl} was not trained from {sft_id[:12]} (its parents: {rl.parents})")
    else:
        rl = work.rl(work.RLParams(**common, policy=sft_id))
    sft_eval = work.evaluate(work.EvaluateParams(**common, model=sft_id, name="rl-gain-sft"))
    rl_eval = work.evaluate(work.EvaluateParams(**common, model=rl.id, name="rl-gain-grpo"))
    title = f"{', '.join(p.envs)} {'/'.join(p.categories or ['all'])} {p.difficulty or ''}".strip()
    steps = grpo_steps(store, rl)
    success = report(store, sft_id, rl, steps, sft_eval, rl_eval, f"profile {args.profile}, {title}")
    if args.figure:
        figure = reward_figure(steps, f"GRPO on {title}\nheld-out, learnable slices: {success}")
        figure.savefig(args.figure, dpi=100)
        print(f"figure: {args.figure}")


def grpo_steps(store: ArtifactStore, rl: Any) -> list[dict[str, Any]]:
    """The GRPO run's logged training steps (its metrics.jsonl, without the closing summary line)."""
    run = store.manifest(f"run/{rl.name}")
    lines = store.read_bytes(run.id, "metrics.jsonl").decode().splitlines()
    return [step for step in map(json.loads, lines) if "reward" in step]


def reward_figure(steps: list[dict[str, Any]], title: str, window: int = 4) -> Any:
    """Mean group reward per step (dots), its running mean over `window` steps, and KL (right axis)."""
    x = [step["step"] for step in steps]
    reward = [step["reward"] for step in steps]
    running = [sum(reward[max(0, i + 1 - window) : i + 1]) / min(window, i + 1) for i in range(len(reward))]
    fig, ax = pyplot().subplots(figsize=(7, 3.8))
    ax.plot(x, reward, "o", color="#4477aa", alpha=0.5, label="mean reward of the step's groups")
    ax.plot(x, running, "-", color="#4477aa", label=f"running mean ({window} steps)")
    ax.set(xlabel="GRPO step", ylabel="reward", ylim=(-0.02, 1.02), title=title)
    kl = ax.twinx()
    kl.plot(x, [step.get("kl", 0.0) for step in steps], "--", color="#cc6677", label="KL to the reference")
    kl.set_ylabel("KL", color="#cc6677")
    handles = ax.get_legend_handles_labels()[0] + kl.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize="small", frameon=False)
    ax.title.set_fontsize("medium")
    fig.tight_layout()
    return fig


def report(
    store: ArtifactStore, sft_id: str, rl: Any, steps: list[dict[str, Any]], sft_eval: Any, rl_eval: Any, title: str
) -> str:
    """Per-slice success of both models, the gain on the slices screening kept, and GRPO's signal (its
    logged `steps`); returns the learnable slices' success, `SFT a -> SFT+GRPO b (n tasks)`."""
    screening = rl.metrics.get("screening") or {}
    screened = screening.get("slices", {})
    learnable = {name for name, s in screened.items() if s["kept"]}
    before = store.read_json(sft_eval.id, "results.json")["per_slice"]
    after = store.read_json(rl_eval.id, "results.json")["per_slice"]
    print(f"{title}; SFT {sft_id[:12]}; GRPO {rl.id[:12]}")
    print(f"{'slice':42} {'n':>4} {'SFT':>6} {'SFT+GRPO':>9} {'gain':>6}  screening kept/groups")
    for name in sorted(set(before) | set(after)):
        b, a, seen = before.get(name, {}), after.get(name, {}), screened.get(name)
        gain = 100 * (a.get("success_rate", 0) - b.get("success_rate", 0))
        mark = f"{seen['kept']}/{seen['groups']}{' learnable' if name in learnable else ''}" if seen else "-"
        print(f"{name:42} {b.get('n', 0):>4} {b.get('success_rate', 0):>6.2f} {a.get('success_rate', 0):>9.2f} "
              f"{gain:>+6.0f}  {mark}")  # fmt: skip
    for label, names in (("learnable slices", learnable & set(before)), ("all slices", set(before))):
        sft_rate, rl_rate, tasks = _rate(before, names), _rate(after, names), _count(before, names)
        print(f"{label}: SFT {sft_rate:.2f} -> SFT+GRPO {rl_rate:.2f} ({100 * (rl_rate - sft_rate):+.0f} points "
              f"over {tasks} tasks)")  # fmt: skip
    flat = sum(s.get("frac_reward_zero_std", 0) for s in steps) / max(1, len(steps))
    print(f"GRPO: {len(steps)} steps, reward per step {[round(s['reward'], 3) for s in steps]}, share of "
          f"zero-variance groups {flat:.2f}; screening kept {screening.get('kept')} of {screening.get('screened')} "
          "tasks; goal >= +10 points on learnable slices")  # fmt: skip
    names = learnable & set(before)
    return f"SFT {_rate(before, names):.2f} -> SFT+GRPO {_rate(after, names):.2f} ({_count(before, names)} tasks)"


def _count(per_slice: dict[str, Any], names: set[str]) -> int:
    return sum(per_slice.get(name, {}).get("n", 0) for name in names)


def _rate(per_slice: dict[str, Any], names: set[str]) -> float:
    """Success over the pooled items of `names` (each slice weighted by its item count)."""
    solved = sum(per_slice[name]["success_rate"] * per_slice[name]["n"] for name in names if name in per_slice)
    return solved / max(1, _count(per_slice, names))


if __name__ == "__main__":
    main()
