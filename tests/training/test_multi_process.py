"""Two training processes on CPU (gloo), launched as on a multi-GPU machine (`launch_command`: accelerate,
one process per device): SFT, DPO and GRPO each store exactly one checkpoint with every model file and
write one run folder, and an SFT run whose ranks are both SIGKILLed resumes from its last step checkpoint."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from flywheel.training.launch import kill_tree, launch_command
from flywheel.training.registry import load_run_config
from tests.training.test_dpo_and_configs import _pair
from tests.training.test_sft import conversation

CONFIGS = Path(__file__).resolve().parents[2] / "training" / "configs"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
RUNS = {
    "sft": ("sft_tiny.yaml", ["total_steps=2", "batch_size=2", "max_length=256"]),
    "dpo": ("dpo_tiny.yaml", ["total_steps=2", "batch_size=2"]),
    "grpo": ("grpo_tiny.yaml", ["total_steps=1", "batch_size=2", "num_rollouts_per_task=2", "num_tasks=4",
                                "max_agent_turns=2", "max_completion_length=64"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def store(tiny_model: Path, model_store: ArtifactStore, tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    """A store holding the tiny model, an SFT dataset and preference pairs."""
    from flywheel.training.models import resolve_model

    store = ArtifactStore(tmp_path_factory.mktemp("multi-process-store"))
    resolve_model("tiny", store)
    rows = "".join(json.dumps(conversation(a, b)) + "\n" for a in range(4) for b in range(4))
    store.put("dataset", "sft-r1", {"train.jsonl": rows})
    store.put("dataset", "pairs-r1", {"train.jsonl": "".join(json.dumps(_pair(a)) + "\n" for a in range(8))})
    return store


def _launch(store: ArtifactStore, algorithm: str, logs: Path, extra: list[str] = ()) -> list[str]:
    config, overrides = RUNS[algorithm]
    cfg = load_run_config(str(CONFIGS / config), [*overrides, *extra], default=algorithm)
    return launch_command(cfg, str(CONFIGS / config), 2, [*overrides, *extra, f"logs_root={logs}"], store.url)


def _stored(store: ArtifactStore, name: str) -> list[str]:
    return [m.id for m in store.list("checkpoint") if m.name == name]


@pytest.mark.parametrize("algorithm", sorted(RUNS))
def test_two_ranks_store_one_checkpoint_and_write_one_run_folder(
    store: ArtifactStore, tmp_path: Path, algorithm: str
) -> None:
    name = "rl" if algorithm == "grpo" else algorithm
    before = _stored(store, name)
    done = subprocess.run(_launch(store, algorithm, tmp_path), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    added = [i for i in _stored(store, name) if i not in before]
    assert len(added) == 1  # Not one per rank.
    (run,) = tmp_path.glob("run-*")  # Both ranks in one folder.
    final = run / "checkpoints" / "final"
    assert {p.name for p in final.iterdir()} >= MODEL_FILES
    assert store.manifest(added[0]).metrics["steps"] == int(RUNS[algorithm][1][0].split("=")[1])


def test_both_ranks_killed_the_run_resumes_from_its_last_step_checkpoint(store: ArtifactStore, tmp_path: Path) -> None:
    extra = ["total_steps=20", "save_steps=1", "output_name=sft-killed"]
    command = _launch(store, "sft", tmp_path / "first", extra)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    try:
        steps = [m.params["step"] for m in store.list("checkpoint") if m.name.startswith("sft-killed-step-")]
        while max(steps, default=0) < 2:
            assert process.poll() is None and time.monotonic() < deadline, "no step checkpoint before the run ended"
            time.sleep(0.2)
            steps = [m.params["step"] for m in store.list("checkpoint") if m.name.startswith("sft-killed-step-")]
    finally:
        kill_tree(process.pid)  # Both ranks and the launcher, mid-run: a lost machine.
        process.wait()
    assert not _stored(store, "sft-killed")
    command = _launch(store, "sft", tmp_path / "second", extra)
    command.insert(command.index("flywheel.flows.cli") + 1, "-v")  # The resume is logged at INFO.
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming sft-killed from its step-" in resumed.stdout + resumed.stderr
    (stored,) = _stored(store, "sft-killed")
    assert store.manifest(stored).metrics["steps"] == 20
    (run,) = (tmp_path / "second").glob("run-*")
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "loss" in m] == list(range(1, 21))  # The killed run's steps, then the rest.
