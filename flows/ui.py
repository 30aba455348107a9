"""What a round shows in the Prefect UI: run names, tables, markdown, links and progress bars.

Artifact keys are lowercase-dashed (Prefect's rule) and stable per stage and round, so the UI's
Artifacts page keeps one history per key across rounds.
"""

from __future__ import annotations

import json
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.runtime import flow_run

from flywheel.data import ArtifactStore, Manifest


def stage_run_name(stage: str) -> Any:
    """A `flow_run_name` callable: `sft-r2` from the stage's `round_no` parameter."""

    def name() -> str:
        params = flow_run.parameters.get("params")
        round_no = params.get("round_no") if isinstance(params, dict) else getattr(params, "round_no", None)
        return f"{stage}-r{round_no}" if round_no is not None else stage

    return name


def artifact_link(store: ArtifactStore, manifest: Manifest, key: str) -> None:
    """A link artifact to the manifest in the store (the checkpoint, dataset, ... behind a stage)."""
    create_link_artifact(
        key=key,
        link=store.manifest_url(manifest.id),
        link_text=f"{manifest.kind}/{manifest.name} {manifest.id[:12]}",
        description=f"{manifest.kind} `{manifest.id}` in `{store.url}`",
    )


def metrics_table(manifest: Manifest, key: str, description: str) -> None:
    """The manifest's figures as a two-column table artifact."""
    rows = [
        {"metric": name, "value": value if isinstance(value, int | float | str) else json.dumps(value)}
        for name, value in sorted(manifest.metrics.items())
    ]
    create_table_artifact(key=key, table=rows, description=description)


def markdown(text: str, key: str, description: str) -> None:
    create_markdown_artifact(key=key, markdown=text, description=description)


class EvalProgress:
    """`progress(env, done, total)` for the agentic eval: a run-log line every tenth and a progress bar per env."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.artifact_ids: dict[str, Any] = {}

    def __call__(self, env: str, done: int, total: int) -> None:
        if env not in self.artifact_ids:
            key = "eval-progress-" + "".join(c if c.isalnum() else "-" for c in env.lower())
            self.artifact_ids[env] = create_progress_artifact(0.0, key=key, description=f"{self.description}: {env}")
        update_progress_artifact(self.artifact_ids[env], 100.0 * done / max(total, 1))
        if done == total or done % max(1, total // 10) == 0:
            get_run_logger().info("agentic eval %s: %d/%d tasks done", env, done, total)
