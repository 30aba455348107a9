"""Orchestration overhead: a flywheel round through the Prefect flows vs the same library calls in a
plain script, side by side in one process, against a real local Prefect server.

Run: .venv/bin/python benchmarks/orchestration_overhead.py [--profile quick] [--repeats 1]

"plain" calls `flywheel.flows.work` stage by stage (exactly what each stage flow runs, without Prefect);
"flows" runs the `flywheel` flow (local dispatch: a cached task run per stage, cache records, UI
artifacts, run logs, API calls). Both start from an empty store. Printed: each stage's seconds both
ways (a flow stage's from its task run in the API), then
- overhead = flows / plain - 1 (aim < 3 %);
- no-change re-run = the same round again through the flows / the first flows run (aim < 2 %).
Plain and flows alternate when --repeats > 1, and the medians are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from flywheel.flows.local_server import local_server
from flywheel.flows.round_config import RoundConfig, profile, profile_names


def plain_round(store_url: str, p: RoundConfig, seconds: dict[str, float] | None = None) -> str:
    """Round 1 (and round 0 before it) through `run_round`, each stage its library calls, no orchestration;
    `seconds` gets each stage's wall time (`<stage>-r<round>`)."""
    from flywheel.data import ArtifactStore
    from flywheel.flows.flywheel import plain_stage, run_round

    store = ArtifactStore(store_url)
    stage = plain_stage(store, p)

    def timed_stage(name: str, /, **fields: Any) -> str:
        started = time.perf_counter()
        try:
            return stage(name, **fields)
        finally:
            if seconds is not None:
                seconds[f"{name}-r{fields['round_no']}"] = time.perf_counter() - started

    return run_round(store, 1, p, timed_stage)[0]


def flows_round(profile: str, store_url: str, **options: Any) -> tuple[float, dict[str, float]]:
    """The `flywheel` flow's wall time, and each stage task run's (`<stage>-r<round>`, from the Prefect API)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flywheel.flows.flywheel import flywheel  # Prefect reads its settings on import: after the server is up.

    started = time.perf_counter()
    state = flywheel(profile=profile, store_url=store_url, return_state=True, **options)
    seconds = time.perf_counter() - started
    parent = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))

    async def read() -> dict[str, float]:
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=parent)
        return {run.name: (run.end_time - run.start_time).total_seconds() for run in runs if run.end_time}

    return seconds, asyncio.run(read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="quick", choices=profile_names())
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    p = profile(args.profile)
    with tempfile.TemporaryDirectory() as tmp, local_server(Path(tmp, "prefect")) as env:
        os.environ.update({k: v for k, v in env.items() if k.startswith("PREFECT_")})
        os.environ.setdefault("FLYWHEEL_CACHE", str(Path(tmp, "cache")))
        plain_round(str(Path(tmp, "warmup")), p)  # Imports, kernels and the model cache, for both sides.
        plain, flows, rerun = [], [], []
        plain_stages: dict[str, float] = {}
        flow_stages: dict[str, float] = {}
        for i in range(args.repeats):
            started = time.perf_counter()
            plain_round(str(Path(tmp, f"plain-{i}")), p, plain_stages)
            plain.append(time.perf_counter() - started)
            store = str(Path(tmp, f"flows-{i}"))
            seconds, flow_stages = flows_round(args.profile, store)
            flows.append(seconds)
            rerun.append(flows_round(args.profile, store, first_round=1)[0])
    plain_s, flows_s, rerun_s = (statistics.median(x) for x in (plain, flows, rerun))
    for i, (a, b) in enumerate(zip(plain, flows, strict=True)):  # The spread between repeats is the noise floor.
        print(f"repeat {i + 1}: plain {a:.1f}s, flows {b:.1f}s ({b / a - 1:+.1%})")
    print(f"{'stage (last repeat)':16s} {'plain s':>8s} {'flow s':>8s}")
    for name, seconds in plain_stages.items():
        print(f"{name:16s} {seconds:8.1f} {flow_stages.get(name, float('nan')):8.1f}")
    between = flows[-1] - sum(flow_stages.values())
    print(f"{'(between stages)':16s} {plain[-1] - sum(plain_stages.values()):8.1f} {between:8.1f}")
    print(f"profile {args.profile}, {args.repeats} repeat(s); medians: plain {plain_s:.1f}s, flows {flows_s:.1f}s")
    print(f"orchestration overhead: {flows_s / plain_s - 1:+.1%}  (goal < 3%)")
    print(f"no-change re-run: {rerun_s:.2f}s = {rerun_s / flows_s:.1%} of the first run  (goal < 2%)")


if __name__ == "__main__":
    main()
