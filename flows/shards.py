"""Generation and curation shards as Prefect tasks on a Dask cluster (prefect-dask): a local cluster
started for the stage, or a running scheduler, as the round's `data` section says. Each shard is a
task run in the stage's flow run (a `<stage>-shards` subflow in the UI); the store merges what they
stored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import flow, task
from prefect_dask import DaskTaskRunner

from flywheel.data.columnar import ShardMap
from flywheel.flows.round_config import DataSection


def shard_map(section: DataSection, stage: str) -> ShardMap | None:
    """The map a stage's shards run through (None: in the stage's own process)."""
    if section.runner == "process":
        return None

    def run_shards(run: Callable[[Any], str], shards: list[Any]) -> list[str]:
        if section.address:
            runner = DaskTaskRunner(address=section.address)
        else:
            cluster = {"n_workers": section.workers, "threads_per_worker": 1, "processes": True}
            runner = DaskTaskRunner(cluster_kwargs=cluster)
        shard = task(name=f"{stage}-shard")(_call)

        @flow(name=f"{stage}-shards", task_runner=runner)
        def shards_flow() -> list[str]:
            futures = [
                shard.with_options(task_run_name=f"{stage}-shard-{n}").submit(run, item)
                for n, item in enumerate(shards)
            ]
            return [future.result() for future in futures]

        return shards_flow()

    return run_shards


def _call(run: Callable[[Any], str], item: Any) -> str:
    return run(item)
