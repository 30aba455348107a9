"""SFT with TRL's `SFTTrainer` on a curated conversational dataset with tools; assistant-only loss.

    flywheel train sft --config training/configs/sft_tiny.yaml max_steps=40

Conversations are tokenised here with the model's training chat template (`{% generation %}`
markers) into `input_ids` + `assistant_masks`, because tool-call arguments must stay dicts:
an Arrow column would unify every row's argument keys and render `null`s into the prompts.
Profiles: `cpu` (fp32, `use_cpu`, explicit threads) and `h100` (bf16, gradient checkpointing,
packing, DeepSpeed ZeRO via `deepspeed=`, flash attention when installed).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from data import ArtifactStore, Manifest
from training.models import TRAINING_TEMPLATE_FILE, resolve_model
from training.run_logs import MetricsCallback, NonFiniteGuard, RunDir

logger = logging.getLogger(__name__)
DEEPSPEED_DIR = Path(__file__).parent / "deepspeed"


class SFTRunConfig(BaseModel):
    """One SFT run: what to train, on what, how."""

    # -- what
    model: str = Field(default="tiny", description="Base model spec: smollm2 | tiny | store ref | local dir.")
    dataset: str = Field(description="Store ref of a curated `dataset` artifact (train.jsonl), or a local JSONL.")
    output_name: str = Field(default="sft", description="Name of the checkpoint artifact.")
    # -- how
    profile: Literal["cpu", "h100"] = Field(default="cpu", description="Hardware profile.")
    max_steps: int = Field(default=20, ge=1, description="Optimizer steps.")
    learning_rate: float = Field(default=5e-5, gt=0, description="Peak learning rate.")
    warmup_ratio: float = Field(default=0.1, ge=0, lt=1, description="Share of steps spent warming up.")
    batch_size: int = Field(default=8, ge=1, description="Per-device batch size.")
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="Micro-batches per step.")
    max_length: int = Field(default=1024, ge=16, description="Tokens per example (longer ones are truncated).")
    seed: int = Field(default=0, description="Seed for data order and initialisation.")
    num_threads: int = Field(default=1, ge=1, description="cpu profile: torch threads (one beat two under load).")
    deepspeed: Literal["zero2", "zero3", "zero3_offload"] | None = Field(
        default=None, description="DeepSpeed ZeRO config from training/deepspeed/ (h100 profile)."
    )
    report_to: list[str] = Field(default_factory=list, description="Trainer integrations, e.g. ['wandb'].")
    logs_root: str = Field(default="logs", description="Where run folders go.")
    save_steps: int = Field(default=0, ge=0, description="Checkpoint every N steps (0: only at the end).")


def load_rows(store: ArtifactStore, dataset: str) -> tuple[list[dict[str, Any]], str | None]:
    """Conversations of a dataset artifact (or a local JSONL file) and the artifact id, if any."""
    path = Path(dataset)
    if path.is_file():
        text, parent = path.read_text(), None
    else:
        manifest = store.manifest(dataset)
        text, parent = store.read_bytes(manifest.id, "train.jsonl").decode(), manifest.id
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"dataset '{dataset}' has no examples")
    return rows, parent


def tokenize_rows(tokenizer: Any, rows: list[dict[str, Any]], template: str, max_length: int) -> dict[str, list]:
    """`input_ids` and `assistant_masks` (1 on assistant tokens) for each conversation."""
    ids, masks = [], []
    cut = lost = 0
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
        ids.append(list(out["input_ids"])[:max_length])
        masks.append(list(out["assistant_masks"])[:max_length])
        lost += sum(out["assistant_masks"][max_length:])
        cut += len(out["input_ids"]) > max_length
    if cut:  # Truncation silently drops the later turns a multi-turn agent most needs to learn.
        logger.warning(
            "%d of %d conversations exceed max_length=%d: %d assistant tokens are not trained; raise max_length",
            cut, len(rows), max_length, lost,
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
    """TRL `SFTConfig` for the profile (TRL's defaults are GPU ones)."""
    from trl import SFTConfig

    common: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": cfg.max_steps,
        "learning_rate": cfg.learning_rate,
        "warmup_steps": max(1, int(cfg.warmup_ratio * cfg.max_steps)) if cfg.warmup_ratio else 0,
        "per_device_train_batch_size": cfg.batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "max_length": cfg.max_length,
        # Assistant-only loss comes from our `assistant_masks` column (TRL turns it into labels); TRL's own
        # flag is for untokenised conversational datasets.
        "assistant_only_loss": False,
        "seed": cfg.seed,
        "logging_steps": 1,
        "logging_nan_inf_filter": False,  # The guard must see a NaN, not a smoothed stand-in.
        "save_strategy": "steps" if cfg.save_steps else "no",
        "save_steps": cfg.save_steps or cfg.max_steps,
        "report_to": cfg.report_to or "none",
        "dataloader_num_workers": 0,
        "disable_tqdm": not sys.stderr.isatty(),  # A progress bar on a terminal only.
    }
    if cfg.deepspeed:  # DeepSpeed also runs on CPU (gloo): the same JSON serves tests and H100s.
        common["deepspeed"] = str(DEEPSPEED_DIR / f"{cfg.deepspeed}.json")
    if cfg.profile == "cpu":
        common.update(use_cpu=not cfg.deepspeed, bf16=False, gradient_checkpointing=False)
    else:
        common.update(bf16=True, gradient_checkpointing=True, packing=True)
        if importlib.util.find_spec("flash_attn") is not None:
            common["model_init_kwargs"] = {"attn_implementation": "flash_attention_2"}
    return SFTConfig(**common)


def run_sft(cfg: SFTRunConfig, store: ArtifactStore, callbacks: list[Any] | None = None) -> Manifest:
    """load -> build -> run -> save: a `checkpoint` artifact whose parents are the dataset and base model."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    started = time.perf_counter()
    if cfg.profile == "cpu":
        torch.set_num_threads(cfg.num_threads)
    model_dir = resolve_model(cfg.model, store)
    rows, dataset_id = load_rows(store, cfg.dataset)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_dict(tokenize_rows(tokenizer, rows, training_template(model_dir, tokenizer), cfg.max_length))
    run = RunDir(cfg.logs_root, cfg.output_name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32 if cfg.profile == "cpu" else "auto")
    trainer = SFTTrainer(
        model=model,
        args=trainer_args(cfg, run.checkpoints),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[MetricsCallback(run), NonFiniteGuard(), *(callbacks or [])],
    )
    result = trainer.train()
    final_dir = run.checkpoints / "final"
    trainer.save_model(str(final_dir))
    tokenizer.save_pretrained(final_dir)
    if (model_dir / TRAINING_TEMPLATE_FILE).exists():
        (final_dir / TRAINING_TEMPLATE_FILE).write_text((model_dir / TRAINING_TEMPLATE_FILE).read_text())
    losses = [m["loss"] for m in run.read_metrics() if "loss" in m]
    tokens = sum(len(ids) for ids in data["input_ids"]) * cfg.max_steps * cfg.batch_size // max(1, len(data))
    seconds = time.perf_counter() - started
    metrics = {
        "steps": result.global_step,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "train_examples": len(data),
        "tokens_processed": tokens,
        "wall_seconds": round(seconds, 1),
        "device": "cpu"
        if cfg.profile == "cpu"
        else torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else "cuda",
        "device_count": 1 if cfg.profile == "cpu" else max(1, torch.cuda.device_count()),
    }
    parents = [p for p in (dataset_id, store.try_resolve(f"model/{cfg.model}", cfg.model)) if p]
    manifest = store.put(
        "checkpoint",
        cfg.output_name,
        final_dir,
        parents=parents,
        params=cfg.model_dump(),
        metrics=metrics,
    )
    store.put("run", cfg.output_name, run.path, parents=[manifest.id], metrics=metrics)
    logger.info(
        "SFT %s: %d steps, loss %.3f -> %.3f, %d examples, %.0f s",
        cfg.output_name,
        result.global_step,
        metrics["first_loss"] or float("nan"),
        metrics["final_loss"] or float("nan"),
        len(data),
        seconds,
    )
    return manifest


def launch_command(
    config_file: str,
    num_gpus: int,
    deepspeed: str | None = "zero3",
    overrides: Sequence[str] = (),
    store_url: str | None = None,
) -> list[str]:
    """The `accelerate launch` argv that runs this SFT config with its `key=value` overrides on `num_gpus`
    GPUs, saving into `store_url` (None: the launched process's own default); pure: nothing runs."""
    command = ["accelerate", "launch", "--num_processes", str(num_gpus), "--num_machines", "1"]
    if deepspeed:
        command += [
            "--config_file",
            str(DEEPSPEED_DIR / "accelerate_multi_gpu.yaml"),
            "--deepspeed_config_file",
            str(DEEPSPEED_DIR / f"{deepspeed}.json"),
        ]
    else:
        command.append("--multi_gpu")
    store = ["--store", store_url] if store_url else []
    return [*command, "-m", "flows.cli", *store, "train", "sft", "--config", config_file, *overrides]
