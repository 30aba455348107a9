"""Curriculum ablation: round 2 twice from the same round-1 champion, at equal compute - the mined
curriculum vs a uniform mix - judged on the slices round 1 left unmastered.

Run (after `flywheel round` has finished round 1 in the store):
    .venv/bin/python benchmarks/curriculum_ablation.py [--store ./.flywheel] [--profile default]
        [--mined-from STORE] [--workdir DIR [--arm mined|uniform]]

Each arm copies the store as it was after round 1 and runs round 2 through `run_round` (the plain
library calls, no Prefect), with the same profile except `curriculum`: the same generation
groups, SFT and GRPO steps, held-out items and lm-eval tasks. The mined plan replays mastered
slices on top of the profile's groups (and scales SFT's steps with it), so the uniform arm gets
the mined plan's total groups and SFT steps; both are printed. `--mined-from` takes the mined arm
from a store where the flywheel itself went on from this very round 1 to round 2 with the mined
curriculum (the same round body, so only the uniform arm runs: half the compute). Printed: per
weak slice (unsolved or learnable in round 1's curriculum) the held-out success of both
candidates, and the totals. Two held-out items a slice cannot tell the arms apart, so both
candidates then answer a larger sample of the weak slices from the same eval seed stream
(`--weak-items` a slice, the same items for both) and the gate's paired bootstrap gives P(mined
better) on it. `--workdir` keeps each arm's store there, and an arm that finished (with its larger
sample) is reused: `--arm mined` and `--arm uniform` run one arm each (as separate processes, on a
machine with the cores for both at once), and a last run without `--arm` prints both.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path

from flywheel.data import ArtifactStore
from flywheel.environments.task_stream import DIFFICULTIES
from flywheel.evaluation.gate import decide, paired_outcomes
from flywheel.flows.flywheel import completed_rounds, plain_stage, plan_round, planned_groups, run_round, sft_steps
from flywheel.flows.round_config import RoundConfig, overridden, profile, profile_names
from flywheel.flows.stages import STAGES
from flywheel.flows.work import round_name
from flywheel.training.models import resolve_model

ARMS = ("mined", "uniform")


def weak_slices(store: ArtifactStore) -> set[str]:
    """`env/category/difficulty` of every slice round 1's curriculum left unsolved or learnable."""
    curriculum = store.read_json("weaknesses/weaknesses-r1", "curriculum.json")["slices"]
    return {
        f"{env}/{row['slice']}"
        for env, spec in curriculum.items()
        for row in spec["slices"]
        if row["class"] in ("unsolved", "learnable")
    }


def slice_success(store: ArtifactStore, eval_ref: str, slices: set[str]) -> dict[str, tuple[int, int]]:
    """(successes, scored items) per slice of `slices` in an agentic eval artifact."""
    manifest = store.manifest(eval_ref)
    out: dict[str, list[int]] = {s: [0, 0] for s in slices}
    for relpath in (p for p in manifest.files if p.startswith("samples/")):
        for line in store.read_bytes(manifest.id, relpath).decode().splitlines():
            sample = json.loads(line)
            key = f"{sample.get('env')}/{sample.get('category')}/{sample.get('difficulty')}"
            if key in out and sample.get("reward") is not None:
                out[key][0] += bool(sample["success"])
                out[key][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def arm_config(source: ArtifactStore, p: RoundConfig, arm: str) -> RoundConfig:
    """The round config of an arm: the mined arm's as is; the uniform arm's with the groups and SFT
    steps that round 1's mined curriculum plans for round 2 (its replay comes on top of `groups`)."""
    if arm == "mined":
        return overridden(p, {"curriculum.mode": "mined"})
    plan, _ = plan_round(source.read_json("weaknesses/weaknesses-r1", "curriculum.json"), p)
    budget = {
        "generate.groups": max(planned_groups(plan), p.generate.groups),
        "sft.total_steps": sft_steps(plan, p) or p.sft.total_steps,
    }
    return overridden(p, {"curriculum.mode": "uniform", **budget})


def run_arm(source: Path, workdir: Path, p: RoundConfig) -> tuple[ArtifactStore, str]:
    """Round 2 on a copy of the round-1 store in `workdir`; the candidate's agentic eval id. A copy
    whose round 2 finished from this round 1 with this very config is reused; any other copy is
    started again (and the larger sample of its candidate dropped). The uniform arm's round reads no
    curriculum settings (only its budget comes from the mined plan), so they are left out of its
    record; the mined arm's record holds its generation plan and GRPO mix, so a change to the
    curriculum's code re-runs it too."""
    arm = p.curriculum.mode
    copy, record = workdir / arm, workdir / f"{arm}-round.json"
    round_1 = ArtifactStore(source)
    wanted = {"round_1": round_1.resolve("weaknesses/weaknesses-r1")}
    if arm == "uniform":
        wanted["config"] = p.model_dump(exclude={"curriculum"})
    else:
        wanted["config"] = p.model_dump()
        wanted["plan"] = plan_round(round_1.read_json("weaknesses/weaknesses-r1", "curriculum.json"), p)
    text = json.dumps(wanted)
    if copy.exists() and record.exists() and record.read_text() == text:
        store = ArtifactStore(copy)
        if store.try_resolve(f"report/{round_name('report', 2)}") is not None:
            print(f"{arm} arm: round 2 already finished in {copy}")
            return store, store.resolve("eval/agentic-r2")
    if copy.exists():
        print(f"{arm} arm: {copy} holds no finished round 2 of this round 1 and config; starting again")
        shutil.rmtree(copy)
    shutil.rmtree(weak_eval_folder(workdir, arm), ignore_errors=True)
    shutil.copytree(source, copy)
    record.write_text(text)
    store = ArtifactStore(copy)
    run_round(store, 2, p, plain_stage(store, p))
    return store, store.resolve("eval/agentic-r2")


def weak_eval_folder(workdir: Path, arm: str) -> Path:
    """The store of an arm's larger-sample eval: its own, as the arms may run at once."""
    return workdir / f"weak-{arm}"


def finished_mined_arm(source: ArtifactStore, path: Path, name: str) -> tuple[ArtifactStore, str]:
    """The mined arm from a store that went on from `source`'s round 1 to round 2 with the mined
    curriculum; refused unless its round 1 is `source`'s (the same weaknesses artifact)."""
    store = ArtifactStore(path)
    if store.try_resolve("weaknesses/weaknesses-r1") != source.resolve("weaknesses/weaknesses-r1"):
        raise SystemExit(f"error: {path} did not go on from round 1 of {source.url} (another weaknesses-r1)")
    if store.try_resolve(f"report/{round_name('report', 2)}") is None:
        raise SystemExit(f"error: {path} has no report of round 2")
    spec = store.manifest("weaknesses/weaknesses-r2").params.get("curriculum")  # Recorded by a mined round only.
    if spec is None or spec["groups"] != profile(name).generate.groups:
        raise SystemExit(f"error: round 2 in {path} did not run profile {name} with the mined curriculum")
    return store, store.resolve("eval/agentic-r2")


def weak_config(p: RoundConfig, weak: set[str], per_slice: int) -> RoundConfig:
    """`p` evaluating only the weak slices' envs, categories and (when they share one) difficulty,
    with about `per_slice` items a weak slice (the held-out stream is stratified over the slices)."""
    parts = [key.split("/") for key in weak]
    envs = sorted({env for env, _, _ in parts})
    categories = sorted({category for _, category, _ in parts})
    difficulties = {difficulty for _, _, difficulty in parts}
    difficulty = difficulties.pop() if len(difficulties) == 1 else None
    sample = overridden(p, {"envs": envs, "categories": categories, "difficulty": difficulty})
    widest = max(len(covered) or 1 for covered in sample.families().values())
    size = per_slice * widest * (1 if difficulty else len(DIFFICULTIES))
    return overridden(sample, {"eval.eval_size": size})


def weak_slice_eval(store: ArtifactStore, eval_store: ArtifactStore, p: RoundConfig, name: str) -> str:
    """The arm's round-2 candidate evaluated with config `p` into `eval_store` as `eval/<name>`
    (reused when there); the eval's id."""
    if (done := eval_store.try_resolve(f"eval/{name}")) is not None:
        return done
    candidate = store.read_json("gate/gate-r2", "decision.json")["candidate"]
    model_dir = resolve_model(candidate, store)
    params = STAGES["evaluate"].params(
        store_url=eval_store.root_url, config=p, round_no=2, model=str(model_dir), name=name
    )
    return STAGES["evaluate"].work(params).id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=".flywheel", help="a local store where round 1 has finished")
    parser.add_argument("--profile", default="default", choices=profile_names())
    parser.add_argument("--mined-from", type=Path, help="a store whose round 2 followed this round 1 (mined)")
    parser.add_argument("--weak-items", type=int, default=8, help="items a weak slice in the larger sample (0: none)")
    parser.add_argument("--workdir", type=Path, help="keep the arms' stores here and reuse finished ones")
    parser.add_argument("--arm", choices=ARMS, help="run only this arm (with --workdir), print nothing")
    args = parser.parse_args()
    if args.arm and not args.workdir:
        parser.error("--arm needs --workdir: the other arm's process and the last run find it there")
    source = Path(args.store)
    source_store = ArtifactStore(source)
    if completed_rounds(source_store) != 1:
        parser.error(f"{source} must hold exactly round 1 (a report of round 1 and none of round 2)")
    weak = weak_slices(source_store)
    sample = weak_config(profile(args.profile), weak, args.weak_items) if args.weak_items else None
    results, overall, larger = {}, {}, {}
    workdir = tempfile.TemporaryDirectory(prefix="ablation-") if args.workdir is None else nullcontext(args.workdir)
    with workdir as folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        for arm in [args.arm] if args.arm else ARMS:
            p = arm_config(source_store, profile(args.profile), arm)
            if arm == "uniform":
                print(f"uniform arm: {p.generate.groups} groups, {p.sft.total_steps} SFT steps (the mined plan's)")
            if arm == "mined" and args.mined_from:
                store, eval_id = finished_mined_arm(source_store, args.mined_from, args.profile)
            else:
                store, eval_id = run_arm(source, Path(folder), p)
            results[arm] = slice_success(store, eval_id, weak)
            overall[arm] = store.manifest(eval_id).metrics
            if sample is not None:
                eval_store = ArtifactStore(weak_eval_folder(Path(folder), arm))
                larger[arm] = (eval_store, weak_slice_eval(store, eval_store, sample, f"weak{args.weak_items}"))
        if args.arm:
            print(f"{args.arm} arm finished in {folder}; run again without --arm to print both arms")
            return
        # Inside the workdir: a temporary one holds the arms' stores.
        print_weak_slices(results, overall, weak, args.profile)
        if larger:
            print_larger_sample(larger, weak)


def print_slice_rows(cells: dict[str, dict[str, tuple[int, int]]], weak: set[str]) -> dict[str, tuple[int, int]]:
    """One row a weak slice, both arms' successes/items; each arm's total (successes, items)."""
    print(f"{'slice':<45} {'mined':>8} {'uniform':>8}")
    for key in sorted(weak):
        row = [f"{w}/{n}" if n else "-" for w, n in (cells[arm][key] for arm in ("mined", "uniform"))]
        print(f"{key:<45} {row[0]:>8} {row[1]:>8}")
    return {arm: (sum(w for w, _ in cells[arm].values()), sum(n for _, n in cells[arm].values())) for arm in cells}


def print_weak_slices(
    results: dict[str, dict[str, tuple[int, int]]], overall: dict[str, dict[str, float]], weak: set[str], profile: str
) -> None:
    """Per weak slice and in total, both arms on the held-out set; both on all held-out items."""
    print(f"round 2 from the same round-1 champion, profile {profile}: held-out success on round 1's weak slices")
    totals = print_slice_rows(results, weak)
    rates = {arm: (w / n if n else 0.0) for arm, (w, n) in totals.items()}
    print(f"{'all weak slices':<45} {rates['mined']:>8.2f} {rates['uniform']:>8.2f}")
    mined_all, uniform_all = (overall[arm]["success_rate"] for arm in ("mined", "uniform"))
    print(f"{'all held-out items':<45} {mined_all:>8.2f} {uniform_all:>8.2f}")
    print(f"curriculum - uniform: {rates['mined'] - rates['uniform']:+.2f} (goal: > 0)")


def print_larger_sample(evals: dict[str, tuple[ArtifactStore, str]], weak: set[str]) -> None:
    """Per weak slice and in total, both arms on the larger sample (each arm's store and eval id); the
    paired difference and its bootstrap P(mined better), as the gate computes them."""
    print("larger sample of the weak slices (the same items for both arms):")
    totals = print_slice_rows(
        {arm: slice_success(store, eval_id, weak) for arm, (store, eval_id) in evals.items()}, weak
    )
    cells = [f"{w}/{n}" for w, n in (totals[arm] for arm in ("mined", "uniform"))]
    print(f"{'all weak slices':<45} {cells[0]:>8} {cells[1]:>8}")
    mined, uniform = (paired_outcomes(*evals[arm]) for arm in ARMS)
    verdict = decide(mined, uniform)
    print(
        f"mined - uniform on {verdict['n_shared']} paired items: {verdict['primary_delta']:+.3f}, "
        f"bootstrap P(mined better) = {verdict['p_better']:.2f}"
    )


if __name__ == "__main__":
    main()
