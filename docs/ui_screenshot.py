"""Screenshot a flywheel round in the Prefect UI (headless Chromium), for the README.

Run: .venv/bin/python docs/ui_screenshot.py [--out docs/prefect-ui-round.png] [--profile tiny]

Starts a local Prefect server with its UI, runs one round of the given profile against it (local
dispatch: every stage is a task run of the round), then has Chromium render the round's flow-run
page (the run graph, stage states and run names) into a PNG. Needs Debian's `chromium`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from flywheel.flows.local_server import local_server

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def screenshot(url: str, out: Path, size: str, wait_ms: int) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("error: chromium not found (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        command = [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            f"--virtual-time-budget={wait_ms}",
            f"--screenshot={out.resolve()}",
            url,
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "prefect-ui-round.png")
    parser.add_argument("--profile", default="tiny")
    parser.add_argument("--size", default="1600,1000")
    parser.add_argument("--wait-ms", type=int, default=20000, help="Virtual time for the page to load.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, local_server(Path(tmp, "prefect"), ui=True) as env:
        env = {**env, "FLYWHEEL_CACHE": str(Path(tmp, "cache"))}
        flywheel = Path(sys.executable).with_name("flywheel")
        command = [str(flywheel), "--store", str(Path(tmp, "store")), "round", "--profile", args.profile]
        subprocess.run(command, env=env, check=True, capture_output=True)
        api = env["PREFECT_API_URL"]
        runs = httpx.post(
            f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [f"flywheel-{args.profile}"]}}}
        )
        run_id = runs.raise_for_status().json()[0]["id"]
        screenshot(f"{api.removesuffix('/api')}/runs/flow-run/{run_id}", args.out, args.size, args.wait_ms)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
