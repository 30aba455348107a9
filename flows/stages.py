"""One Prefect flow per flywheel stage, each deployable to its own work pool.

A stage flow is its library calls (`flows/work.py`) plus what the UI shows: tables, markdown,
links, progress. Stages take one Pydantic parameter (a form in the UI), pass artifact ids, never
data, and return the id of the artifact they made. GPU stages hold `config.gpus` slots of the
global concurrency limit `gpu` while they run.

`STAGES` is the one record of a stage - name, params, flow, pool - that the round, the cache
(task run `<name>-r<round>`), deployment `<name>/stage` and both deployment files (checked by a
test) derive from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency

from flywheel.data import Manifest
from flywheel.evaluation.weakness import stored_curriculum
from flywheel.flows import work
from flywheel.flows.heartbeats import end_heartbeats_without_waiting
from flywheel.flows.infra import GPU_LIMIT, limit_exists
from flywheel.flows.round_config import RoundConfig
from flywheel.flows.shards import shard_map
from flywheel.flows.ui import EvalProgress, artifact_link, markdown, metrics_table, stage_run_name
from flywheel.flows.work import (
    CurateParams,
    EvaluateParams,
    GateParams,
    GenerateParams,
    LMEvalParams,
    MineParams,
    ReportParams,
    RLParams,
    SFTParams,
    StageParams,
)

POOLS = {"gpu": "h100", "cpu": "cpu"}  # The work pools of prefect.yaml and `flywheel infra setup`.

end_heartbeats_without_waiting()  # Before any flow here or in a module importing this one runs.


def stage_flow(name: str) -> Callable[[Callable[..., str]], Any]:
    """The stage decorator: run name `<stage>-r<round>`, result persisted (`run_deployment` reads it)."""

    def decorate(fn: Callable[..., str]) -> Any:
        return flow(name=name, flow_run_name=stage_run_name(name), persist_result=True)(fn)

    return decorate


@contextlib.contextmanager
def gpu_slots(config: RoundConfig) -> Iterator[None]:
    """Hold `config.gpus` slots of the `gpu` limit (a no-op where no such limit is configured): the GPUs a
    stage's job holds on its node, even where it uses fewer (atropos-mode GRPO trains on one).

    Whether the limit exists is read first: asking Prefect's slot service for a limit that does not
    exist cost ~2 s a GPU stage in a local round (py-spy, `benchmarks/orchestration_overhead.py`),
    where one read takes milliseconds."""
    if config.gpus == 0:
        yield
        return
    with get_client(sync_client=True) as client:
        limited = limit_exists(client, GPU_LIMIT)
    if not limited:
        yield
        return
    with concurrency(GPU_LIMIT, occupy=config.gpus, strict=False):
        yield


@stage_flow("generate")
def generate(params: GenerateParams) -> str:
    """Rollouts in `process` mode as the curriculum plans: the teacher on unsolved slices, the policy on learnable."""
    manifest = work.generate(params, shard_map(params.config.data, "generate"))
    metrics_table(manifest, "rollout-stats", f"Rollout statistics, round {params.round_no}")
    return manifest.id


@stage_flow("curate")
def curate(params: CurateParams) -> str:
    """Rollouts -> SFT set and preference pairs, with their data cards."""
    manifest = work.curate(params, shard_map(params.config.data, "curate"))
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
    from flywheel.flows.training_progress import ProgressArtifact  # transformers: the training stages' own.

    with gpu_slots(params.config):
        progress = ProgressArtifact(f"{stage}-progress", f"{stage.upper()} steps, round {params.round_no}")
        manifest = train(params, callbacks=[progress])
    artifact_link(params.store(), manifest, f"{stage}-checkpoint")
    return manifest.id


@stage_flow("evaluate")
def evaluate(params: EvaluateParams) -> str:
    """Serve the model and run the agentic evaluation on the env's held-out tasks."""
    with gpu_slots(params.config):
        manifest = work.evaluate(params, progress=EvalProgress(f"Agentic eval {params.name}, round {params.round_no}"))
    metrics_table(manifest, "eval-results", f"Agentic eval {params.name} of {params.model[:12]}")
    return manifest.id


@stage_flow("lm_eval")
def lm_eval(params: LMEvalParams) -> str:
    """lm-evaluation-harness on the model: the round's tasks (the shipped suite by default)."""
    with gpu_slots(params.config):
        manifest = work.lm_eval(params)
    metrics_table(manifest, "lm-eval-results", f"lm-eval {params.name} of {params.model[:12]}")
    return manifest.id


@stage_flow("gate")
def gate(params: GateParams) -> str:
    """Promote the candidate to `champion` only when it wins (paired bootstrap + guards)."""
    manifest = work.gate(params)
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
    """Failure slices with confidence intervals -> the next round's curriculum (both shown in the UI)."""
    manifest = work.mine(params)
    store = params.store()
    slices = store.read_json(manifest.id, "weaknesses.json")["slices"]
    columns = ("slice", "n", "success_rate", "success_ci95", "weak")
    table = [{c: row[c] for c in columns} for row in slices[:20]]
    create_table_artifact(key="weak-slices", table=table, description=f"Weakest slices, round {params.round_no}")
    curriculum = stored_curriculum(store, manifest.id)
    if curriculum is not None:
        rows = [{"env": env} | row for env, spec in curriculum["slices"].items() for row in spec["slices"]]
        create_table_artifact(
            key="curriculum", table=rows, description=f"Curriculum for round {params.round_no + 1}: class per slice"
        )
    return manifest.id


@stage_flow("report")
def report(params: ReportParams) -> str:
    """The round's HTML report; its markdown summary also goes to the UI."""
    manifest = work.report(params)
    store = params.store()
    markdown(store.read_bytes(manifest.id, "summary.md").decode(), "round-summary", f"Round {params.round_no}")
    artifact_link(store, manifest, "round-report")
    return manifest.id


@dataclass(frozen=True)
class Stage:
    """One stage: its name, its parameters, its flow and whether it runs on the GPU pool."""

    name: str
    params: type[StageParams]
    flow: Any
    work: Callable[..., Manifest]  # The library calls alone: the plain-script baseline of the overhead benchmark.
    gpu: bool = False

    @property
    def pool(self) -> str:
        """The work pool its deployment runs on."""
        return POOLS["gpu" if self.gpu else "cpu"]

    @property
    def deployment(self) -> str:
        """Its deployment's name, as `run_deployment` takes it."""
        return f"{self.flow.name}/stage"


STAGES: dict[str, Stage] = {
    stage.name: stage
    for stage in (
        Stage("generate", GenerateParams, generate, work.generate, gpu=True),  # Serves the policy for the curriculum.
        Stage("curate", CurateParams, curate, work.curate),
        Stage("sft", SFTParams, sft, work.sft, gpu=True),
        Stage("rl", RLParams, rl, work.rl, gpu=True),
        Stage("evaluate", EvaluateParams, evaluate, work.evaluate, gpu=True),
        Stage("lm_eval", LMEvalParams, lm_eval, work.lm_eval, gpu=True),
        Stage("gate", GateParams, gate, work.gate),
        Stage("mine", MineParams, mine, work.mine),
        Stage("report", ReportParams, report, work.report),
    )
}
