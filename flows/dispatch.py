"""Running one stage: in-process or as a deployment on its work pool, behind a content-addressed cache.

The cache key is sha256(stage, parameters, code). Parameters name their inputs by artifact id, and
artifact ids are content hashes, so equal keys mean equal inputs: a re-run after a crash returns
the finished stages' artifact ids without running them. The cache records are persisted in the
artifact store itself (`<store>/prefect-results`), so they live and die with the artifacts they name.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any, Literal

from prefect import task
from prefect.context import TaskRunContext
from prefect.deployments import run_deployment
from prefect.filesystems import RemoteFileSystem

from flywheel.data import ArtifactStore
from flywheel.flows.stages import STAGES
from flywheel.flows.work import StageParams

Dispatch = Literal["local", "deployments"]
_PACKAGES = ("data", "environments", "evaluation", "flows", "inference", "training")


class StageFailed(RuntimeError):
    """A stage's deployment run ended in a state other than Completed."""


ROOT = Path(__file__).resolve().parent.parent


@cache
def code_digest(root: Path = ROOT) -> str:
    """sha256 of every source file of the flywheel packages: any code change invalidates the cache."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".json", ".yaml", ".jinja", ".jsonl"):
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def stage_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """sha256 of the stage name, its parameters (input artifact ids included) and the code."""
    params: StageParams = parameters["params"]
    payload = {"stage": parameters["stage"], "params": params.model_dump(mode="json"), "code": code_digest()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def result_storage(store: ArtifactStore) -> Path | str:
    """Where cached stage results go: the store's `prefect-results` folder.

    A local store gives a path; an S3 store a saved `RemoteFileSystem` block (Prefect only takes
    saved blocks), named after the store so two stores never share a cache.
    """
    if store.local:
        return Path(store.root, "prefect-results")
    url = store.sibling_url("prefect-results")
    name = f"flywheel-results-{hashlib.sha256(url.encode()).hexdigest()[:12]}"
    RemoteFileSystem(basepath=url).save(name, overwrite=True)
    return f"remote-file-system/{name}"


@task(
    name="stage",
    task_run_name="{stage}-r{params.round_no}",
    cache_key_fn=stage_cache_key,
    persist_result=True,
)
def run_stage(stage: str, params: StageParams, dispatch: Dispatch = "local") -> str:
    """Run `stage` and return the id of the artifact it made.

    Locally the stage's body runs inside this task run (`Flow.fn`: its logs, tables and progress bars
    attach to the task run `<stage>-r<round>`). A subflow per stage would add ~0.5 s of blocking API
    calls each (flow-run creation, state proposals, a client with its version check), and tags on the
    task run one more (Prefect acquires tag concurrency slots for a tagged task run, 0.5-2 s against
    a local SQLite server): both measured by `benchmarks/orchestration_overhead.py`. Deployed, the
    stage is its own flow run on its pool, tagged with its round and stage.
    """
    if dispatch == "local":
        return STAGES[stage].flow.fn(params)
    flow_run = run_deployment(
        STAGES[stage].deployment,
        parameters={"params": params.model_dump(mode="json")},
        tags=["flywheel", f"round-{params.round_no}", f"stage-{stage}"],
        timeout=None,  # Wait as long as the stage runs; its own deployment sets any time limit.
        poll_interval=1,  # Prefect's default (5 s) idles 2.5 s on average after every stage ends.
    )
    if flow_run.state is None or not flow_run.state.is_completed():
        state = flow_run.state.name if flow_run.state else "unknown"
        raise StageFailed(f"stage {stage} (flow run {flow_run.name}) ended {state}")
    return flow_run.state.result()
