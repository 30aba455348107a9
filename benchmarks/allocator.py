"""glibc's malloc vs tcmalloc under SmolLM2's SFT, side by side in one run (`flows/fast_malloc.py`).

Run: .venv/bin/python benchmarks/allocator.py [--store .flywheel] [--dataset dataset/sft-r1] [--steps 4]

Each arm runs `flywheel train sft` with the default round's SFT settings (one conversation per
micro-batch, 4 per step, gradient checkpointing, up to 2,048 tokens) on the same dataset artifact
(a round's SFT set: `make demo` leaves one in `.flywheel`), `FLYWHEEL_MALLOC=system` for glibc.
Printed per arm: wall and kernel seconds, minor page faults, peak resident memory, the run's final
loss (equal losses: the allocator changed no number), and the speed-up of tcmalloc over glibc.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from flywheel.flows.fast_malloc import OPT_OUT, fast_malloc_env

ROOT = Path(__file__).resolve().parent.parent


def sft_run(store: str, dataset: str, steps: int, allocator: str) -> dict[str, float]:
    """One SFT run in a fresh process; its wall time, rusage and final loss."""
    command = [
        str(Path(sys.executable).with_name("flywheel")), "--store", store, "train", "sft",
        "--config", str(ROOT / "training/configs/sft_smollm2_cpu.yaml"), f"dataset={dataset}",
        f"total_steps={steps}", "batch_size=1", "gradient_accumulation_steps=4", "max_length=2048",
        "gradient_checkpointing=true", "learning_rate=0.0002", f"output_name=bench-malloc-{allocator}",
    ]  # fmt: skip
    env = {**os.environ, OPT_OUT: "system" if allocator == "glibc" else "tcmalloc"}
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{allocator}: flywheel train sft exited {process.returncode}:\n{output[-2000:]}")
    line = next(line for line in output.splitlines() if line.startswith("checkpoint/"))  # `ref = id  {metrics}`
    metrics = json.loads(line[line.index("{") :])
    return {
        "wall": time.perf_counter() - started,
        "sys": usage.ru_stime,
        "faults": usage.ru_minflt,
        "peak_gb": usage.ru_maxrss / 1e6,
        "final_loss": metrics["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=".flywheel")
    parser.add_argument("--dataset", default="dataset/sft-r1")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if fast_malloc_env({}) is None:
        sys.exit("tcmalloc is not installed (apt: libtcmalloc-minimal4): nothing to compare")
    arms = {name: sft_run(args.store, args.dataset, args.steps, name) for name in ("glibc", "tcmalloc")}
    header = ("wall s", 8), ("kernel s", 9), ("minor faults", 13), ("peak GB", 8), ("final loss", 11)
    print(f"{'allocator':10s} " + " ".join(f"{name:>{width}s}" for name, width in header))
    for name, arm in arms.items():
        print(
            f"{name:10s} {arm['wall']:8.1f} {arm['sys']:9.1f} {arm['faults']:13,d} {arm['peak_gb']:8.2f} "
            f"{arm['final_loss']:11.6f}"
        )
    print(f"tcmalloc speed-up: x{arms['glibc']['wall'] / arms['tcmalloc']['wall']:.2f} ({args.steps} SFT steps)")


if __name__ == "__main__":
    main()
