"""What GRPO adds: SFT-only vs SFT+GRPO from the same SFT checkpoint, judged on the same held-out tasks.

Run: .venv/bin/python benchmarks/rl_gain.py [--store DIR] [--sft REF] [--profile default] [--rl-steps 6]
     [--env web_navigation] [--categories a,b] [--difficulty easy] [--eval-size 10]

Without `--sft`, the profile's generate -> curate -> SFT makes the checkpoint first. Both models
are then evaluated by the round's own `evaluate` stage (same env, slice, held-out items, turns and
token caps); GRPO runs the round's own `rl` stage (the env's agent loop) for `--rl-steps` steps.
Prints success per slice for both, the gain in points, and GRPO's own signal (reward mean, the
share of groups with no reward variance): a slice that SFT already masters gives GRPO all-1 groups
and nothing to learn from, so the gain is measured where SFT leaves room (goal: >= 10 points).
"""

from __future__ import annotations

import argparse
import json

from data import ArtifactStore
from flows import work
from flows.profiles import PROFILES
from training.models import base_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", default=None, help="artifact store (default: $FLYWHEEL_STORE or ./.flywheel)")
    parser.add_argument("--sft", default=None, help="SFT checkpoint ref to start from (default: make one)")
    parser.add_argument("--profile", default="default", choices=sorted(PROFILES))
    parser.add_argument("--rl-steps", type=int, default=6)
    parser.add_argument("--env", default=None)
    parser.add_argument("--categories", default=None, help="comma-separated (default: the profile's)")
    parser.add_argument("--difficulty", default=None)
    parser.add_argument("--eval-size", type=int, default=None)
    args = parser.parse_args()
    changes: dict = {"rl_steps": args.rl_steps}
    for field, value in (("env", args.env), ("difficulty", args.difficulty), ("eval_size", args.eval_size)):
        if value is not None:
            changes[field] = value
    if args.categories is not None:
        changes["categories"] = args.categories.split(",")
    p = PROFILES[args.profile].model_copy(update=changes)
    store = ArtifactStore(args.store)
    common = {"store_url": store.root_url, "round_no": 90, "profile": p}
    if args.sft:
        sft_id = store.resolve(args.sft)
    else:
        base = base_model(p.model, store).id
        rollouts = work.generate(work.GenerateParams(**common, tokenizer_model=base)).id
        dataset = work.curate(work.CurateParams(**common, rollouts=rollouts)).id
        sft_id = work.sft(work.SFTParams(**common, base=base, dataset=dataset)).id
    sft_eval = work.evaluate(work.EvaluateParams(**common, model=sft_id, name="rl-gain-sft"))
    rl = work.rl(work.RLParams(**common, policy=sft_id))
    rl_eval = work.evaluate(work.EvaluateParams(**common, model=rl.id, name="rl-gain-grpo"))
    run = store.manifest(f"run/{rl.name}")
    steps = [json.loads(line) for line in store.read_bytes(run.id, "metrics.jsonl").decode().splitlines()]
    steps = [s for s in steps if "reward" in s]
    before = store.read_json(sft_eval.id, "results.json")["per_slice"]
    after = store.read_json(rl_eval.id, "results.json")["per_slice"]
    print(f"profile {args.profile}, {p.env} {p.categories or 'all'} {p.difficulty or 'all'}; SFT {sft_id[:12]}")
    print(f"{'slice':50} {'n':>4} {'SFT':>6} {'SFT+GRPO':>9} {'gain (points)':>14}")
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name, {}), after.get(name, {})
        gain = 100 * (a.get("success_rate", 0) - b.get("success_rate", 0))
        print(f"{name:50} {b.get('n', 0):>4} {b.get('success_rate', 0):>6.2f} {a.get('success_rate', 0):>9.2f} "
              f"{gain:>+14.0f}")  # fmt: skip
    total = 100 * (rl_eval.metrics["success_rate"] - sft_eval.metrics["success_rate"])
    print(f"overall: SFT {sft_eval.metrics['success_rate']:.2f} -> SFT+GRPO {rl_eval.metrics['success_rate']:.2f} "
          f"({total:+.0f} points over {sft_eval.metrics['n']} tasks; goal >= +10 on learnable slices)")  # fmt: skip
    flat = sum(s.get("frac_reward_zero_std", 0) for s in steps) / max(1, len(steps))
    rewards = [round(s["reward"], 3) for s in steps]
    print(f"GRPO: {len(steps)} steps, reward per step {rewards}, share of zero-variance groups {flat:.2f}")


if __name__ == "__main__":
    main()
