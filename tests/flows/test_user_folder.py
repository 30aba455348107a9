"""The CLI from a user's project folder: one that holds `data/`, `evaluation/`, `training/`, `flows/`,
`environments/`, `inference/` and a `data.py` (names any ML project may have) shadows none of our
packages, nor is shadowed by ours (the user's env file imports their own `training`), and a round
described by the user's own YAML (their env file, their lm-eval tasks, the tiny model on the `tiny`
profile) runs there."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from flywheel.environments.custom import file_stats_env
from flywheel.flows.stages import STAGES
from tests.evaluation.test_lm_eval_and_agentic import USER_TASK, USER_UTILS
from tests.flows.test_cli import FLYWHEEL

SHADOWS = ("data", "evaluation", "training", "flows", "environments", "inference")
ROUND = """\
# My round: the tiny profile on my env and my benchmark.
model: tiny
envs: [my_env.py]
lm_eval:
  tasks: [my_echo]
  include_path: my_tasks
  limit: 3
"""


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project folder whose top-level names are ours, with an env file, a task folder and a round YAML."""
    folder = tmp_path_factory.mktemp("my-project")
    for name in SHADOWS:
        (folder / name).mkdir()
    (folder / "data.py").write_text("raise SystemExit('the user data.py was imported')\n")
    (folder / "training" / "__init__.py").write_text("MARK = 'mine'\n")  # The env imports its own `training`.
    env_source = Path(file_stats_env.__file__).read_text()
    (folder / "my_env.py").write_text(f"{env_source}\nfrom training import MARK\n\nassert MARK == 'mine'\n")
    tasks = folder / "my_tasks"
    tasks.mkdir()
    rows = "".join(json.dumps({"question": f"Say {w}.", "answer": w}) + "\n" for w in ("hi", "yo", "ok"))
    (tasks / "echo.jsonl").write_text(rows)
    (tasks / "my_echo.yaml").write_text(USER_TASK.format(data=tasks / "echo.jsonl"))
    (tasks / "utils.py").write_text(USER_UTILS)
    (folder / "my_round.yaml").write_text(ROUND)
    return folder


def in_folder(folder: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLYWHEEL, *args], cwd=folder, capture_output=True, text=True, env=env, timeout=900)


def test_the_cli_runs_from_a_folder_with_our_package_names(
    user_folder: Path, model_store: ArtifactStore, tiny_model: Path, model_cache: Path, prefect_server: dict[str, str]
) -> None:
    env = {**os.environ, **prefect_server, "FLYWHEEL_CACHE": str(model_cache), "COLUMNS": "200"}
    store = str(user_folder / "store")

    helped = in_folder(user_folder, "--help", env=env)
    assert helped.returncode == 0 and "flywheel" in helped.stdout, helped.stderr
    listed = in_folder(user_folder, "--store", model_store.url, "artifacts", "ls", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "tiny" in {row["name"] for row in json.loads(listed.stdout)}

    evaluated = in_folder(
        user_folder, "--store", model_store.url, "eval", "--model", "tiny", "--tasks", "my_echo",
        "--include-path", "my_tasks", "--limit", "2", "--json", env=env,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "my_echo" in json.loads(evaluated.stdout)["lm_eval"]["results"]

    shown = in_folder(user_folder, "round", "--profile", "tiny", "--config", "my_round.yaml", "--show-config", env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"envs: [{user_folder / 'my_env.py'}]" in shown.stdout and "groups: 4" in shown.stdout

    ran = in_folder(user_folder, "--store", store, "round", "--profile", "tiny", "--config", "my_round.yaml", env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    # The console shows the round: a line a stage, the results table, the report and the full log's paths.
    printed = [line for line in (ran.stdout + ran.stderr).splitlines() if line.strip()]
    assert len(printed) <= 60 and len(set(printed)) == len(printed), "\n".join(printed)
    for stage in STAGES:
        assert any(line.startswith(f"{stage} ") and " r1 " in line for line in printed), (stage, printed)
    assert any(line.startswith("gate      r1") and ("promoted" in line or "kept out" in line) for line in printed)
    last = ran.stdout.splitlines()[-1]  # Our own warnings (GRPO's "identical rewards" here) go to stderr.
    assert last.startswith("report: ") and last.endswith("report.html")
    assert all(line.startswith("WARNING ") for line in ran.stderr.splitlines() if line.strip()), ran.stderr
    assert any(line.startswith("| 1 | **") for line in printed)  # The round's row of the results table.
    log = Path(next(line for line in printed if line.startswith("log: "))[5:])
    assert "Finished in state Completed" in log.read_text()  # Prefect's and the libraries' logs: in the file.
    round_store = ArtifactStore(store)
    gate = round_store.read_json("gate/gate-r1", "decision.json")
    evals = [round_store.manifest(ref) for ref in gate["candidate_evals"]]
    agentic = next(m for m in evals if m.name == "agentic-r1")
    assert "file_stats/success_rate" in agentic.metrics and "samples/file_stats.jsonl" in agentic.files
    lm_eval = next(m for m in evals if m.name == "lm-eval-r1")
    assert list(round_store.read_json(lm_eval.id, "results.json")["results"]) == ["my_echo"]
    rollouts = round_store.manifest("rollouts/rollouts-r1")
    assert any(path.startswith("file_stats") for path in rollouts.files), rollouts.files
