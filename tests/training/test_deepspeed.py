"""DeepSpeed ZeRO on CPU: the ZeRO engine runs at its stage, and 4 SFT steps match a plain run's losses
(ZeRO-3, the profiles' default sharding; ZeRO-2 and ZeRO-3-offload under `-m sweep`: offload's CPU Adam
is a JIT build that took a fresh CI machine ~75 s more)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.inference import free_port

pytest.importorskip("deepspeed")

_RUN = """
import json, sys
from pathlib import Path
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
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
model = AutoModelForCausalLM.from_pretrained(model_dir)
trainer = SFTTrainer(model=model, args=trainer_args(cfg, run.checkpoints), train_dataset=Dataset.from_dict(data),
                     processing_class=tokenizer, callbacks=[MetricsCallback(run)])
trainer.train()
engine = trainer.model_wrapped
stage = engine.zero_optimization_stage() if type(engine).__name__ == "DeepSpeedEngine" else None
offload = bool(stage and engine.zero_offload_optimizer() and engine.zero_offload_optimizer().device != "none")
print("ENGINE " + json.dumps([type(engine).__name__, stage, offload]))
print("LOSSES " + json.dumps([m["loss"] for m in run.read_metrics() if "loss" in m]))
"""


def _losses(tiny_model: Path, stage: str, tmp_path: Path) -> tuple[list[float], list]:
    env = {
        **os.environ,
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
        "TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "flywheel" / "torch_extensions"),
    }  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", _RUN, str(tiny_model), stage, str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=900, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
             if line.startswith(("LOSSES ", "ENGINE "))}  # fmt: skip
    return lines["LOSSES"], lines["ENGINE"]


@pytest.fixture(scope="module")
def plain(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    losses, engine = _losses(tiny_model, "none", tmp_path_factory.mktemp("plain"))
    assert len(losses) == 4 and losses[-1] < losses[0] and engine[0] != "DeepSpeedEngine"
    return losses


def _check_stage(tiny_model: Path, tmp_path: Path, plain: list[float], stage: str, expected: list) -> None:
    losses, engine = _losses(tiny_model, stage, tmp_path)
    assert engine == ["DeepSpeedEngine", *expected], stage  # The ZeRO engine ran, at the configured stage.
    assert losses == pytest.approx(plain, rel=1e-4), stage


def test_zero3_runs_the_engine_and_matches_a_plain_run(tiny_model: Path, tmp_path: Path, plain: list[float]) -> None:
    """The stratified sample: stage 3, the sharding a multi-GPU round uses unless told otherwise."""
    _check_stage(tiny_model, tmp_path, plain, "zero3", [3, False])


@pytest.mark.sweep
@pytest.mark.parametrize(("stage", "expected"), [("zero2", [2, False]), ("zero3_offload", [3, True])])
def test_every_other_zero_stage_matches_a_plain_run(
    tiny_model: Path, tmp_path: Path, plain: list[float], stage: str, expected: list
) -> None:
    _check_stage(tiny_model, tmp_path, plain, stage, expected)
