"""SFT with TRL's `SFTTrainer` on a curated conversational dataset with tools; assistant-only loss.

    flywheel train sft --config training/configs/sft_tiny.yaml total_steps=40

Conversations are tokenised here with the model's training chat template (`{% generation %}`
markers) into `input_ids` + `assistant_masks`, because tool-call arguments must stay dicts:
an Arrow column would unify every row's argument keys and render `null`s into the prompts.
The device decides the rest (`flywheel.training.device`): on CPU fp32, `use_cpu` and explicit threads; on
CUDA bf16, gradient checkpointing, packing and flash attention when installed; DeepSpeed ZeRO
(`deepspeed=`) or FSDP across the GPUs `flywheel train sft --gpus N` launches.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Literal

from flywheel.data import ArtifactStore, Manifest
from flywheel.data.columnar import read_rows
from flywheel.training.checkpoints import StepCheckpoints, finish, model_parents, resume_from, train
from flywheel.training.distributed import training_arguments
from flywheel.training.models import TRAINING_TEMPLATE_FILE, resolve_model
from flywheel.training.run_logs import MetricsCallback, NonFiniteGuard, RunDir
from flywheel.training.schedule import warming_up_from_the_first_step
from flywheel.training.sft_config import SFTRunConfig, sft_kwargs

logger = logging.getLogger(__name__)


def load_rows(store: ArtifactStore, dataset: str) -> tuple[list[dict[str, Any]], str | None]:
    """Conversations of a dataset artifact (or a local JSONL file) and the artifact id, if any."""
    path = Path(dataset)
    if path.is_file():
        rows, parent = [json.loads(line) for line in path.read_text().splitlines() if line.strip()], None
    else:
        parent = store.manifest(dataset).id
        rows = list(read_rows(store, parent, "sft"))
    if not rows:
        raise ValueError(f"dataset '{dataset}' has no examples")
    return rows, parent


class NoExampleFits(ValueError):
    """No conversation fits `max_length` (`overlong: drop`), or none keeps an assistant token when cut
    (`truncate`): nothing to train on."""


def tokenize_rows(
    tokenizer: Any,
    rows: list[dict[str, Any]],
    template: str,
    max_length: int,
    overlong: Literal["drop", "truncate"] = "drop",
) -> dict[str, list]:
    """`input_ids` and `assistant_masks` (1 on assistant tokens) of each conversation.

    One longer than `max_length` is left out (`drop`): cut, it would teach the first turns of a
    task and never its end, where a multi-turn agent's answer is. `truncate` cuts it instead, unless
    the cut keeps no assistant token (a prompt longer than `max_length`), which would teach nothing."""
    ids, masks, too_long = [], [], []
    for row in rows:
        tools = json.loads(row["tools"]) if isinstance(row.get("tools"), str) else row.get("tools")
        out = tokenizer.apply_chat_template(
            row["messages"],
            tools=tools or None,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        if len(out["input_ids"]) > max_length:
            too_long.append(sum(out["assistant_masks"][max_length:]))
            if overlong == "drop" or not any(out["assistant_masks"][:max_length]):
                continue
        ids.append(list(out["input_ids"])[:max_length])
        masks.append(list(out["assistant_masks"])[:max_length])
    if not ids:
        raise NoExampleFits(f"none of {len(rows)} conversations fits max_length={max_length}: raise max_length")
    if too_long:
        logger.warning(
            "%d of %d conversations exceed max_length=%d: %s; raise max_length to train on all of them",
            len(too_long), len(rows), max_length,
            "they are left out" if overlong == "drop" else f"{sum(too_long)} assistant tokens are cut off",
        )  # fmt: skip
    return {"input_ids": ids, "assistant_masks": masks}


def training_template(model_dir: Path, tokenizer: Any) -> str:
    """The `{% generation %}` template saved beside the model, else TRL's for a template it knows."""
    beside = model_dir / TRAINING_TEMPLATE_FILE
    if beside.exists():
        return beside.read_text()
    from trl.chat_template_utils import get_training_chat_template

    return get_training_chat_template(tokenizer)


def trainer_args(cfg: SFTRunConfig, output_dir: Path) -> Any:
    """TRL `SFTConfig` for the run's device (TRL's defaults are GPU ones)."""
    from trl import SFTConfig

    return training_arguments(SFTConfig, sft_kwargs(cfg, output_dir))


def run_sft(cfg: SFTRunConfig, store: ArtifactStore, callbacks: list[Any] | None = None) -> Manifest:
    """load -> build -> run -> save: a `checkpoint` artifact whose parents are the dataset and base model."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTTrainer

    started = time.perf_counter()
    settings = cfg.settings()
    if settings.device == "cpu":
        torch.set_num_threads(cfg.num_threads)
    model_dir = resolve_model(cfg.policy_model, store)
    rows, dataset_id = load_rows(store, cfg.dataset)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = training_template(model_dir, tokenizer)
    data = Dataset.from_dict(tokenize_rows(tokenizer, rows, template, cfg.max_length, cfg.overlong))
    run = RunDir(cfg.logs_root, cfg.output_name)
    parents = model_parents(store, cfg.policy_model, dataset_id)
    trainer = warming_up_from_the_first_step(SFTTrainer)(
        model=str(model_dir),  # TRL loads it after the args exist, so ZeRO-3 partitions it while loading.
        args=trainer_args(cfg, run.checkpoints),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[MetricsCallback(run), NonFiniteGuard(), StepCheckpoints(store, cfg, parents), *(callbacks or [])],
    )
    stopped = train(trainer, resume_from(store, cfg, run))
    losses = [m["loss"] for m in run.read_metrics() if "loss" in m]
    per_step = cfg.batch_size * cfg.gradient_accumulation_steps * trainer.args.world_size
    tokens = sum(len(ids) for ids in data["input_ids"]) * cfg.total_steps * per_step // max(1, len(data))
    return finish(
        store, trainer, run, cfg, model_dir, parents, started, stopped,
        first_loss=losses[0] if losses else None,
        final_loss=losses[-1] if losses else None,
        train_examples=len(data),
        left_out_examples=len(rows) - len(data),
        tokens_processed=tokens,
        device_count=trainer.args.world_size,  # One process per device.
    )  # fmt: skip
