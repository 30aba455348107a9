"""DPO with TRL's `DPOTrainer` on curated preference pairs (best vs worst rollout of a group).

    flywheel train dpo --config training/configs/dpo_tiny.yaml dataset=dataset/round1-pairs

Pairs are rendered to text with the model's chat template here (prompt with the generation
prompt; chosen / rejected as the continuations), which keeps tool-call arguments as dicts.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from data import ArtifactStore, Manifest
from training.config import RunnerConfig
from training.models import resolve_model
from training.run_logs import MetricsCallback, NonFiniteGuard, RunDir

logger = logging.getLogger(__name__)


def render_pairs(tokenizer: Any, pairs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """TRL's standard preference format: prompt / chosen / rejected strings."""
    out: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for pair in pairs:
        tools = pair.get("tools") or None
        prompt = tokenizer.apply_chat_template(pair["prompt"], tools=tools, tokenize=False, add_generation_prompt=True)
        out["prompt"].append(prompt)
        for side in ("chosen", "rejected"):
            full = tokenizer.apply_chat_template(pair["prompt"] + pair[side], tools=tools, tokenize=False)
            if not full.startswith(prompt):
                raise ValueError("the chat template does not render the prompt as a prefix of the conversation")
            out[side].append(full[len(prompt) :])
    return out


def run_dpo(cfg: RunnerConfig, store: ArtifactStore) -> Manifest:
    """load -> build -> run -> save: DPO against the reference model on a pairs artifact."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from training.grpo import save_checkpoint

    started = time.perf_counter()
    if cfg.profile == "cpu":
        torch.set_num_threads(cfg.num_threads)
    assert cfg.dataset is not None  # RunnerConfig requires it for DPO.
    model_dir = resolve_model(cfg.policy_model, store)
    pairs_text = store.read_bytes(cfg.dataset, "train.jsonl").decode()
    pairs = [json.loads(line) for line in pairs_text.splitlines() if line.strip()]
    if not pairs:
        raise ValueError(f"dataset '{cfg.dataset}' has no preference pairs")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ref = resolve_model(cfg.ref_model, store) if cfg.ref_model else None
    run = RunDir(cfg.logs_root, cfg.output_name)
    args = DPOConfig(
        output_dir=str(run.checkpoints),
        max_steps=cfg.total_steps,
        learning_rate=cfg.learning_rate,
        per_device_train_batch_size=cfg.batch_size,
        beta=max(cfg.kl_beta, 1e-3),
        seed=cfg.seed,
        logging_steps=1,
        logging_nan_inf_filter=False,
        save_strategy="no",
        report_to=cfg.report_to or "none",
        disable_tqdm=not sys.stderr.isatty(),
        **({"use_cpu": True, "bf16": False} if cfg.profile == "cpu" else {"bf16": True}),
    )
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        ref_model=AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32) if ref else None,
        args=args,
        train_dataset=Dataset.from_dict(render_pairs(tokenizer, pairs)),
        processing_class=tokenizer,
        callbacks=[MetricsCallback(run), NonFiniteGuard()],
    )
    trainer.train()
    return save_checkpoint(store, trainer, tokenizer, run, cfg, model_dir, started)


def run_training(cfg: RunnerConfig, store: ArtifactStore) -> Manifest:
    """Dispatch on `algorithm`; PPO is not shipped by TRL 1.16, so it fails naming the alternatives."""
    if cfg.algorithm == "grpo":
        from training.grpo import run_grpo

        return run_grpo(cfg, store)
    if cfg.algorithm == "dpo":
        return run_dpo(cfg, store)
    raise ValueError(
        "algorithm=ppo is not available: TRL 1.16 ships no PPOTrainer (not even in trl.experimental). "
        "Use algorithm=grpo (online RL on the environments) or algorithm=dpo (offline preference pairs)."
    )
