"""Orchestration overhead: a flywheel round through the Prefect flows vs the same library calls in a
plain script, side by side in one process, against a real local Prefect server.

Run: .venv/bin/python benchmarks/orchestration_overhead.py [--profile quick] [--repeats 1]

"plain" calls `flows.work` stage by stage (exactly what each stage flow runs, without Prefect);
"flows" runs the `flywheel` flow (local dispatch: task + subflow per stage, cache records, UI
artifacts, API calls). Both start from an empty store. Printed:
- overhead = flows / plain - 1 (aim < 3 %);
- no-change re-run = the same round again through the flows / the first flows run (aim < 2 %).
Plain and flows alternate when --repeats > 1, and the medians are compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from flows.local_server import local_server
from flows.profiles import PROFILES, RoundProfile


def plain_round(store_url: str, p: RoundProfile) -> str:
    """Round 1 (and round 0 before it) through `run_round`, each stage its library calls, no orchestration."""
    from data import ArtifactStore
    from flows.flywheel import plain_stage, run_round

    store = ArtifactStore(store_url)
    return run_round(store, 1, p, plain_stage(store, p))[0]


def timed(fn, *args, **kwargs) -> float:
    started = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="quick", choices=sorted(PROFILES))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    p = PROFILES[args.profile]
    with tempfile.TemporaryDirectory() as tmp, local_server(Path(tmp, "prefect")) as env:
        os.environ.update({k: v for k, v in env.items() if k.startswith("PREFECT_")})
        os.environ.setdefault("FLYWHEEL_CACHE", str(Path(tmp, "cache")))
        from flows.flywheel import flywheel  # Prefect reads its settings on import: after the server is up.

        plain_round(str(Path(tmp, "warmup")), p)  # Imports, kernels and the model cache, for both sides.
        plain, flows, rerun = [], [], []
        for i in range(args.repeats):
            plain.append(timed(plain_round, str(Path(tmp, f"plain-{i}")), p))
            store = str(Path(tmp, f"flows-{i}"))
            flows.append(timed(flywheel, profile=args.profile, store_url=store))
            rerun.append(timed(flywheel, profile=args.profile, store_url=store, first_round=1))
    plain_s, flows_s, rerun_s = (statistics.median(x) for x in (plain, flows, rerun))
    print(f"profile {args.profile}, {args.repeats} repeat(s); medians: plain {plain_s:.1f}s, flows {flows_s:.1f}s")
    print(f"orchestration overhead: {flows_s / plain_s - 1:+.1%}  (goal < 3%)")
    print(f"no-change re-run: {rerun_s:.2f}s = {rerun_s / flows_s:.1%} of the first run  (goal < 2%)")


if __name__ == "__main__":
    main()
