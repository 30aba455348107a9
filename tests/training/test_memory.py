"""The memory plan's arithmetic against hand-computed cases, and the h100 profile fitted to each model
size it promises (0.5B to 7B on 8 x 80 GB)."""

from __future__ import annotations

import json
import subprocess

import pytest

from flywheel.flows.plan import round_plan
from flywheel.flows.round_config import load_round_config
from flywheel.flows.stages import STAGES
from flywheel.training.memory import CUDA_OVERHEAD, KNOWN_SHAPES, ModelShape, fit_micro_batch, training_memory
from tests.flows.test_cli import FLYWHEEL

TOY = ModelShape(params=10**9, layers=10, hidden=1000, vocab=10_000)
QWEN = [name for name in KNOWN_SHAPES if name.startswith("Qwen/")]


def test_a_config_counts_its_parameters() -> None:
    """Qwen2.5-0.5B has 494,032,768 parameters; the count leaves out its 27,648 attention biases."""
    assert KNOWN_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"].params == 494_032_768 - 24 * (896 + 2 * 128)
    assert abs(KNOWN_SHAPES["Qwen/Qwen2.5-7B-Instruct"].params / 7.6e9 - 1) < 0.01  # Untied embeddings.


def test_one_gpu_holds_sixteen_bytes_a_parameter_and_the_activations() -> None:
    terms = training_memory(TOY, gpus=1, zero=None, micro_batch=1, seq_len=1000, logits=True)
    assert terms == {
        "weights": 4e9, "gradients": 4e9, "optimizer state": 8e9,
        "checkpointed activations": 10 * 1000 * 1000 * 2, "recomputed layer": 1000 * 1000 * 34,
        "logits": 1000 * 10_000 * 6, "CUDA context and allocator": CUDA_OVERHEAD,
    }  # fmt: skip


def test_zero3_shards_everything_but_the_layers_in_use_and_grpo_adds_reference_and_vllm() -> None:
    terms = training_memory(TOY, gpus=8, zero="zero3", micro_batch=2, seq_len=500, logits=False, reference=True,
                            vllm_bytes=24e9)  # fmt: skip
    gathered = 2 * 2 * (1e9 - 10_000 * 1000) / 10
    assert terms["weights"] == 2e9 / 8 + gathered and terms["gradients"] == 2e9 / 8
    assert terms["optimizer state"] == 12e9 / 8 and terms["KL reference"] == 2e9 / 8
    assert terms["vLLM (weights and KV cache)"] == 24e9 and "logits" not in terms
    zero2 = training_memory(TOY, gpus=8, zero="zero2", micro_batch=2, seq_len=500, logits=False)
    assert zero2["weights"] == 2e9 and zero2["optimizer state"] == 12e9 / 8


def test_the_micro_batch_halves_until_it_fits() -> None:
    assert fit_micro_batch(lambda micro: micro * 10, 64, 100) == 8
    assert fit_micro_batch(lambda micro: micro * 1000, 64, 100) == 1  # The plan then refuses.


@pytest.mark.parametrize("model", QWEN)
def test_the_h100_profile_fits_every_model_size_it_promises(model: str) -> None:
    config = load_round_config("h100", overrides=[f"model={model}"])
    plan = round_plan(config, "h100")
    for name in (n for n, s in STAGES.items() if s.gpu):
        memory = plan["stages"][name]["memory"]
        assert memory["fits"] and memory["per_gpu_gb"] < 80, (name, memory)
        assert plan["stages"][name]["pool"] == "h100"
    for name, section in (("sft", config.sft), ("rl", config.rl)):
        args = plan["stages"][name]["config"]
        assert args["batch_size"] * args["gradient_accumulation_steps"] == section.batch_size  # Same batch a step.
    assert plan["stages"]["rl"]["config"]["batch_size"] < config.rl.batch_size or model != QWEN[-1]  # 7B: fitted.


def test_a_plan_over_the_gpu_refuses_naming_its_largest_term() -> None:
    done = subprocess.run([FLYWHEEL, "plan", "--profile", "h100", "model=Qwen/Qwen2.5-7B-Instruct", "gpus=1"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: sft needs ~") and "of 80.0 (largest: optimizer state" in line
    fits = subprocess.run([FLYWHEEL, "plan", "--profile", "h100", "model=Qwen/Qwen2.5-7B-Instruct"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert fits.returncode == 0 and json.loads(fits.stdout)["stages"]["rl"]["memory"]["fits"]
