"""One quick flywheel round through the Prefect flow: every stage runs and leaves its artifacts."""

from __future__ import annotations

from pathlib import Path

from data import ArtifactStore, lineage
from tests.flows.test_cli import run


def test_quick_round_runs_every_stage(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    result = run("--store", str(store_dir), "round", "--quick", env={"FLYWHEEL_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "report:" in result.stdout and "Promotion gate" in result.stdout
    store = ArtifactStore(store_dir)
    kinds = {m.kind for m in store.list()}
    assert {"model", "rollouts", "dataset", "checkpoint", "eval", "gate", "weaknesses", "report"} <= kinds
    report = store.manifest("report/round-1")
    walked = {m.kind for m in lineage(store, report.id).walk()}
    assert {"eval", "checkpoint", "dataset", "rollouts", "model"} <= walked  # report <- ... <- base model
    assert store.resolve("champion")  # The base model was judged first and became champion.
    assert store.verify() == []
