"""Synchronous GRPO against atropos mode at equal steps: wall time and reward per step, side by side.

Run: .venv/bin/python benchmarks/async_rl.py [--model tiny] [--steps 6] [--workers 2] [--async-level 1]
     [--env tool_use_chain] [--difficulty easy]

Both runs train the same model on the same env with the same batch, group, turn and token caps, one
after the other on this machine. `sync`: each step's rollouts run in the trainer's process, then the
step trains (generation and training take turns). `atropos`: `--workers` env worker processes roll
against the trainer's policy endpoint and post groups to atroposlib's `run-api` while the trainer
trains on groups at most `--async-level` steps old. Prints each step's reward and seconds, the
wall ratio (sync / atropos: above 1 the overlap pays), the groups' mean age and what was refused.
The tiny model scores 0 on every task, so its reward curves are flat; `--model smollm2` (an SFT
checkpoint ref works too) gives a curve at minutes a step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from flywheel.data import ArtifactStore
from flywheel.training.grpo import GRPORunConfig, run_grpo
from flywheel.training.models import resolve_model


def run(mode: str, args: argparse.Namespace, store: ArtifactStore, logs: Path) -> dict[str, Any]:
    cfg = GRPORunConfig(
        policy_model=args.model, total_steps=args.steps, batch_size=2, gradient_accumulation_steps=2,
        num_rollouts_per_task=2, max_completion_length=args.completion, num_tasks=4 * args.steps,
        logs_root=str(logs / mode), output_name=f"bench-{mode}", envs=[args.env], difficulty=args.difficulty,
        max_agent_turns=2, rl_mode=mode, env_workers=args.workers, max_async_level=args.async_level,
        drop_flat_groups=False,  # The same data as sync: every group, flat ones too.
    )  # fmt: skip
    started = time.perf_counter()
    manifest = run_grpo(cfg, store)
    wall = time.perf_counter() - started
    run_dir = next((logs / mode).glob("run-*"))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = [s for s in steps if "reward" in s]
    return {"wall": wall, "steps": steps, "metrics": manifest.metrics}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--async-level", type=int, default=1)
    parser.add_argument("--env", default="tool_use_chain")
    parser.add_argument("--difficulty", default="easy")
    parser.add_argument("--completion", type=int, default=48, help="max_completion_length")
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with tempfile.TemporaryDirectory(prefix="async-rl-") as tmp:
        root = Path(tmp)
        store = ArtifactStore(os.environ.get("FLYWHEEL_STORE") or root / "store")
        resolve_model(args.model, store)
        results = {mode: run(mode, args, store, root / "logs") for mode in ("sync", "atropos")}
    print(f"\n{args.model} on {args.env} ({args.difficulty}), {args.steps} steps, {args.workers} env workers, "
          f"max_async_level {args.async_level}")  # fmt: skip
    print(f"{'step':>4}  {'sync reward':>11}  {'sync s':>7}  {'atropos reward':>14}  {'atropos s':>9}")
    for sync, fed in zip(results["sync"]["steps"], results["atropos"]["steps"], strict=True):
        print(f"{sync['step']:>4}  {sync['reward']:>11.3f}  {sync['step_time']:>7.1f}  "
              f"{fed['reward']:>14.3f}  {fed['step_time']:>9.1f}")  # fmt: skip
    sync_wall, fed_wall = results["sync"]["wall"], results["atropos"]["wall"]
    print(f"wall: sync {sync_wall:.0f} s, atropos {fed_wall:.0f} s: ratio {sync_wall / fed_wall:.2f}x")
    print("atropos:", json.dumps(results["atropos"]["metrics"]["atropos"]))


if __name__ == "__main__":
    main()
