"""Training keeps fp32 weights and computes in bf16 under autocast: at GRPO's learning rate, AdamW on
bf16 weights rounds most updates away (each step moves a weight by about the learning rate, far below
bf16's spacing near it), where fp32 weights take every one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flywheel.training.device import DeviceSettings


def _share_moved(tiny_model: Path, weights: torch.dtype, steps: int = 3, lr: float = 1e-6) -> float:
    """Share of the weights that changed after `steps` AdamW steps at `lr`, matmuls in bf16 either way."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=weights)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = sum(int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before, strict=True))
    return moved / sum(b.numel() for b in before)


def test_fp32_weights_under_bf16_autocast_learn_where_bf16_weights_do_not(tiny_model: Path) -> None:
    assert _share_moved(tiny_model, torch.float32) > 0.9
    assert _share_moved(tiny_model, torch.bfloat16) < 0.1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_trainer_loads_fp32_weights(device: str) -> None:
    """On CUDA bf16 is autocast (TrainingArguments' bf16) and the served weights are bf16."""
    settings = DeviceSettings.for_device(device)
    assert settings.model_kwargs()["dtype"] == "float32"
    if device == "cuda":
        assert settings.trainer_kwargs()["bf16"] and settings.dtype == "bfloat16"


def test_a_one_process_run_uses_one_of_several_visible_gpus(tiny_model: Path, tmp_path: Path) -> None:
    """Eight GPUs visible to one process: transformers counts eight (DataParallel), TRL refuses that, so
    each trainer's arguments count one; a launched rank (world size > 1) is left to its launcher."""
    from trl import SFTTrainer

    from flywheel.training.device import one_gpu_per_process
    from flywheel.training.sft import SFTRunConfig, trainer_args

    args = trainer_args(SFTRunConfig(device="cpu", dataset="dataset/sft"), tmp_path)
    args._n_gpu = 8  # What `TrainingArguments` sets in one process that sees 8 GPUs.
    with pytest.raises(ValueError, match="DataParallel"):
        SFTTrainer(model=str(tiny_model), args=args, train_dataset=_one_row())
    one_gpu_per_process(args)
    assert args.n_gpu == 1
    SFTTrainer(model=str(tiny_model), args=args, train_dataset=_one_row())


def _one_row():  # type: ignore[no-untyped-def]
    from datasets import Dataset

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    return Dataset.from_list([{"messages": messages}])
