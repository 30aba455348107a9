"""DeepSpeed ZeRO on CPU: in two processes (`accelerate launch`, gloo), ZeRO-3 (the profiles' default
sharding) runs the ZeRO engine at stage 3, holds half the weights on each rank and matches two plain
data-parallel ranks step for step. Under `-m sweep`, each stage in one process against a plain run's
4 SFT steps (ZeRO-3 there adds nothing the two-process run does not check; offload's CPU Adam is a
JIT build that took a fresh CI machine ~75 s more)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.inference import free_port
from flywheel.training.launch import launcher
from flywheel.training.sft import SFTRunConfig

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
_RUN = """
import json, os, sys
from pathlib import Path
from datasets import Dataset
from transformers import AutoTokenizer
from trl import SFTTrainer
from tests.training.test_sft import conversation
from flywheel.training.run_logs import MetricsCallback, RunDir
from flywheel.training.sft import SFTRunConfig, tokenize_rows, trainer_args, training_template

model_dir, stage, logs = Path(sys.argv[1]), (None if sys.argv[2] == "none" else sys.argv[2]), sys.argv[3]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
rows = [conversation(a, b) for a in range(4) for b in range(2)]
data = tokenize_rows(tokenizer, rows, training_template(model_dir, tokenizer), 128)
cfg = SFTRunConfig(dataset="x", device="cpu", total_steps=4, batch_size=2, learning_rate=1e-3, max_length=128,
                   deepspeed=stage, warmup_ratio=0.0)
run = RunDir(logs, stage or "plain")
trainer = SFTTrainer(model=str(model_dir), args=trainer_args(cfg, run.checkpoints),
                     train_dataset=Dataset.from_dict(data), processing_class=tokenizer,
                     callbacks=[MetricsCallback(run)])
trainer.train()
engine = trainer.model_wrapped
stage = engine.zero_optimization_stage() if type(engine).__name__ == "DeepSpeedEngine" else None
offload = bool(stage and engine.zero_offload_optimizer() and engine.zero_offload_optimizer().device != "none")
params = list(trainer.model.parameters())
held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
share = held / sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3: this rank's part of the weights.
facts = {"engine": type(engine).__name__, "stage": stage, "offload": offload, "ranks": trainer.args.world_size,
         "share": round(share, 2)}
# A file per rank, not stdout: the ranks share one pipe, and a rank's prints can land mid-line in another's.
facts["losses"] = [m["loss"] for m in run.read_metrics() if "loss" in m]  # Only rank 0 logs them.
Path(logs, f"engine-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(facts))
"""


def _run(
    command: list[str], tiny_model: Path, stage: str, env: dict[str, str], tmp_path: Path
) -> tuple[list[float], list[dict]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "run_sft.py"
    script.write_text(_RUN)
    result = subprocess.run([*command, str(script), str(tiny_model), stage, str(tmp_path)], capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=900,
                            cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    engines = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("engine-*.json"))]
    losses = [engine.pop("losses") for engine in engines]
    return losses[0], engines  # Rank 0's: only rank 0 logs losses.


def _losses(tiny_model: Path, stage: str, tmp_path: Path) -> tuple[list[float], dict]:
    env = {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
        "TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "flywheel" / "torch_extensions"),
    }  # fmt: skip
    losses, (engine,) = _run([sys.executable], tiny_model, stage, env, tmp_path)
    return losses, engine


def _launched(tiny_model: Path, stage: str, tmp_path: Path) -> tuple[list[float], list[dict]]:
    """The same run as two ranks, launched as `flywheel train --gpus 2` launches them."""
    command = launcher(SFTRunConfig(dataset="x", deepspeed=None if stage == "none" else stage), 2)
    port = str(free_port())
    return _run([*command, "--main_process_port", port], tiny_model, stage, {"MASTER_PORT": port}, tmp_path)


@pytest.fixture(scope="module")
def plain(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    losses, engine = _losses(tiny_model, "none", tmp_path_factory.mktemp("plain"))
    assert len(losses) == 4 and losses[-1] < losses[0] and engine["engine"] != "DeepSpeedEngine"
    return losses


def _check_stage(tiny_model: Path, tmp_path: Path, plain: list[float], stage: str, expected: list) -> None:
    losses, engine = _losses(tiny_model, stage, tmp_path)
    assert [engine["engine"], engine["stage"], engine["offload"]] == ["DeepSpeedEngine", *expected], stage
    assert losses == pytest.approx(plain, rel=1e-4), stage


def test_zero3_in_two_processes_shards_the_weights_and_matches_two_plain_ranks(
    tiny_model: Path, tmp_path: Path
) -> None:
    ddp, plain_ranks = _launched(tiny_model, "none", tmp_path / "ddp")
    zero3, ranks = _launched(tiny_model, "zero3", tmp_path / "zero3")
    assert [r["ranks"] for r in plain_ranks] == [2, 2] and len(ddp) == 4
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["engine"] == "DeepSpeedEngine" and rank["stage"] == 3 and rank["ranks"] == 2
        assert rank["share"] == pytest.approx(0.5, abs=0.02)  # Each rank holds half the weights.
    assert zero3 == pytest.approx(ddp, rel=1e-4)  # ZeRO-3 is data parallelism: the same steps.


@pytest.mark.sweep
@pytest.mark.parametrize(
    ("stage", "expected"), [("zero2", [2, False]), ("zero3", [3, False]), ("zero3_offload", [3, True])]
)
def test_every_zero_stage_matches_a_plain_run_in_one_process(
    tiny_model: Path, tmp_path: Path, plain: list[float], stage: str, expected: list
) -> None:
    _check_stage(tiny_model, tmp_path, plain, stage, expected)
