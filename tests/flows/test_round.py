"""A flywheel round through the Prefect flow (local dispatch): every stage leaves its artifacts, a finished
round run again recomputes nothing, and a round killed with SIGKILL in SFT resumes without recomputing
what finished, to the same result (one test: the uninterrupted round is shared)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from data import ArtifactStore, lineage
from tests.flows.conftest import flow_runs, task_runs
from tests.flows.test_cli import FLYWHEEL

WEIGHTS = "model.safetensors"


def round_command(store: Path) -> list[str]:
    return [FLYWHEEL, "--store", str(store), "round", "--profile", "tiny"]


def test_a_round_killed_in_sft_resumes_without_recomputing(prefect_server: dict[str, str], tmp_path: Path) -> None:
    env = {**prefect_server, "FLYWHEEL_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}

    # An uninterrupted round: every stage, every artifact, the report.
    whole = tmp_path / "whole"
    done = subprocess.run(round_command(whole), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "report:" in done.stdout and "Promotion gate" in done.stdout
    assert "Next round's curriculum" in done.stdout and "Peak resident memory of the round" in done.stdout
    assert "lm-eval task" in done.stdout and "task/flywheel_tool_call" in done.stdout  # Results and their guard.
    store_a = ArtifactStore(whole)
    assert {"model", "rollouts", "dataset", "checkpoint", "eval", "gate", "weaknesses", "report"} <= {
        m.kind for m in store_a.list()
    }
    walked = {m.kind for m in lineage(store_a, "report/round-1").walk()}
    assert {"eval", "checkpoint", "dataset", "rollouts", "model"} <= walked  # report <- ... <- base model
    assert store_a.resolve("champion") and store_a.verify() == []

    # Round 1 again on a store that has it: nothing recomputes (the no-change re-run).
    before = {m.id for m in store_a.list()}
    again_a = subprocess.run([*round_command(whole), "--first-round", "1"], env=env, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
    assert again_a.returncode == 0, again_a.stderr[-3000:]
    assert {m.id for m in store_a.list()} == before

    # The same round, killed with SIGKILL while SFT runs.
    killed = tmp_path / "killed"
    process = subprocess.Popen(
        round_command(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while not any(r["name"] == "sft-r1" for r in flow_runs(prefect_server, state={"type": {"any_": ["RUNNING"]}})):
        assert process.poll() is None and time.monotonic() < deadline, "the round never reached SFT"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    store_b = ArtifactStore(killed)
    assert store_b.try_resolve("checkpoint/sft-r1") is None, "SFT finished before the kill"
    assert store_b.try_resolve("dataset/round1-sft") is not None

    # Re-run: generate and curate come from the cache; SFT onwards runs.
    again = subprocess.run(round_command(killed), env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = max(
        (r for r in flow_runs(prefect_server) if r["name"] == "flywheel-tiny" and r["state_type"] == "COMPLETED"),
        key=lambda r: r["start_time"],
    )
    states = {t["name"]: t["state"]["name"] for t in task_runs(prefect_server, rerun["id"])}
    assert states["generate-r1"] == states["curate-r1"] == "Cached", states
    assert "evaluate-r0" not in states and "gate-r0" not in states  # The base model's verdict is read from the store.
    assert states["sft-r1"] == states["rl-r1"] == states["report-r1"] == "Completed", states
    assert len(store_b.list("rollouts")) == 1  # Generated once, across both runs.
    assert len([m for m in store_b.list("dataset") if m.name == "round1-sft"]) == 1

    # ... to the same result as the uninterrupted round.
    def digest(store: ArtifactStore, ref: str, path: str) -> str:
        return store.manifest(ref).files[path].sha256

    assert digest(store_a, "dataset/round1-sft", "train.jsonl") == digest(store_b, "dataset/round1-sft", "train.jsonl")
    for ref in ("checkpoint/sft-r1", "checkpoint/rl-r1"):
        assert digest(store_a, ref, WEIGHTS) == digest(store_b, ref, WEIGHTS), ref
    untimed = {"wall_seconds": 0, "peak_rss_mb": 0}
    for ref in ("eval/agentic-r1", "gate/gate-r1"):
        assert store_a.manifest(ref).metrics | untimed == store_b.manifest(ref).metrics | untimed, ref
