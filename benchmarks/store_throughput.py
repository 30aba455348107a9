"""Store put/get throughput as a ratio to a raw fsspec copy of the same bytes, side by side.

Run: .venv/bin/python benchmarks/store_throughput.py [--mb 256] [--s3-mb 64] [--repeats 3]

For each backend (file:// and a moto S3 server on loopback) and each repeat, a fresh random file
is copied raw with fsspec (put_file / get_file) and through the store (hashing, verification,
atomic publish), alternating which goes first. Ratios near 1.0 mean the store's integrity costs
little; the goal is >= 0.8.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from data import ArtifactStore


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _side_by_side(raw, ours, ours_first: bool) -> tuple[float, float]:
    """Time the raw copy and the store's operation, in the given order."""
    if ours_first:
        ours_s = _timed(ours)
        return _timed(raw), ours_s
    raw_s = _timed(raw)
    return raw_s, _timed(ours)


def _one_repeat(store: ArtifactStore, work: Path, base: str, i: int, size_mb: int) -> tuple[float, float]:
    """Raw/store time ratios (put, get) for one fresh random file."""
    src = work / f"src-{i}.bin"
    src.write_bytes(os.urandom(size_mb * 1024 * 1024))
    raw_key, raw_out, store_out = f"{base}/{i}.bin", work / f"raw-out-{i}", work / f"store-out-{i}"
    raw_put, store_put = _side_by_side(
        lambda: store.fs.put_file(str(src), raw_key), lambda: store.put("bench", f"blob-{i}", src), i % 2 == 1
    )
    raw_get, store_get = _side_by_side(
        lambda: store.fs.get_file(raw_key, str(raw_out)),
        lambda: store.get(f"bench/blob-{i}", store_out),
        i % 2 == 1,
    )
    print(
        f"  repeat {i}: put {size_mb / store_put:.0f} MB/s (raw {size_mb / raw_put:.0f}), "
        f"get {size_mb / store_get:.0f} MB/s (raw {size_mb / raw_get:.0f})",
        flush=True,
    )
    for path in (src, raw_out, *store_out.glob("*")):
        path.unlink(missing_ok=True)
    return raw_put / store_put, raw_get / store_get


def measure(store: ArtifactStore, work: Path, size_mb: int, repeats: int) -> dict[str, float]:
    """Median raw/store throughput ratios for put and get over `repeats` fresh files."""
    base = f"{store.root}/raw-{uuid.uuid4().hex}"
    store.fs.makedirs(base, exist_ok=True)
    ratios = [_one_repeat(store, work, base, i, size_mb) for i in range(repeats)]
    return {"put": statistics.median(r[0] for r in ratios), "get": statistics.median(r[1] for r in ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="file size for file://")
    parser.add_argument("--s3-mb", type=int, default=64, help="file size for the moto S3 server")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # One access-log line per request drowns the figures.
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
    )
    import boto3

    boto3.client("s3").create_bucket(Bucket="flywheel-bench")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp, "work")
        work.mkdir()
        print(f"file:// ({args.mb} MB x {args.repeats})")
        results["file"] = measure(ArtifactStore(Path(tmp, "store")), work, args.mb, args.repeats)
        print(f"s3 via moto ({args.s3_mb} MB x {args.repeats})")
        results["s3"] = measure(ArtifactStore("s3://flywheel-bench/store"), work, args.s3_mb, args.repeats)
    server.stop()
    print("\nstore throughput / raw fsspec copy (median; goal >= 0.80)")
    for backend, ratio in results.items():
        print(f"  {backend:5s} put {ratio['put']:.2f}   get {ratio['get']:.2f}")


if __name__ == "__main__":
    main()
