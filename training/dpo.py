"""DPO with TRL's `DPOTrainer`: best vs worst rollout of a group, from curated pairs or sampled online.

    flywheel train dpo --config training/configs/dpo_tiny.yaml dataset=dataset/pairs-r1
    flywheel train dpo --config training/configs/dpo_tiny.yaml dataset=null envs=[file_stats]

With `dataset`, the pairs come from that artifact. Without one, the run samples them online:
`num_rollouts_per_task` rollouts of each of `num_tasks` tasks through each env's own agent loop
(as GRPO rolls out), then pairs best vs worst where their rewards differ (`flywheel.data.curation`).
The policy samples on this rank's device in its serving dtype, each rank a share of the tasks, and
every rank trains on all the pairs; the trainer loads its own copy afterwards (so ZeRO-3 shards it).
Pairs are rendered to text with the model's chat template here (prompt with the generation
prompt; chosen / rejected as the continuations), which keeps tool-call arguments as dicts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

from pydantic import Field

from flywheel.data import ArtifactStore, Manifest
from flywheel.data.columnar import read_rows
from flywheel.data.curation import preference_pair
from flywheel.training.checkpoints import StepCheckpoints, finish, model_parents, resume_from, train
from flywheel.training.config import RunnerConfig
from flywheel.training.device import DeviceSettings
from flywheel.training.distributed import gathered, my_share, this_device, training_arguments
from flywheel.training.models import resolve_model
from flywheel.training.run_logs import MetricsCallback, NonFiniteGuard, RunDir
from flywheel.training.schedule import warming_up_from_the_first_step

logger = logging.getLogger(__name__)


class DPORunConfig(RunnerConfig):
    """DPO: the runner knobs, and the pairs artifact (None: sample pairs online from `envs`)."""

    algorithm: Literal["dpo"] = Field(default="dpo", description="Always dpo.")
    dataset: str | None = Field(default=None, description="Preference pairs artifact; None samples them online.")
    min_reward_gap: float = Field(default=0.5, ge=0, description="Online pairs: least reward gap of best vs worst.")
    output_name: str = Field(default="dpo", description="Name of the checkpoint artifact.")


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


def sample_pairs(
    cfg: DPORunConfig, model: Any, tokenizer: Any, model_dir: Any, envs: list[Any] | None = None
) -> list[dict[str, Any]]:
    """Online pairs: a group of env-loop rollouts per task by the policy, best vs worst where they differ."""
    from flywheel.training.grpo import policy_envs, task_dataset
    from flywheel.training.rollouts import PolicyServer, model_context

    agents = policy_envs(cfg, envs, model_dir, tokenizer)
    _, tasks = task_dataset(agents, cfg.num_tasks)
    pairs = []
    policy = PolicyServer(lambda: model, tokenizer, cfg.sampling_top_k(), cfg.max_completion_length,
                          context=model_context(model))  # fmt: skip
    with policy as server:
        groups = []
        for task in my_share(list(tasks.values())):
            task.env.server = server
            groups.append((task, asyncio.run(_group(task, cfg))))
    for task, outcomes in groups:
        schemas, _ = task.env._resolve_tools_for_group()
        group = [{"score": reward, "turns": result.turns_used, "messages": result.messages}
                 for result, reward in outcomes if reward is not None and result.messages]  # fmt: skip
        meta = {"tools": schemas, "item_id": task.item.get("item_id"), "env": task.env.name}
        pair = preference_pair(group, meta, cfg.min_reward_gap) if len(group) >= 2 else None
        if pair is not None:
            pairs.append(pair)
    pairs = gathered(pairs)
    logger.info("sampled %d preference pairs from %d tasks", len(pairs), len(tasks))
    return pairs


def sampling_policy(model_dir: Any, settings: DeviceSettings) -> Any:
    """The policy as online sampling runs it: on this rank's device, in the dtype it is served in."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=settings.dtype, attn_implementation=settings.attn_implementation
    )
    return model.to(this_device())


async def _group(task: Any, cfg: DPORunConfig) -> list[tuple[Any, float | None]]:
    rollouts = (task.env.run_agent(task.item, cfg.temperature) for _ in range(cfg.num_rollouts_per_task))
    return list(await asyncio.gather(*rollouts))  # Concurrent: the policy server batches them.


def run_dpo(
    cfg: DPORunConfig, store: ArtifactStore, callbacks: list[Any] | None = None, envs: list[Any] | None = None
) -> Manifest:
    """load -> build -> run -> save: DPO against the reference model on stored or freshly sampled pairs
    (`envs`: names or instances, as for GRPO)."""
    import torch
    from accelerate.utils import release_memory
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    started = time.perf_counter()
    settings = cfg.settings()
    if settings.device == "cpu":
        torch.set_num_threads(cfg.num_threads)
    model_dir = resolve_model(cfg.policy_model, store)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if cfg.dataset:
        pairs = list(read_rows(store, cfg.dataset, "pairs"))
    else:
        pairs = sample_pairs(cfg, sampling_policy(model_dir, settings), tokenizer, model_dir, envs)
        release_memory()  # The sampling copy is garbage now: its memory goes back before the trainer loads.
    if not pairs:
        where = f"dataset '{cfg.dataset}'" if cfg.dataset else f"online sampling on {cfg.envs}"
        raise ValueError(f"{where} gave no preference pairs (every group scored alike)")
    ref = resolve_model(cfg.ref_model, store) if cfg.ref_model else None
    run = RunDir(cfg.logs_root, cfg.output_name)
    parents = model_parents(store, cfg.policy_model, cfg.dataset)
    # The args before any model loads: under ZeRO-3 the loads below are partitioned.
    args = training_arguments(DPOConfig, {**cfg.trainer_kwargs(run.checkpoints), "beta": max(cfg.kl_beta, 1e-3)})
    trainer = warming_up_from_the_first_step(DPOTrainer)(
        model=str(model_dir),
        ref_model=AutoModelForCausalLM.from_pretrained(ref, **settings.model_kwargs()) if ref else None,
        args=args,
        train_dataset=Dataset.from_dict(render_pairs(tokenizer, pairs)),
        processing_class=tokenizer,
        callbacks=[MetricsCallback(run), NonFiniteGuard(), StepCheckpoints(store, cfg, parents), *(callbacks or [])],
    )
    stopped = train(trainer, resume_from(store, cfg, run))
    losses = [m["loss"] for m in run.read_metrics() if "loss" in m]
    return finish(
        store, trainer, run, cfg, model_dir, parents, started, stopped,
        pairs=len(pairs), first_loss=losses[0] if losses else None, final_loss=losses[-1] if losses else None,
    )  # fmt: skip
