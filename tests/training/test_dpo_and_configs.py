"""DPO on curated and online pairs; PPO fails clearly; every shipped config loads via the registry; the train CLI."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from flywheel.training.config import ConfigError, load_config
from flywheel.training.dpo import DPORunConfig, render_pairs
from flywheel.training.launch import accelerate_cli, launch_command
from flywheel.training.registry import ALGORITHMS, load_run_config, run_training
from flywheel.training.sft import SFTRunConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "training" / "configs").glob("*.yaml"))


def _pair(a: int) -> dict:
    prompt = [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a}+1?"}]
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": f"{a + 1}"}],
        "rejected": [{"role": "assistant", "content": "I do not know."}],
        "tools": [],
    }


def test_render_pairs_splits_after_the_generation_prompt(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    rendered = render_pairs(AutoTokenizer.from_pretrained(tiny_model), [_pair(2)])
    assert rendered["prompt"][0].endswith("<|im_start|>assistant\n")
    assert rendered["chosen"] == ["3<|im_end|>\n"] and rendered["rejected"] == ["I do not know.<|im_end|>\n"]


def test_dpo_trains_on_a_pairs_artifact(model_store: ArtifactStore, tiny_model: Path, tmp_path: Path) -> None:
    pairs = model_store.put(
        "dataset", "pairs-test", {"train.jsonl": "".join(json.dumps(_pair(a)) + "\n" for a in range(8))}
    )
    cfg = DPORunConfig(dataset="dataset/pairs-test", total_steps=4, batch_size=4,
                       num_rollouts_per_task=2, learning_rate=1e-3, kl_beta=0.1, logs_root=str(tmp_path),
                       output_name="dpo-test")  # fmt: skip
    manifest = run_training(cfg, model_store)
    assert manifest.metrics["steps"] == 4 and set(manifest.parents) == {model_store.resolve("model/tiny"), pairs.id}
    losses = [json.loads(line)["loss"] for line in next(tmp_path.glob("run-*")).joinpath("metrics.jsonl").open()
              if "loss" in json.loads(line)]  # fmt: skip
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_ppo_fails_naming_the_alternatives(model_store: ArtifactStore) -> None:
    with pytest.raises(ConfigError, match="algorithm=grpo.*algorithm=dpo"):
        load_run_config(None, ["algorithm=ppo"])
    with pytest.raises(ConfigError, match="unknown algorithm 'a2c': choose sft, grpo, dpo"):
        load_run_config(None, ["algorithm=a2c"])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_documents_its_command(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and ("flywheel train" in first or "accelerate launch" in first)
    cfg = load_run_config(path, default="sft" if path.name.startswith("sft") else "grpo")
    assert isinstance(cfg, ALGORITHMS[cfg.algorithm].config_class())
    assert cfg.algorithm == path.name.split("_")[0]
    assert not cfg.report_to  # A tracker that needs a key (wandb) would stop a run on a fresh machine.


def test_zero3_offload_keeps_torch_adam_not_deepspeeds_jit_built_one() -> None:
    """DeepSpeedCPUAdam compiles with nvcc at the first step; the offload config keeps the Trainer's optimizer."""
    offload = json.loads((CONFIGS[0].parent.parent / "deepspeed" / "zero3_offload.json").read_text())
    assert offload["zero_force_ds_cpu_optimizer"] is False and "optimizer" not in offload
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_launch_command_for_multi_gpu_sft() -> None:
    command = launch_command(SFTRunConfig(dataset="d", deepspeed="zero3"), "cfg.yaml", 8)
    assert command[:5] == [*accelerate_cli(), "--num_processes", "8"]
    assert any(part.endswith("zero3.json") for part in command)
    assert command[-6:] == ["-m", "flywheel.flows.cli", "train", "sft", "--config", "cfg.yaml"]


def test_train_cli_dry_run_and_config_errors(tmp_path: Path) -> None:
    from tests.flows.test_cli import FLYWHEEL, assert_one_line_error, run

    sft = str(CONFIGS[[p.name for p in CONFIGS].index("sft_h100_zero3.yaml")])
    dry = run("--store", str(tmp_path), "train", "sft", "--config", sft, "--gpus", "4", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.startswith(
        f"{sys.executable} -m accelerate.commands.launch --num_processes 4"
    ), dry.stderr
    bad = run("--store", str(tmp_path), "train", "rl", "--config", str(CONFIGS[0].with_name("grpo_tiny.yaml")),
              "kl_beta=0.001")  # fmt: skip
    assert_one_line_error(bad, "kl_beta=0.001 is below 0.01; raise it or set allow_low_kl=true")
    assert FLYWHEEL
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(SFTRunConfig, tmp_path / "missing.yaml")


def half_solving(started: list[str]) -> Callable[[str], str]:
    """A reply script for file_stats: of each two rollouts started, the first solves the task as the oracle
    does and the second gives up; `started` collects each rollout's first prompt."""
    from tests.training.test_grpo import _count_lines_like_the_oracle

    def reply(conversation: str) -> str:
        if "<tools>" in conversation and "<tool_response>" not in conversation:  # A start, not the judge's prompt.
            started.append(conversation)
            if len(started) % 2 == 0:
                return "I cannot do this."
        return _count_lines_like_the_oracle(conversation)

    return reply


def test_online_dpo_pairs_the_best_and_worst_rollout_of_each_group(tiny_model: Path) -> None:
    """Pairs sampled with the env's own loop and verifier: one rollout of each group solves the task, one gives up."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flywheel.training.dpo import sample_pairs
    from tests.training.test_grpo import _script_generation

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    _script_generation(model, tokenizer, half_solving([]))
    cfg = DPORunConfig(envs=["file_stats"], num_tasks=2, num_rollouts_per_task=2, batch_size=2, device="cpu")
    pairs = sample_pairs(cfg, model, tokenizer, tiny_model)
    assert len(pairs) == 2
    for pair in pairs:
        assert pair["meta"]["chosen_reward"] >= 0.8 and pair["meta"]["rejected_reward"] == 0.0
        assert "write_file" in json.dumps(pair["chosen"]) and pair["rejected"][0]["content"] == "I cannot do this."
    assert render_pairs(tokenizer, pairs)["prompt"][0].endswith("<|im_start|>assistant\n")


def test_online_dpo_without_any_reward_gap_fails_clearly(model_store: ArtifactStore, tmp_path: Path) -> None:
    cfg = DPORunConfig(envs=["file_stats"], num_tasks=1, num_rollouts_per_task=2, batch_size=2, device="cpu",
                       max_completion_length=8, max_agent_turns=1, logs_root=str(tmp_path))  # fmt: skip
    with pytest.raises(ValueError, match=r"online sampling on \['file_stats'\] gave no preference pairs"):
        run_training(cfg, model_store)


def test_online_dpo_samples_on_the_ranks_device_in_the_served_dtype(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not on the CPU in fp32 where the weights load: a GPU rank samples on its own GPU, as vLLM would serve."""
    import torch

    from flywheel.training import dpo
    from flywheel.training.device import DeviceSettings

    monkeypatch.setattr(dpo, "this_device", lambda: torch.device("meta"))  # Stands in for `cuda:<local rank>`.
    model = dpo.sampling_policy(tiny_model, DeviceSettings.for_device("cuda"))
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
