"""Curation's time and peak memory against its input size, beside the pairwise implementation it replaced.

Run: .venv/bin/python benchmarks/curation_scale.py [--full] [--baseline-rev afaf61c] [--timeout 900]

Synthetic rollouts (groups of two, distinct random text: every row survives, the worst case for an
index of kept rows) are curated at 1, 3, 10, 30 and 100 thousand rows (300 thousand and a million
with --full), each size in a fresh process so its peak RSS is its own. Streaming: today's `Curator`,
rows into Parquet shards on disk.
Pairwise: `curate()` from the git revision given (each row's shingles compared with every kept
row's, the groups and rows held in lists), run as far as it finishes within --timeout a size.
Timed from after the imports (the synthetic input is made inside the timing, a small linear cost to
both). Prints rows/s, peak memory, and the growth exponent fitted from the smallest to the largest size
(time ~ n^k); the goal is k <= 1.1 with peak memory flat within 2x from 10^3 to 10^5 rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EVAL_ITEMS = 200


def synthetic_groups(rows: int) -> Iterator[dict]:
    """`rows` rollouts in groups of two, each conversation ~120 random words, all passing."""
    rng = random.Random(rows)

    def text(words: int) -> str:
        return " ".join(f"w{rng.randrange(10**6)}" for _ in range(words))

    for number in range(rows // 2):
        prompt = f"Task {number}: {text(30)}"
        messages = [[{"role": "user", "content": prompt}, {"role": "assistant", "content": text(90)}] for _ in range(2)]
        meta = {"item_id": f"g{number}", "env": "synthetic", "category": "c", "difficulty": "easy",
                "completed": [True, True]}  # fmt: skip
        yield {"scores": [1.0, 1.0], "messages": messages, "meta": meta}


def eval_texts() -> list[str]:
    rng = random.Random(-1)
    return [" ".join(f"e{rng.randrange(10**6)}" for _ in range(40)) for _ in range(EVAL_ITEMS)]


def run_streaming(rows: int, _: object) -> int:
    from flywheel.data.columnar import ShardWriter
    from flywheel.data.curation import CurationConfig, Curator

    config = CurationConfig(top_n_per_group=2)
    curator = Curator(eval_texts(), config)
    for group in synthetic_groups(rows):
        curator.add(group)
    with tempfile.TemporaryDirectory() as tmp:
        writers = {kind: ShardWriter(Path(tmp, kind), kind) for kind in ("sft", "pairs")}
        kept = 0
        for kind, row in curator.rows():
            writers[kind].write(row)
            kept += kind == "sft"
        for writer in writers.values():
            writer.close()
    return kept


def load_pairwise(source: Path) -> object:
    spec = importlib.util.spec_from_file_location("pairwise_curation", source)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Its dataclasses look their module up.
    spec.loader.exec_module(module)
    return module


def run_pairwise(rows: int, module: Any) -> int:
    groups = list(synthetic_groups(rows))  # As its curate_to_store did: every group read first.
    result = module.curate(groups, eval_texts(), module.CurationConfig(top_n_per_group=2))
    return len(result.sft)


def child(kind: str, rows: int, source: str | None) -> None:
    """One measurement; the timer starts once the code is imported (time to curate, not to start)."""
    if kind == "streaming":
        import flywheel.data.curation  # noqa: F401 - imported before the timer starts.

        run, loaded = run_streaming, None
    else:
        run, loaded = run_pairwise, load_pairwise(Path(source or ""))
    started = time.perf_counter()
    kept = run(rows, loaded)
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_mb": peak_mb, "kept": kept}))


def measure(kind: str, rows: int, source: Path | None, timeout: float) -> dict | None:
    command = [sys.executable, __file__, "--child", kind, str(rows)] + ([str(source)] if source else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_source(rev: str, folder: Path) -> Path | None:
    """The curation module as it was at `rev` (None outside a git checkout that has it)."""
    try:
        text = subprocess.run(
            ["git", "show", f"{rev}:data/curation.py"], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = folder / "pairwise_curation.py"
    path.write_text(text)
    return path


def exponent(points: list[tuple[int, float]]) -> float | None:
    """Growth exponent k of seconds ~ rows^k from the smallest to the largest size measured."""
    if len(points) < 2:
        return None
    (n0, t0), (n1, t1) = points[0], points[-1]
    return math.log(t1 / t0) / math.log(n1 / n0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="Also 10^6 rows.")
    parser.add_argument("--baseline-rev", default="afaf61c", help="Git revision of the pairwise curation.")
    parser.add_argument("--timeout", type=float, default=900, help="Seconds a size may take before its curve stops.")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, rows, *source = args.child
        child(kind, int(rows), source[0] if source else None)
        return
    sizes = [1_000, 3_000, 10_000, 30_000, 100_000] + ([300_000, 1_000_000] if args.full else [])
    with tempfile.TemporaryDirectory() as tmp:
        source = baseline_source(args.baseline_rev, Path(tmp))
        curves: dict[str, list[tuple[int, dict]]] = {"streaming": [], "pairwise": []}
        columns = f"{'seconds':>10} {'rows/s':>8} {'peak MB':>8}"
        print(f"{'rows':>9} | streaming: {columns} | pairwise: {columns}")
        for rows in sizes:
            cells = []
            for kind in ("streaming", "pairwise"):
                running = kind == "streaming" or (source and len(curves["pairwise"]) == sizes.index(rows))
                result = measure(kind, rows, source if kind == "pairwise" else None, args.timeout) if running else None
                if result:
                    curves[kind].append((rows, result))
                    cells.append(
                        f"{result['seconds']:>10.1f} {rows / result['seconds']:>8.0f} {result['peak_mb']:>8.0f}"
                    )
                else:
                    cells.append(f"{'-':>10} {'-':>8} {'-':>8}")
            print(f"{rows:>9} | {'':>11}{cells[0]} | {'':>10}{cells[1]}", flush=True)
    for kind, points in curves.items():
        k = exponent([(rows, result["seconds"]) for rows, result in points])
        peaks = [result["peak_mb"] for _, result in points]
        if k is not None:
            print(f"{kind}: time ~ n^{k:.2f} from {points[0][0]} to {points[-1][0]} rows; "
                  f"peak memory {max(peaks) / min(peaks):.2f}x")  # fmt: skip
        elif kind == "pairwise" and source is None:
            print(f"pairwise: revision {args.baseline_rev} not found (run in a git checkout)")


if __name__ == "__main__":
    main()
