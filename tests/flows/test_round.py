"""A flywheel round through the Prefect flow (local dispatch), killed with SIGKILL in SFT: the re-run
recomputes nothing that finished, leaves every stage's artifacts and a report, and runs again
recomputing nothing at all; the resumed SFT equals the same SFT run uninterrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from flywheel.data import ArtifactStore, lineage
from flywheel.flows import work
from flywheel.flows.round_config import profile
from tests.flows.conftest import flow_runs, task_runs
from tests.flows.test_cli import FLYWHEEL

WEIGHTS = "model.safetensors"


def round_command(store: Path) -> list[str]:
    return [FLYWHEEL, "--store", str(store), "round", "--profile", "tiny"]


def test_a_round_killed_in_sft_resumes_without_recomputing(
    prefect_server: dict[str, str], tmp_path: Path, monkeypatch
) -> None:
    env = {**prefect_server, "FLYWHEEL_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}

    # A round, killed with SIGKILL while SFT runs.
    killed = tmp_path / "killed"
    process = subprocess.Popen(
        round_command(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 300
    running = {"name": {"any_": ["sft-r1"]}, "state": {"type": {"any_": ["RUNNING"]}}}
    while not task_runs(prefect_server, **running):
        assert process.poll() is None and time.monotonic() < deadline, "the round never reached SFT"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    store = ArtifactStore(killed)
    assert store.try_resolve("checkpoint/sft-r1") is None, "SFT finished before the kill"
    assert store.try_resolve("dataset/sft-r1") is not None

    # Re-run: round 0, generate and curate come from the cache; SFT onwards runs, to the report.
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
    assert len(store.list("rollouts")) == 1  # Generated once, across both runs.
    assert len([m for m in store.list("dataset") if m.name == "sft-r1"]) == 1

    # Every stage's artifacts, the report and its lineage down to the base model.
    assert again.stdout.splitlines()[-1].startswith("report: ") and "| 1 | **" in again.stdout  # Table, report.
    assert "sft       r1" in again.stdout and "generate  r1  cached" in again.stdout  # The re-run's stage lines.
    summary = store.read_bytes("report/report-r1", "summary.md").decode()
    assert "Next round's curriculum" in summary and "Peak resident memory of the round" in summary
    assert "lm-eval task" in summary and "task/flywheel_tool_call" in summary  # Results and their guard.
    assert {"model", "rollouts", "dataset", "checkpoint", "eval", "gate", "weaknesses", "report"} <= {
        m.kind for m in store.list()
    }
    walked = {m.kind for m in lineage(store, "report/report-r1").walk()}
    assert {"eval", "checkpoint", "dataset", "rollouts", "model"} <= walked  # report <- ... <- base model
    assert store.resolve("champion") and store.verify() == []

    # Round 1 again on a store that has it: nothing recomputes (the no-change re-run).
    before = {m.id for m in store.list()}
    same = subprocess.run([*round_command(killed), "--first-round", "1"], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert same.returncode == 0, same.stderr[-3000:]
    assert {m.id for m in store.list()} == before

    # The resumed SFT equals the same SFT uninterrupted (in a fresh store, from the same inputs).
    monkeypatch.setenv("FLYWHEEL_CACHE", env["FLYWHEEL_CACHE"])
    fresh = ArtifactStore(tmp_path / "fresh")
    sft = store.manifest("checkpoint/sft-r1")
    base, dataset = (
        fresh.put(m.kind, m.name, store.materialize(m.id, tmp_path / "copies"), params=m.params, metrics=m.metrics)
        for m in (store.manifest(ref) for ref in sft.parents[:2])
    )
    params = work.SFTParams(store_url=fresh.root_url, config=profile("tiny"), base=base.id, dataset=dataset.id)
    uninterrupted = work.sft(params)
    assert uninterrupted.files[WEIGHTS].sha256 == sft.files[WEIGHTS].sha256
