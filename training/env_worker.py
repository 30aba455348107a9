"""An env worker of atropos-mode GRPO: one env's `serve` loop against the trainer's policy.

    python -m flywheel.training.env_worker --config run.json --env tool_use_chain --index 0 \\
        --api http://127.0.0.1:8000 --policy http://127.0.0.1:8001 --model-dir DIR

It is atroposlib's own serve loop (`env_manager`: register with `run-api`, keep the queue filled up
to `max_batches_offpolicy` batches, post scored groups); only the group is made here: `group_size`
rollouts through the env's agent loop with `PolicyServer` generating on the trainer's endpoint, so
a group carries the token ids the policy sampled (as in-process GRPO trains on), their sampling
log-probs when the endpoint gives them (vLLM), and in `group_overrides` the oldest policy
version among its replies and the env's name. A group with an
infra failure is dropped whole: `run-api` packs batches from equal-sized groups, and a short one
would be merged with another item's rollouts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

from flywheel.environments.hermes_base_env import HermesAgentBaseEnv
from flywheel.training.grpo import on_policy_tokenizer, policy_env
from flywheel.training.grpo_config import GRPORunConfig
from flywheel.training.policy_endpoint import RemotePolicy
from flywheel.training.rollouts import Outcome, PolicyServer, Task, mix_seed, retokenized, run_rollouts, sampled
from flywheel.training.trajectory_api import UNKNOWN_LOGPROB, logprobs_to_json

logger = logging.getLogger(__name__)

# Items of one env are numbered from the worker's offset (and its restart's): two workers of an env,
# or a worker and the one restarted in its place, never roll the same item.
ITEMS_PER_WORKER = 1_000_000
ITEMS_PER_RESTART = 10_000


def scored_group(env: HermesAgentBaseEnv, item: dict[str, Any], outcomes: list[Outcome], limit: int) -> dict[str, Any]:
    """Atroposlib's `ScoredDataGroup` of one item's rollouts, made of the sampled token ids."""
    eos = env.tokenizer.eos_token_id
    group: dict[str, Any] = {"tokens": [], "masks": [], "scores": [], "overrides": [], "messages": []}
    versions, logprobs = [], []
    for result, reward, trajectory in outcomes:
        exact = trajectory.covers(result)
        prompt, completion, mask, sampled_logprobs = (
            sampled(trajectory, limit) if exact else retokenized(Task(env, item), result, limit, {eos}, eos)
        )
        group["tokens"].append(prompt + completion)
        group["masks"].append([-100] * len(prompt) + [t if m else -100 for t, m in zip(completion, mask, strict=True)])
        known = [lp if m else math.nan for lp, m in zip(sampled_logprobs, mask, strict=True)]
        logprobs.append(logprobs_to_json([math.nan] * len(prompt) + known))
        group["scores"].append(float(reward or 0.0))
        group["overrides"].append({"task_completed": result.task_completed, "retokenized": not exact})
        group["messages"].append([{"role": m["role"], "content": str(m.get("content") or "")} for m in result.messages])
        versions += trajectory.versions
    if any(lp != UNKNOWN_LOGPROB for sequence in logprobs for lp in sequence):  # The endpoint gave some (vLLM).
        group["inference_logprobs"] = logprobs  # Atroposlib's layout: its filler where none is known.
    group["group_overrides"] = {
        "policy_version": min(versions) if versions else None,
        "env": env.name,
        "item_id": item.get("item_id"),
    }
    return group


def serve_with_policy(env: HermesAgentBaseEnv, policy: PolicyServer, limit: int) -> None:
    """Make `env`'s groups with `policy` (the trainer's endpoint) instead of its inference server."""

    async def collect_trajectories(item: dict[str, Any]) -> tuple[dict[str, Any] | None, list[Any]]:
        outcomes = await run_rollouts([Task(env, item)] * env.config.group_size, policy, env.config.agent_temperature)
        env._rollouts += len(outcomes)
        failed = sum(reward is None for _, reward, _ in outcomes)
        env._infra_failures += failed
        if failed:
            logger.warning(
                "%s: %s lost %d rollouts to infra failures: group dropped", env.name, item["item_id"], failed
            )
            return None, []
        return scored_group(env, item, outcomes, limit), []

    env.collect_trajectories = collect_trajectories  # type: ignore[method-assign]


def worker_env(
    cfg: GRPORunConfig, name: str, index: int, restart: int, api: str, model_dir: Path
) -> HermesAgentBaseEnv:
    """Env `name` configured as worker `index` (after `restart` restarts) of the run: atroposlib's serve
    settings from the run's. Its periodic evaluation is off (it would stop training to evaluate
    against the env's own server), and an item may take as long as a CPU rollout takes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    env = policy_env(
        cfg, name, model_dir, tokenizer,
        rollout_server_url=api,
        group_size=cfg.num_rollouts_per_task,
        max_batches_offpolicy=max(1, cfg.max_async_level),
        total_steps=10**9,  # The trainer decides when the run ends; the fleet stops its workers.
        ensure_scores_are_not_same=cfg.drop_flat_groups,
        use_wandb=False,
        wandb_name=f"{name}-{index}",
        agent_temperature=cfg.temperature,
        first_item=index * ITEMS_PER_WORKER + restart * ITEMS_PER_RESTART,
        steps_per_eval=0,
        max_num_workers=8,  # Items in flight (atroposlib derives it from its server list, which the policy replaces).
        worker_timeout=-1,  # Rollouts end on their own limits: turns, tokens, the sandbox's command limit.
    )  # fmt: skip
    on_policy_tokenizer(cfg, env, model_dir, tokenizer)
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="The run's GRPORunConfig as JSON.")
    parser.add_argument("--env", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--restart", type=int, default=0, help="How many times this worker was started before.")
    parser.add_argument("--api", required=True, help="run-api's URL.")
    parser.add_argument("--policy", required=True, help="The trainer's policy endpoint.")
    parser.add_argument("--model-dir", type=Path, required=True, help="The policy's tokenizer and chat template.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("atroposlib.envs.base").setLevel(logging.WARNING)  # Its status line, ten times a second.
    import torch

    cfg = GRPORunConfig.model_validate(json.loads(args.config.read_text()))
    torch.manual_seed(mix_seed(cfg.seed, args.index, args.restart))  # Each worker's sampling seeds are its own.
    env = worker_env(cfg, args.env, args.index, args.restart, args.api, args.model_dir)
    policy = PolicyServer(lambda: None, env.tokenizer, cfg.sampling_top_k(False), cfg.max_completion_length,
                          remote=RemotePolicy(args.policy))  # fmt: skip
    serve_with_policy(env, policy, cfg.max_completion_length)
    asyncio.run(env.env_manager())


if __name__ == "__main__":
    main()
