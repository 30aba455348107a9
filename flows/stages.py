"""One Prefect flow per flywheel stage, each deployable to its own work pool.

Stages take one Pydantic parameter (a form in the UI), pass artifact ids, never data, and return
the id of the artifact they made. GPU stages (`GPU_STAGES`) hold `profile.gpus` slots of the
global concurrency limit `gpu` while they run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.concurrency.sync import concurrency
from pydantic import BaseModel, Field

from data import ArtifactStore
from data.curation import curate_to_store
from environments.generate import generate_rollouts
from evaluation.agentic import AgenticEvalConfig, run_agentic_eval
from evaluation.gate import gate
from evaluation.lm_eval_runner import model_ref_of
from evaluation.report import build_report
from evaluation.weakness import mine_to_store
from flows.profiles import RoundProfile
from flows.ui import ProgressArtifact, artifact_link, markdown, metrics_table, stage_run_name
from inference import ModelServer, ServerConfig
from training.config import RunnerConfig
from training.grpo import run_grpo
from training.models import resolve_model
from training.sft import SFTRunConfig, run_sft

GPU_STAGES = frozenset({"sft", "rl", "evaluate"})


class StageParams(BaseModel):
    """What every stage gets: where the store is, which round, how big."""

    store_url: str | None = Field(default=None, description="Artifact store (default: $FLYWHEEL_STORE or ./.flywheel).")
    round_no: int = Field(default=1, ge=0, description="Round number (run names, artifact names).")
    profile: RoundProfile = Field(default_factory=RoundProfile, description="Sizes of the round.")

    def store(self) -> ArtifactStore:
        return ArtifactStore(self.store_url)


class GenerateParams(StageParams):
    tokenizer_model: str = Field(description="Model ref whose tokenizer scores the rollouts.")
    task_mix: dict[str, float] | None = Field(default=None, description="Category weights from the last mining.")


class CurateParams(StageParams):
    rollouts: str = Field(description="Rollouts artifact id.")


class SFTParams(StageParams):
    base: str = Field(description="Model artifact id to fine-tune.")
    dataset: str = Field(description="SFT dataset artifact id.")


class RLParams(StageParams):
    policy: str = Field(description="Checkpoint artifact id to start GRPO from.")


class EvaluateParams(StageParams):
    model: str = Field(description="Model or checkpoint ref to evaluate.")
    name: str = Field(description="Name of the eval artifact.")


class GateParams(StageParams):
    evals: list[str] = Field(description="Eval artifact ids of the candidate.")
    candidate: str = Field(description="Candidate model artifact id.")


class MineParams(StageParams):
    evals: list[str] = Field(description="Eval artifact ids to mine.")


class ReportParams(StageParams):
    refs: list[str] = Field(description="Eval, weaknesses and gate artifact ids.")


def stage_flow(name: str) -> Callable[[Callable[..., str]], Any]:
    """The stage decorator: run name `<stage>-r<round>`, result persisted (`run_deployment` reads it)."""
    return flow(name=name, flow_run_name=stage_run_name(name), persist_result=True)


@contextlib.contextmanager
def gpu_slots(profile: RoundProfile) -> Iterator[None]:
    """Hold `profile.gpus` slots of the `gpu` limit (a no-op where no such limit is configured)."""
    if profile.gpus == 0:
        yield
        return
    with concurrency("gpu", occupy=profile.gpus, strict=False):
        yield


@stage_flow("generate")
def generate(params: GenerateParams) -> str:
    """Teacher rollouts (the env oracle) in `process` mode, steered by the last round's task mix."""
    p, store = params.profile, params.store()
    manifest = generate_rollouts(
        store,
        p.env,
        groups=p.groups,
        group_size=2,
        tokenizer=str(resolve_model(params.tokenizer_model, store)),
        teacher="oracle",
        task_mix=params.task_mix,
        seed=params.round_no,
        name=f"{p.env}-r{params.round_no}",
        difficulty=p.difficulty,
    )
    metrics_table(manifest, "rollout-stats", f"Rollout statistics, round {params.round_no}")
    return manifest.id


@stage_flow("curate")
def curate(params: CurateParams) -> str:
    """Rollouts -> SFT set and preference pairs, with their data cards."""
    sft_set, _ = curate_to_store(params.store(), [params.rollouts], f"round{params.round_no}")
    metrics_table(sft_set, "data-card", f"Data card of dataset/{sft_set.name}")
    return sft_set.id


@stage_flow("sft")
def sft(params: SFTParams) -> str:
    """Supervised fine-tuning (TRL SFTTrainer) on the curated set."""
    p, store = params.profile, params.store()
    cfg = SFTRunConfig(
        model=params.base,
        dataset=params.dataset,
        max_steps=p.sft_steps,
        learning_rate=p.sft_lr,
        batch_size=4,
        max_length=640,
        num_threads=2,
        output_name=f"sft-r{params.round_no}",
    )
    with gpu_slots(p):
        progress = ProgressArtifact("sft-progress", f"SFT steps, round {params.round_no}")
        manifest = run_sft(cfg, store, callbacks=[progress])
    artifact_link(store, manifest, "sft-checkpoint")
    return manifest.id


@stage_flow("rl")
def rl(params: RLParams) -> str:
    """GRPO in the round's environment, KL to the SFT checkpoint."""
    p, store = params.profile, params.store()
    cfg = RunnerConfig(
        policy_model=params.policy,
        envs=[p.env],
        difficulty=p.difficulty,
        total_steps=p.rl_steps,
        batch_size=4,
        num_rollouts_per_task=2,
        max_completion_length=128,
        max_tool_calls=4,
        num_tasks=16,
        output_name=f"rl-r{params.round_no}",
        num_threads=2,
    )
    with gpu_slots(p):
        progress = ProgressArtifact("rl-progress", f"GRPO steps, round {params.round_no}")
        manifest = run_grpo(cfg, store, callbacks=[progress])
    artifact_link(store, manifest, "rl-checkpoint")
    return manifest.id


@stage_flow("evaluate")
def evaluate(params: EvaluateParams) -> str:
    """Serve the model and run the agentic evaluation on the env's held-out tasks."""
    p, store = params.profile, params.store()
    model_dir = resolve_model(params.model, store)
    with gpu_slots(p), ModelServer(ServerConfig(model=str(model_dir))) as server:
        cfg = AgenticEvalConfig(
            envs=[p.env],
            eval_size=p.eval_size,
            max_token_length=p.max_tokens,
            base_url=server.base_url,
            model_name=server.model_name or "",
            tokenizer=str(model_dir),
            max_agent_turns=6,
            name=params.name,
        )
        manifest = run_agentic_eval(cfg, store, model_ref_of(store, params.model))
    metrics_table(manifest, "eval-results", f"Agentic eval {params.name} of {params.model[:12]}")
    return manifest.id


@stage_flow("gate")
def promote(params: GateParams) -> str:
    """Promote the candidate to `champion` only when it wins (paired bootstrap + guards)."""
    store = params.store()
    manifest = gate(store, params.evals, params.candidate, name=f"gate-r{params.round_no}")
    decision = store.read_json(manifest.id, "decision.json")
    verdict = "**promoted**" if decision["promote"] else "**kept out**"
    markdown(
        f"# Gate, round {params.round_no}\n\nCandidate `{params.candidate[:12]}`: {verdict}.\n\n{decision['reason']}",
        "gate-decision",
        f"Promotion decision, round {params.round_no}",
    )
    get_run_logger().info("candidate %s: %s (%s)", params.candidate[:12], verdict.strip("*"), decision["reason"])
    return manifest.id


@stage_flow("mine")
def mine(params: MineParams) -> str:
    """Failure slices with confidence intervals -> next round's task mix."""
    store = params.store()
    manifest = mine_to_store(store, params.evals, name="weaknesses")
    slices = store.read_json(manifest.id, "weaknesses.json")["slices"]
    columns = ("slice", "n", "success_rate", "success_ci95", "weak")
    table = [{c: row[c] for c in columns} for row in slices[:20]]
    create_table_artifact(key="weak-slices", table=table, description=f"Weakest slices, round {params.round_no}")
    return manifest.id


@stage_flow("report")
def report(params: ReportParams) -> str:
    """The round's HTML report; its markdown summary also goes to the UI."""
    store = params.store()
    manifest = build_report(store, params.refs, f"round-{params.round_no}")
    markdown(store.read_bytes(manifest.id, "summary.md").decode(), "round-summary", f"Round {params.round_no}")
    artifact_link(store, manifest, "round-report")
    return manifest.id


STAGES: dict[str, Callable[..., str]] = {
    "generate": generate,
    "curate": curate,
    "sft": sft,
    "rl": rl,
    "evaluate": evaluate,
    "gate": promote,
    "mine": mine,
    "report": report,
}
