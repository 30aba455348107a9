"""Two training processes on CPU (gloo), launched as on a multi-GPU machine (`launch_command`: accelerate,
one process per device): SFT (plain and ZeRO-3), DPO and GRPO each store exactly one checkpoint, with every
model file and whole weights, and write one run folder; an SFT run whose ranks are both SIGKILLed resumes
from its last step checkpoint; online DPO samples each task on one rank and trains every rank on all pairs;
two "machines" on localhost (`flywheel train --nodes 2`) train one SFT run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from flywheel.inference import free_port
from flywheel.training.dpo import DPORunConfig
from flywheel.training.launch import kill_tree, launch_command, launcher
from flywheel.training.registry import load_run_config
from tests.training.test_dpo_and_configs import _pair
from tests.training.test_sft import conversation

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "training" / "configs"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
RUNS = {
    "sft": ("sft_tiny.yaml", ["total_steps=2", "batch_size=2", "max_length=256"]),
    "sft_zero3": ("sft_tiny.yaml", ["total_steps=2", "batch_size=2", "max_length=256", "deepspeed=zero3",
                                    "output_name=sft-zero3"]),
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


def _launch(store: ArtifactStore, run: str, logs: Path, extra: list[str] = ()) -> list[str]:
    config, overrides = RUNS[run]
    cfg = load_run_config(str(CONFIGS / config), [*overrides, *extra], default=run.split("_")[0])
    return launch_command(cfg, str(CONFIGS / config), 2, [*overrides, *extra, f"logs_root={logs}"], store.url)


def _stored(store: ArtifactStore, name: str) -> list[str]:
    return [m.id for m in store.list("checkpoint") if m.name == name]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_two_ranks_store_one_checkpoint_and_write_one_run_folder(
    store: ArtifactStore, tiny_model: Path, tmp_path: Path, run: str
) -> None:
    cfg = load_run_config(str(CONFIGS / RUNS[run][0]), RUNS[run][1], default=run.split("_")[0])
    before = _stored(store, cfg.output_name)
    done = subprocess.run(_launch(store, run, tmp_path), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    added = [i for i in _stored(store, cfg.output_name) if i not in before]
    assert len(added) == 1  # Not one per rank.
    (folder,) = tmp_path.glob("run-*")  # Both ranks in one folder.
    final = folder / "checkpoints" / "final"
    assert {p.name for p in final.iterdir()} >= MODEL_FILES
    assert store.manifest(added[0]).metrics["steps"] == cfg.total_steps
    logged = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert next(m for m in logged if "learning_rate" in m)["learning_rate"] > 0  # Step 1 trains (warm-up).
    stored = store.read_bytes(added[0], "model.safetensors")
    assert _shapes(stored) == _shapes((tiny_model / "model.safetensors").read_bytes())


def _shapes(weights: bytes) -> dict[str, list[int]]:
    """Every tensor's shape: a ZeRO-3 rank's own shard, saved as if it were the model, has empty tensors."""
    from safetensors.torch import load

    return {name: list(tensor.shape) for name, tensor in load(weights).items()}


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


_SAMPLE = """
import json, os, sys
from transformers import AutoTokenizer
from flywheel.training.device import DeviceSettings
from flywheel.training.dpo import DPORunConfig, sample_pairs, sampling_policy
from tests.training.test_dpo_and_configs import half_solving
from tests.training.test_grpo import _script_generation

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model = sampling_policy(sys.argv[1], DeviceSettings.for_device("cpu"))
started = []
_script_generation(model, tokenizer, half_solving(started))
cfg = DPORunConfig(envs=["file_stats"], num_tasks=4, num_rollouts_per_task=2, batch_size=2, device="cpu")
pairs = sample_pairs(cfg, model, tokenizer, sys.argv[1])
# A file per rank: the two ranks' prints share one pipe and can interleave mid-line.
facts = {"started": len(started), "pairs": [p["meta"]["item_id"] for p in pairs]}
open(os.path.join(sys.argv[2], f"rank-{os.environ['RANK']}.json"), "w").write(json.dumps(facts))
"""


def test_online_dpo_ranks_sample_a_share_of_the_tasks_and_train_on_every_pair(tiny_model: Path, tmp_path: Path) -> None:
    script = tmp_path / "sample.py"
    script.write_text(_SAMPLE)
    command = [*launcher(DPORunConfig(), 2), str(script), str(tiny_model), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["started"] for rank in ranks] == [4, 4]  # Two of the four tasks each, two rollouts a task.
    assert ranks[0]["pairs"] == ranks[1]["pairs"]  # One dataset, so the ranks take the same number of steps.
    assert len(set(ranks[0]["pairs"])) == 4  # A pair from every task, none twice.


def test_two_machines_on_localhost_train_one_sft_run(store: ArtifactStore, tiny_model: Path, tmp_path: Path) -> None:
    """`flywheel train --nodes 2` on two "machines" (one process each, each its own logs folder, as its own
    disk), meeting at machine 0's rendezvous: one run of two ranks, one checkpoint."""
    config, overrides = RUNS["sft"]
    port = free_port()

    def machine(rank: int) -> subprocess.Popen[str]:
        machines = ["--nodes", "2", "--node-rank", str(rank), "--main-address", "127.0.0.1", "--main-port", str(port)]
        command = [sys.executable, "-m", "flywheel.flows.cli", "--store", store.url, "train", "sft", "--config",
                   str(CONFIGS / config), *machines, *overrides, "output_name=sft-machines",
                   f"logs_root={tmp_path / str(rank)}"]  # fmt: skip
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip

    processes = [machine(0), machine(1)]
    try:
        outputs = [process.communicate(timeout=600)[0] for process in processes]
    finally:
        for process in processes:
            kill_tree(process.pid)
    assert [process.returncode for process in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    (stored,) = _stored(store, "sft-machines")
    assert store.manifest(stored).metrics["device_count"] == 2  # One run of two ranks, not two runs of one.
    assert store.manifest(stored).metrics["steps"] == 2
    assert (tmp_path / "1").exists() and list((tmp_path / "0").glob("run-*/checkpoints/final"))
