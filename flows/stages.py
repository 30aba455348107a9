"""One Prefect flow per flywheel stage, each deployable to its own work pool.

A stage flow is its library calls (`flows/work.py`) plus what the UI shows: tables, markdown,
links, progress. Stages take one Pydantic parameter (a form in the UI), pass artifact ids, never
data, and return the id of the artifact they made. GPU stages (`GPU_STAGES`) hold
`profile.gpus` slots of the global concurrency limit `gpu` while they run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.concurrency.sync import concurrency

from data import Manifest
from flows import work
from flows.profiles import RoundProfile
from flows.ui import EvalProgress, ProgressArtifact, artifact_link, markdown, metrics_table, stage_run_name
from flows.work import (
    CurateParams,
    EvaluateParams,
    GateParams,
    GenerateParams,
    MineParams,
    ReportParams,
    RLParams,
    SFTParams,
)

GPU_STAGES = frozenset({"sft", "rl", "evaluate"})
POOLS = {"gpu": "h100", "cpu": "cpu"}  # The work pools of prefect.yaml and `flywheel infra setup`.


def stage_pool(name: str) -> str:
    """The work pool a stage's deployment runs on."""
    return POOLS["gpu" if name in GPU_STAGES else "cpu"]


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
    """Rollouts in `process` mode by the profile's teacher, steered by the last round's task mix."""
    manifest = work.generate(params)
    metrics_table(manifest, "rollout-stats", f"Rollout statistics, round {params.round_no}")
    return manifest.id


@stage_flow("curate")
def curate(params: CurateParams) -> str:
    """Rollouts -> SFT set and preference pairs, with their data cards."""
    manifest = work.curate(params)
    metrics_table(manifest, "data-card", f"Data card of dataset/{manifest.name}")
    return manifest.id


@stage_flow("sft")
def sft(params: SFTParams) -> str:
    """Supervised fine-tuning (TRL SFTTrainer) on the curated set."""
    return _train("sft", params, work.sft)


@stage_flow("rl")
def rl(params: RLParams) -> str:
    """GRPO in the round's environment, KL to the SFT checkpoint."""
    return _train("rl", params, work.rl)


def _train(stage: str, params: SFTParams | RLParams, train: Callable[..., Manifest]) -> str:
    """A training stage on its GPU slots, its steps as a progress bar, a link to the checkpoint."""
    with gpu_slots(params.profile):
        progress = ProgressArtifact(f"{stage}-progress", f"{stage.upper()} steps, round {params.round_no}")
        manifest = train(params, callbacks=[progress])
    artifact_link(params.store(), manifest, f"{stage}-checkpoint")
    return manifest.id


@stage_flow("evaluate")
def evaluate(params: EvaluateParams) -> str:
    """Serve the model and run the agentic evaluation on the env's held-out tasks."""
    with gpu_slots(params.profile):
        manifest = work.evaluate(params, progress=EvalProgress(f"Agentic eval {params.name}, round {params.round_no}"))
    metrics_table(manifest, "eval-results", f"Agentic eval {params.name} of {params.model[:12]}")
    return manifest.id


@stage_flow("gate")
def promote(params: GateParams) -> str:
    """Promote the candidate to `champion` only when it wins (paired bootstrap + guards)."""
    manifest = work.promote(params)
    decision = params.store().read_json(manifest.id, "decision.json")
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
    manifest = work.mine(params)
    slices = params.store().read_json(manifest.id, "weaknesses.json")["slices"]
    columns = ("slice", "n", "success_rate", "success_ci95", "weak")
    table = [{c: row[c] for c in columns} for row in slices[:20]]
    create_table_artifact(key="weak-slices", table=table, description=f"Weakest slices, round {params.round_no}")
    return manifest.id


@stage_flow("report")
def report(params: ReportParams) -> str:
    """The round's HTML report; its markdown summary also goes to the UI."""
    manifest = work.report(params)
    store = params.store()
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
