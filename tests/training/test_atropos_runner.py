"""The documented training program (README, AtroposRunner), run as copied with one changed import line.

The documented program trains Llama-3-8B for 10 000 steps of 64 rollouts; on a CPU test machine the program
keeps its text and only its model ids and sizes are swapped for the tiny model and one step.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from flywheel.training import AtroposRunner
from flywheel.training.config import ConfigError

SEED_PROGRAM = """
# run_training.py
from flywheel.environments.tool_use_chain import ToolUseChainEnv
from flywheel.training import AtroposRunner

env = ToolUseChainEnv(
    num_tasks=100,
    difficulty="medium",
    max_steps=20,
)

runner = AtroposRunner(
    env=env,
    policy_model="meta-llama/Llama-3-8B",
    ref_model="meta-llama/Llama-3-8B",  # KL 参考
    algorithm="grpo",                    # 或 ppo / dpo
    batch_size=64,
    learning_rate=1e-5,
    kl_beta=0.05,
    num_rollouts_per_task=4,
    total_steps=10_000,
)

runner.run()
"""

CPU_SIZED = {
    '"meta-llama/Llama-3-8B"': "TINY",
    "batch_size=64": "batch_size=4",
    "total_steps=10_000": "total_steps=1, max_completion_length=24, max_agent_turns=2",
}


def test_the_seeds_training_program_runs_and_writes_the_run_folder(
    model_store: ArtifactStore, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = SEED_PROGRAM
    for seed_text, cpu_text in CPU_SIZED.items():
        assert seed_text in program
        program = program.replace(seed_text, cpu_text)
    monkeypatch.chdir(tmp_path)  # The documented layout: logs/run-<date>/... under the working directory.
    monkeypatch.setenv("FLYWHEEL_STORE", os.fspath(model_store.url))
    before = {m.id for m in model_store.list("checkpoint")}  # The store is shared by the session's tests.
    exec(compile(program.replace("TINY", repr(str(tiny_model))), "run_training.py", "exec"), {})
    (run_dir,) = (tmp_path / "logs").glob("run-*")
    assert (run_dir / "metrics.jsonl").read_text().strip() and any((run_dir / "rollouts").iterdir())
    assert (run_dir / "checkpoints" / "final" / "config.json").exists()
    (checkpoint,) = [m for m in model_store.list("checkpoint") if m.id not in before]
    assert checkpoint.params["num_tasks"] == 100 and checkpoint.params["kl_beta"] == 0.05


def test_an_unknown_runner_knob_is_an_error_not_dropped() -> None:
    with pytest.raises(ConfigError, match="bogus_knob"):
        AtroposRunner(env="tool_use_chain", policy_model="tiny", bogus_knob=3)
    with pytest.raises(ConfigError, match="unknown envs"):
        AtroposRunner(env=["tool_use_chain", "no_such_env"], policy_model="tiny")
