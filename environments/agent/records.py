"""What rollouts leave behind: a group's `meta` record, evaluation samples and their metrics."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from flywheel.environments.agent_loop import AgentResult, sanitize

Item = dict[str, Any]


def group_meta(item: Item, outcomes: list[tuple[AgentResult, float | None]]) -> dict[str, Any]:
    """Who the group is about, for curation and weakness mining."""
    return {
        "item_id": item.get("item_id"),
        "index": item.get("index"),  # Its place in the task stream: the order groups are stored in.
        "content_digest": content_digest(item),
        "env": item.get("env"),
        "category": item.get("category"),
        "difficulty": item.get("difficulty"),
        "infra_failures": sum(1 for _, reward in outcomes if reward is None),
        "turns_used": [r.turns_used for r, reward in outcomes if reward is not None],
        "tool_errors": [len(r.tool_errors) for r, reward in outcomes if reward is not None],
    }


def task_digest(item: Item) -> str:
    """sha256 (12 hex) of the task as generated (prompt template, files, answer, oracle): two evals
    pair an item only when it is the same task, not merely the same id of a changed task family."""
    return _sha12(item)


def content_digest(item: Item) -> str:
    """`task_digest` without where the task was drawn from (id, seed, index): a training item and a
    held-out item with equal digests are the same task (decontamination)."""
    return _sha12({k: v for k, v in item.items() if k not in ("item_id", "seed", "index")})


def _sha12(item: Item) -> str:
    return hashlib.sha256(json.dumps(item, sort_keys=True, default=str).encode()).hexdigest()[:12]


def eval_sample(item: Item, result: AgentResult, reward: float | None) -> dict[str, Any]:
    """One line of samples.jsonl, `sanitize`d so that it encodes as UTF-8."""
    return sanitize(
        {
            "item_id": item.get("item_id"),
            "task_digest": task_digest(item),
            "env": item.get("env"),
            "category": item.get("category"),
            "difficulty": item.get("difficulty"),
            "reward": reward,
            "success": reward is not None
            and (reward >= 0.999 if result.task_completed is None else result.task_completed),
            "task_completed": result.task_completed,
            "infra_error": result.infra_error,
            "turns_used": result.turns_used,
            "finished_naturally": result.finished_naturally,
            "stuck": result.stuck,
            "context_full": result.context_full,
            "tool_errors": [e.__dict__ for e in result.tool_errors],
            "messages": result.messages,
        }
    )


def eval_metrics(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Rates over the scored samples; infra failures are counted apart, never scored 0."""
    scored = [s for s in samples if s["reward"] is not None]
    n = len(scored) or 1
    metrics = {
        "eval/mean_reward": sum(s["reward"] for s in scored) / n,
        "eval/success_rate": sum(s["success"] for s in scored) / n,
        "eval/mean_turns": sum(s["turns_used"] for s in scored) / n,
        "eval/tool_errors_per_rollout": sum(len(s["tool_errors"]) for s in scored) / n,
        "eval/stuck_rate": sum(bool(s.get("stuck")) for s in scored) / n,
        "eval/context_full_rate": sum(bool(s.get("context_full")) for s in scored) / n,
        "eval/infra_failures": float(len(samples) - len(scored)),
        "eval/infra_failure_rate": (len(samples) - len(scored)) / (len(samples) or 1),
        "eval/n": float(len(samples)),
    }
    for key in sorted({s["category"] for s in scored if s["category"]}):
        part = [s for s in scored if s["category"] == key]
        metrics[f"eval/success_rate/{key}"] = sum(s["success"] for s in part) / len(part)
    return metrics
