"""Agentic evaluation: every environment's `evaluate` (full agent loop, temperature 0) on its fixed
held-out tasks against a served model; success per env / category / difficulty, turns, tool errors.

Infra failures (a task the server never answered) are left out of success rates and reported per
env; an env with more than `max_infra_failure_rate` of them fails the run (`InfraFailureRateError`),
because a success rate over the tasks that happened to get through is not the model's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from flywheel.data import ArtifactStore, Manifest
from flywheel.environments.agent.records import content_digest
from flywheel.environments.registry import TASK_FAMILIES, categories_of, env_class, env_name
from flywheel.environments.sandbox.box import isolation_report

logger = logging.getLogger(__name__)


class AgenticEvalConfig(BaseModel):
    """Which envs, how many held-out tasks, which endpoint."""

    envs: list[str] = Field(default=list(TASK_FAMILIES), description="Environments to evaluate.")
    eval_size: int = Field(default=8, ge=1, description="Held-out tasks per env (the env's eval seed).")
    difficulty: str | None = Field(default=None, description="Only held-out tasks of this difficulty.")
    categories: list[str] | None = Field(
        default=None, description="Only held-out tasks of these categories, in each env that has them."
    )
    max_agent_turns: int | None = Field(default=None, ge=1, description="Override the envs' turn limits.")
    max_token_length: int = Field(default=256, ge=8, description="Tokens per model reply.")
    base_url: str = Field(description="OpenAI-compatible endpoint serving the model.")
    model_name: str = Field(description="Model name the endpoint expects.")
    api_key_env: str | None = Field(default=None, description="Environment variable holding the API key.")
    tokenizer: str = Field(description="Local tokenizer dir (for the envs).")
    teacher: str = Field(default="server", description="`oracle` evaluates the oracle instead (a ceiling).")
    name: str = Field(default="agentic", description="Name of the eval artifact.")
    concurrency: int = Field(
        default=16,
        ge=1,
        description="Rollouts in flight at once over all envs (split evenly; the server batches them).",
    )
    max_infra_failure_rate: float = Field(
        default=0.05, ge=0, le=1, description="Share of an env's tasks that may be infra failures before the run fails."
    )


class InfraFailureRateError(RuntimeError):
    """Too many of an env's tasks failed for infrastructure reasons for its success rate to mean anything."""


Progress = Callable[[str, int, int], None]


def held_out_items(env_name: str, eval_size: int, tokenizer: str, **task_slice: Any) -> list[dict[str, Any]]:
    """The env's fixed held-out tasks (its eval seed, in the slice `difficulty`/`categories`), as
    stored for lineage and decontamination."""
    env = _env(env_name, tokenizer_name=tokenizer, eval_size=eval_size, **task_slice)
    asyncio.run(env.setup())
    try:
        return [
            {
                "item_id": i["item_id"],
                "content_digest": content_digest(i),
                "prompt": env.format_prompt(i),
                "category": i["category"],
                "difficulty": i["difficulty"],
            }
            for i in env.eval_items
        ]
    finally:
        asyncio.run(env.teardown())


def store_agentic_evalset(store: ArtifactStore, cfg: AgenticEvalConfig) -> Manifest:
    files = {
        f"{env_name(name)}.jsonl": "".join(
            json.dumps(i) + "\n" for i in held_out_items(name, cfg.eval_size, cfg.tokenizer, **_slice(cfg, name))
        )
        for name in cfg.envs
    }
    params = {"envs": cfg.envs, "eval_size": cfg.eval_size, "difficulty": cfg.difficulty, "categories": cfg.categories}
    return store.put("evalset", "agentic", files, params=params)  # The same items: the same id (content-addressed).


def run_agentic_eval(
    cfg: AgenticEvalConfig, store: ArtifactStore, model_ref: str | None = None, progress: Progress | None = None
) -> Manifest:
    """Evaluate every env, aggregate, and store an `eval` artifact (results.json + samples per env).

    Each finished task is logged as `<env>: done/total` and passed to `progress(env, done, total)`
    (the Prefect stage shows it). The envs run at once, `cfg.concurrency` rollouts in flight in
    all. Raises `InfraFailureRateError`, storing nothing, when an env's infra-failure share passes
    `cfg.max_infra_failure_rate`.
    """
    started = time.perf_counter()
    evalset = store_agentic_evalset(store, cfg)
    with contextlib.ExitStack() as stack:
        outs = {name: stack.enter_context(tempfile.TemporaryDirectory()) for name in cfg.envs}
        envs = {name: _env(name, **_env_config(cfg, name, outs[name])) for name in cfg.envs}
        per_env = asyncio.run(_evaluate_all(envs, progress))
        by_env = {name: Path(out, "samples.jsonl").read_text(encoding="utf-8") for name, out in outs.items()}
    files: dict[str, str] = {}
    all_samples: list[dict[str, Any]] = []
    for name, text in by_env.items():  # UTF-8 whatever the locale.
        samples = [json.loads(line) for line in text.splitlines()]
        _check_infra_failures(name, samples, cfg.max_infra_failure_rate)
        files[f"samples/{env_name(name)}.jsonl"] = "".join(json.dumps(s) + "\n" for s in samples)
        all_samples.extend(samples)
    results = {"per_env": per_env, **aggregate(all_samples), "sandbox": isolation_report()}
    files["results.json"] = json.dumps(results, indent=2)
    metrics = {"success_rate": results["overall"]["success_rate"], "n": results["overall"]["n"]}
    metrics |= {f"{env_name(env)}/success_rate": m["eval/success_rate"] for env, m in per_env.items()}
    metrics |= {f"{env_name(env)}/infra_failures": m["eval/infra_failures"] for env, m in per_env.items()}
    metrics["sandbox_isolated"] = float(bool(results["sandbox"]["isolated"]))
    metrics["wall_seconds"] = round(time.perf_counter() - started, 1)
    parents = [evalset.id] + ([model_ref] if model_ref else [])
    manifest = store.put("eval", cfg.name, files, parents=parents, params=cfg.model_dump(), metrics=metrics)
    logger.info("agentic eval %s: success %.2f over %d tasks", cfg.name, metrics["success_rate"], metrics["n"])
    return manifest


def _env_config(cfg: AgenticEvalConfig, name: str, out: str) -> dict[str, Any]:
    """One env's evaluation settings: the round's slice, reply and turn caps, its share of the concurrency."""
    from flywheel.environments.agent.servers import server_configs  # atroposlib: only where envs run.

    config: dict[str, Any] = {
        "server_configs": server_configs(cfg.base_url, cfg.model_name, cfg.api_key_env),
        "tokenizer_name": cfg.tokenizer,
        "eval_size": cfg.eval_size,
        "eval_concurrency": max(1, cfg.concurrency // len(cfg.envs)),
        "data_dir_to_save_evals": out,
        "max_token_length": cfg.max_token_length,
        "teacher": cfg.teacher,
        **_slice(cfg, name),
    }
    if cfg.max_agent_turns:
        config["max_agent_turns"] = cfg.max_agent_turns
    return config


async def _evaluate_all(envs: dict[str, Any], progress: Progress | None) -> dict[str, dict[str, float]]:
    """Every env's evaluation at once: the server batches rollouts of all of them, with no env's
    last few tasks running alone while the others wait."""
    results = await asyncio.gather(*(_evaluate(env, _reporter(name, progress)) for name, env in envs.items()))
    return dict(zip(envs, results, strict=True))


async def _evaluate(env: Any, progress: Callable[[int, int], None]) -> dict[str, float]:
    await env.setup()
    try:
        return await env.run_agentic_eval(env.eval_items, progress=progress)
    finally:
        await env.close()


def _reporter(env_name: str, progress: Progress | None) -> Callable[[int, int], None]:
    """Log each finished task of `env_name` (the command line's progress) and pass it to `progress`."""

    def report(done: int, total: int) -> None:
        logger.info("agentic eval %s: %d/%d tasks done", env_name, done, total)
        if progress is not None:
            progress(env_name, done, total)

    return report


def _check_infra_failures(env_name: str, samples: list[dict[str, Any]], threshold: float) -> None:
    """Fail loudly when more than `threshold` of an env's tasks are infra failures (reward None)."""
    failed = [s for s in samples if s.get("reward") is None]
    if samples and len(failed) / len(samples) > threshold:
        example = next((s.get("infra_error") for s in failed if s.get("infra_error")), "no error recorded")
        raise InfraFailureRateError(
            f"agentic eval of env '{env_name}': {len(failed)} of {len(samples)} tasks were infra failures "
            f"({len(failed) / len(samples):.0%}), above max_infra_failure_rate={threshold:.0%}; no success rate "
            f"is reported. Check the inference server; first error: {str(example)[:300]}"
        )


def aggregate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Success rate, turns and tool errors overall and per env / category / difficulty."""

    def summary(group: list[dict[str, Any]]) -> dict[str, float]:
        scored = [s for s in group if s.get("reward") is not None]
        n = len(scored) or 1
        return {
            "n": len(scored),
            "success_rate": sum(bool(s["success"]) for s in scored) / n,
            "mean_reward": sum(s["reward"] for s in scored) / n,
            "mean_turns": sum(s.get("turns_used", 0) for s in scored) / n,
            "tool_errors_per_task": sum(len(s.get("tool_errors") or []) for s in scored) / n,
            "infra_failures": len(group) - len(scored),
        }

    slices: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sample in samples:
        slices[f"{sample['env']}/{sample['category']}/{sample['difficulty']}"].append(sample)
    return {"overall": summary(samples), "per_slice": {k: summary(v) for k, v in sorted(slices.items())}}


def _slice(cfg: AgenticEvalConfig, env_name: str) -> dict[str, Any]:
    """The held-out slice of one env: the difficulty, and those of the categories the env has."""
    return {"difficulty": cfg.difficulty, "categories": categories_of(env_class(env_name), cfg.categories)}


def _env(name: str, **config: Any) -> Any:
    return env_class(name)(**config)
