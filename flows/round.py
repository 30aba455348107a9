"""The flywheel round as Prefect flows and tasks: thin wrappers around the library calls.

generate -> curate -> SFT -> RL -> evaluate -> gate -> mine -> report, with `dispatch="local"`
(every stage in-process). Tasks pass artifact ids, never data. Profiles: `quick` (the tiny
model, minutes) and `default` (SmolLM2-135M on CPU).
"""

from __future__ import annotations

import json
from typing import Literal

from prefect import flow, get_run_logger, task
from pydantic import BaseModel, Field

from data import ArtifactNotFound, ArtifactStore
from data.curation import curate_to_store
from environments.generate import generate_rollouts
from evaluation.agentic import AgenticEvalConfig, run_agentic_eval
from evaluation.gate import gate
from evaluation.report import build_report
from evaluation.weakness import mine_to_store
from inference import ModelServer, ServerConfig
from training.config import RunnerConfig
from training.grpo import run_grpo
from training.models import resolve_model
from training.sft import SFTRunConfig, run_sft


class RoundProfile(BaseModel):
    """Sizes of one round; `quick` and `default` are the shipped presets."""

    model: str = Field(default="smollm2", description="Base model when there is no champion yet.")
    env: str = Field(default="tool_use_chain", description="Environment of this round.")
    groups: int = Field(default=24, description="Teacher groups to generate.")
    sft_steps: int = Field(default=8, description="SFT steps.")
    sft_lr: float = Field(default=2e-4, description="SFT learning rate.")
    rl_steps: int = Field(default=2, description="GRPO steps.")
    eval_size: int = Field(default=8, description="Held-out agentic tasks.")
    max_tokens: int = Field(default=192, description="Tokens per model reply in evaluation.")
    difficulty: str | None = Field(default="easy", description="Task difficulty for this round.")


PROFILES = {
    "default": RoundProfile(),
    "quick": RoundProfile(model="tiny", groups=8, sft_steps=4, sft_lr=1e-3, rl_steps=1, eval_size=3, max_tokens=48),
}


@task(name="generate")
def generate(store_url: str | None, p: RoundProfile, tokenizer: str, task_mix: dict | None, round_no: int) -> str:
    """Teacher rollouts (the env oracle) for the round."""
    store = ArtifactStore(store_url)
    return generate_rollouts(
        store,
        p.env,
        groups=p.groups,
        group_size=2,
        tokenizer=tokenizer,
        teacher="oracle",
        task_mix=task_mix,
        seed=round_no,
        name=f"{p.env}-r{round_no}",
        difficulty=p.difficulty,
    ).id


@task(name="curate")
def curate(store_url: str | None, rollouts: str, round_no: int) -> str:
    """Rollouts -> SFT set and preference pairs."""
    sft, _ = curate_to_store(ArtifactStore(store_url), [rollouts], f"round{round_no}")
    return sft.id


@task(name="sft")
def sft(store_url: str | None, p: RoundProfile, base: str, dataset: str, round_no: int) -> str:
    cfg = SFTRunConfig(
        model=base,
        dataset=dataset,
        max_steps=p.sft_steps,
        learning_rate=p.sft_lr,
        batch_size=4,
        max_length=640,
        num_threads=2,
        output_name=f"sft-r{round_no}",
    )
    return run_sft(cfg, ArtifactStore(store_url)).id


@task(name="rl")
def rl(store_url: str | None, p: RoundProfile, policy: str, round_no: int) -> str:
    cfg = RunnerConfig(
        policy_model=policy,
        envs=[p.env],
        difficulty=p.difficulty,
        total_steps=p.rl_steps,
        batch_size=4,
        num_rollouts_per_task=2,
        max_completion_length=128,
        max_tool_calls=4,
        num_tasks=16,
        output_name=f"rl-r{round_no}",
        num_threads=2,
    )
    return run_grpo(cfg, ArtifactStore(store_url)).id


@task(name="evaluate")
def evaluate(store_url: str | None, p: RoundProfile, model: str, name: str) -> str:
    """Serve the model and run the agentic evaluation on held-out tasks."""
    store = ArtifactStore(store_url)
    model_dir = resolve_model(model, store)
    with ModelServer(ServerConfig(model=str(model_dir))) as server:
        cfg = AgenticEvalConfig(
            envs=[p.env],
            eval_size=p.eval_size,
            max_token_length=p.max_tokens,
            base_url=server.base_url,
            model_name=server.model_name or "",
            tokenizer=str(model_dir),
            max_agent_turns=6,
            name=name,
        )
        return run_agentic_eval(cfg, store, store.resolve(model)).id


@task(name="gate")
def promote(store_url: str | None, evals: list[str], candidate: str, round_no: int) -> str:
    return gate(ArtifactStore(store_url), evals, candidate, name=f"gate-r{round_no}").id


@task(name="mine")
def mine(store_url: str | None, evals: list[str], round_no: int) -> str:
    return mine_to_store(ArtifactStore(store_url), evals, name="weaknesses").id


@task(name="report")
def report(store_url: str | None, refs: list[str], round_no: int) -> str:
    return build_report(ArtifactStore(store_url), refs, f"round-{round_no}").id


@flow(name="flywheel")
def flywheel(rounds: int = 1, profile: Literal["quick", "default"] = "default", store_url: str | None = None) -> str:
    """Run `rounds` flywheel rounds; returns the last report's artifact id."""
    log = get_run_logger()
    p = PROFILES[profile]
    store = ArtifactStore(store_url)
    report_id = ""
    for round_no in range(1, rounds + 1):
        try:
            champion = store.resolve("champion")
        except ArtifactNotFound:
            champion = None
        base = champion or f"model/{p.model}"
        tokenizer = str(resolve_model(p.model if champion is None else champion, store))
        if champion is None:  # The starting model is judged first, so the gate has something to beat.
            base_eval = evaluate(store_url, p, base, "agentic-base")
            promote(store_url, [base_eval], base, 0)
        mix = _task_mix(store, p.env)
        rollouts = generate(store_url, p, tokenizer, mix, round_no)
        dataset = curate(store_url, rollouts, round_no)
        sft_ckpt = sft(store_url, p, base, dataset, round_no)
        rl_ckpt = rl(store_url, p, sft_ckpt, round_no)
        evals = [evaluate(store_url, p, rl_ckpt, f"agentic-r{round_no}")]
        decision = promote(store_url, evals, rl_ckpt, round_no)
        weaknesses = mine(store_url, evals, round_no)
        report_id = report(store_url, [*evals, weaknesses, decision], round_no)
        result = store.read_json(decision, "decision.json")
        log.info(
            "round %d: candidate %s (%s)", round_no, "promoted" if result["promote"] else "kept out", result["reason"]
        )
    return report_id


def _task_mix(store: ArtifactStore, env: str) -> dict | None:
    try:
        return json.loads(store.read_bytes("weaknesses/weaknesses", "task_mix.json")).get(env)
    except ArtifactNotFound:
        return None
