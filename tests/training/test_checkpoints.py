"""Step checkpoints: a SIGKILLed SFT or GRPO run continues from its last one with no repeated or skipped
step, and its weights, optimizer, scheduler and RNG then equal an uninterrupted run's (GRPO's rollouts
too); a NaN mid-GRPO leaves the last good one as the run's output."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flywheel.data import ArtifactStore
from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.custom.file_stats_env import FileStatsEnv
from flywheel.training.checkpoints import resume_key, step_ref
from flywheel.training.config import TrainConfig
from flywheel.training.grpo import GRPORunConfig
from flywheel.training.registry import run_training
from flywheel.training.sft import SFTRunConfig
from tests.training.test_sft import conversation

ROOT = Path(__file__).resolve().parents[2]

# Trains the config given as JSON (into the store given), and SIGKILLs itself right after step `kill_at`'s
# checkpoint is mirrored unless `kill_at` is 0. Each run is a process of its own, as a run is in a round: a
# test process's other threads (a log shipper, a leftover server) may draw from its global RNGs meanwhile.
_RUN = """
import json, os, signal, sys
from transformers import TrainerCallback
from flywheel.data import ArtifactStore
from flywheel.training.registry import algorithm, run_training

class KillAfterSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)

data = json.loads(sys.argv[1])
cfg = algorithm(data["algorithm"]).config_class().model_validate(data)
from tests.training.test_checkpoints import run_kwargs
run_training(cfg, ArtifactStore(sys.argv[2]), callbacks=[KillAfterSave()], **run_kwargs(cfg))
"""


class VowelShareFileStats(FileStatsEnv):
    """file_stats scored by the share of vowels in the policy's replies. The tiny random model never solves
    a task, so the real reward is always 0: every advantage, and so every update, would be zero, and the
    weights of any two runs equal whatever they rolled out. This reward differs with what was sampled."""

    async def compute_reward(self, item: dict[str, Any], result: AgentResult, ctx: Any) -> float:
        text = "".join(m.get("content") or "" for m in result.messages if m["role"] == "assistant")
        return sum(c in "aeiou" for c in text) / max(1, len(text))


def run_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """What `run_training` gets beside the config: GRPO's env, made as `policy_envs` makes it by name."""
    if not isinstance(cfg, GRPORunConfig):
        return {}
    return {"envs": [VowelShareFileStats(tokenizer_name=cfg.policy_model, difficulty=cfg.difficulty, seed=cfg.seed)]}


def _configs(tiny_model: Path, tmp_path: Path) -> dict[str, TrainConfig]:
    rows = tmp_path / "sft.jsonl"
    rows.write_text("".join(json.dumps(conversation(a, b)) + "\n" for a in range(4) for b in range(2)))
    common = {"policy_model": str(tiny_model), "total_steps": 4, "save_steps": 1, "device": "cpu",
              "warmup_ratio": 0.0, "logs_root": str(tmp_path / "first")}  # fmt: skip
    return {
        "sft": SFTRunConfig(**common, dataset=str(rows), batch_size=2, max_length=128, output_name="sft-kill"),
        "grpo": GRPORunConfig(
            **common, envs=["file_stats"], batch_size=2, num_rollouts_per_task=2, num_tasks=8,
            max_completion_length=48, max_agent_turns=2, output_name="grpo-kill", rollouts_every=1,
        ),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_a_sigkilled_run_continues_from_its_last_step_checkpoint(tiny_model: Path, tmp_path: Path, name: str) -> None:
    """Killed after step 2's checkpoint and re-run: steps 3-4 are trained once, and the step-4 state is an
    uninterrupted run's (trained meanwhile, in another store: the two runs share the two cores). GRPO's
    rollouts come from the restored RNG, so steps 3-4 roll out what the uninterrupted run rolled out."""
    cfg = _configs(tiny_model, tmp_path)[name]
    store = ArtifactStore(tmp_path / "store")
    whole = cfg.model_copy(update={"output_name": f"{name}-whole", "logs_root": str(tmp_path / "whole")})
    whole_store = ArtifactStore(tmp_path / "whole-store")
    killed, uninterrupted = _train(cfg, store, kill_at=2), _train(whole, whole_store)
    for process, returncode in ((killed, -9), (uninterrupted, 0)):
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == returncode, stderr[-2000:]
    assert store.manifest(step_ref(cfg)).params["step"] == 2
    assert store.try_resolve(f"checkpoint/{cfg.output_name}") is None

    again = cfg.model_copy(update={"logs_root": str(tmp_path / "again")})  # Another machine: nothing local.
    assert resume_key(again) == resume_key(cfg)
    resumed = _train(again, store)
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-2000:]
    assert store.manifest(store.resolve(f"checkpoint/{cfg.output_name}")).metrics["steps"] == 4
    logged = [json.loads(line) for line in _run_dir(tmp_path / "again").joinpath("metrics.jsonl").open()]
    assert [m["step"] for m in logged if "loss" in m] == [1, 2, 3, 4]  # Steps 1-2 carried over, 3-4 trained.
    fresh = cfg.model_copy(update={"learning_rate": cfg.learning_rate * 2, "logs_root": str(tmp_path / "fresh")})
    assert step_ref(fresh) != step_ref(cfg)  # Other settings never continue this run's checkpoint.
    if name == "grpo":
        assert all(m["frac_reward_zero_std"] == 0 for m in logged if "loss" in m)  # Every group taught something.
        for logs, steps in (("first", (0, 1)), ("again", (2, 3))):  # Named by the steps done before them.
            assert _rollouts(tmp_path / logs, steps) == _rollouts(tmp_path / "whole", steps), logs
    _assert_same_state((store, step_ref(again)), (whole_store, step_ref(whole)), tmp_path, moved_from=tiny_model)


def _train(cfg: TrainConfig, store: ArtifactStore, kill_at: int = 0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _RUN, cfg.model_dump_json(), store.url, str(kill_at)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def _run_dir(logs_root: Path) -> Path:
    return next(logs_root.glob("run-*"))


def _rollouts(logs_root: Path, steps: tuple[int, ...]) -> list[list[dict[str, Any]]]:
    """The rollouts (prompt, completion, reward) a GRPO run logged at `steps`."""
    folder = _run_dir(logs_root) / "rollouts"
    return [[json.loads(line) for line in (folder / f"step-{step:06d}.jsonl").open()] for step in steps]


def _assert_same_state(
    resumed: tuple[ArtifactStore, str], whole: tuple[ArtifactStore, str], tmp_path: Path, moved_from: Path
) -> None:
    """Weights, optimizer moments, scheduler and RNG states of two step-4 checkpoints are equal, and the
    weights moved from `moved_from`'s by far more than the tolerance (else equal weights prove nothing)."""
    from safetensors.torch import load_file

    (store_a, ref_a), (store_b, ref_b) = resumed, whole
    a, b = store_a.get(ref_a, tmp_path / "resumed"), store_b.get(ref_b, tmp_path / "whole-state")
    assert store_a.manifest(ref_a).params["step"] == store_b.manifest(ref_b).params["step"] == 4
    weights_a, weights_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    initial = load_file(moved_from / "model.safetensors")
    assert weights_a.keys() == weights_b.keys() == initial.keys()
    assert all(torch.allclose(weights_a[k], weights_b[k], atol=1e-6) for k in weights_a)
    assert max(float((weights_a[k] - initial[k]).abs().max()) for k in initial) > 1e-5
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        _assert_equal(torch.load(a / name, weights_only=False), torch.load(b / name, weights_only=False), name)


def _assert_equal(x: object, y: object, where: str) -> None:
    """Nested state dicts equal: tensors within 1e-6, everything else exactly."""
    if isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for key in x:
            _assert_equal(x[key], y[key], f"{where}/{key}")
    elif isinstance(x, list | tuple):
        assert isinstance(y, list | tuple) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _assert_equal(u, v, f"{where}[{i}]")
    elif isinstance(x, torch.Tensor):
        assert torch.allclose(x.float(), y.float(), atol=1e-6), where
    elif hasattr(x, "tolist"):  # numpy's RNG state.
        assert x.tolist() == y.tolist(), where
    else:
        assert x == y, where


def test_a_nan_mid_grpo_leaves_the_last_good_checkpoint_as_the_output(
    model_store: ArtifactStore, tiny_model: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class PoisonAfterStep2(TrainerCallback):
        """From step 3 the training forward pass (not sampling, which runs without grad) turns NaN (TRL's fused
        log-prob head reads the final norm's output, so that is where the NaN goes in)."""

        def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 2:
                model.model.norm.register_forward_hook(
                    lambda module, inputs, out: out * float("nan") if torch.is_grad_enabled() else out
                )

    cfg = _configs(tiny_model, tmp_path)["grpo"].model_copy(update={"output_name": "grpo-nan", "resume": False})
    manifest = run_training(cfg, model_store, callbacks=[PoisonAfterStep2()])
    assert "step 3" in manifest.metrics["stopped_early"] and "step-2" in manifest.metrics["stopped_early"]
    assert manifest.metrics["steps"] == 3
    run = next((tmp_path / "first").glob("run-*"))
    weights = load_file(str(model_store.materialize(manifest.id, tmp_path / "out") / "model.safetensors"))
    step2 = load_file(str(run / "checkpoints" / "checkpoint-2" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert all(torch.equal(weights[k], step2[k]) for k in step2)
    assert "optimizer.pt" not in model_store.manifest(manifest.id).files
    losses = {m["step"]: m["loss"] for m in map(json.loads, run.joinpath("metrics.jsonl").open()) if "loss" in m}
    assert math.isfinite(losses[2]) and not math.isfinite(losses[3])
