"""Store put/get throughput as a ratio to a raw fsspec copy of the same bytes, side by side.

Run: .venv/bin/python benchmarks/store_throughput.py [--mb 256] [--s3-mb 64] [--repeats 3]

For each backend (file:// and a moto S3 server on loopback) and each repeat, a fresh random file
is copied raw with fsspec (put_file / get_file) and through the store (hashing, verification,
atomic publish), alternating which goes first. Ratios near 1.0 mean the store's integrity costs
little; the goal is >= 0.8. On file:// two ceilings are printed too: a put fsyncs its blob (so it
is compared with a raw copy + fsync as well), and every byte is sha256-hashed (so neither put nor
get can beat sha256's own speed, which a kernel copy from the page cache outruns).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from flywheel.data import ArtifactStore


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


def _durable_copy(src: Path, dest: str) -> None:
    """A raw local copy made as durable as the store's blobs (fsynced): what bounds a local put."""
    shutil.copyfile(src, dest)
    with open(dest, "rb+") as handle:
        os.fsync(handle.fileno())


def _one_repeat(store: ArtifactStore, work: Path, base: str, i: int, size_mb: int) -> dict[str, float]:
    """Raw/store time ratios for one fresh random file; locally also the two ceilings (fsync, sha256)."""
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
    ratios = {"put": raw_put / store_put, "get": raw_get / store_get}
    line = (
        f"put {size_mb / store_put:.0f} MB/s (raw {size_mb / raw_put:.0f}), "
        f"get {size_mb / store_get:.0f} MB/s (raw {size_mb / raw_get:.0f})"
    )
    if store.local:
        ratios["put/durable"] = _timed(lambda: _durable_copy(src, f"{base}/durable-{i}.bin")) / store_put
        data = src.read_bytes()
        ratios["sha256"] = size_mb / _timed(lambda: hashlib.sha256(data))
        ratios["copy"] = size_mb / raw_get
        line += f", sha256 alone {ratios['sha256']:.0f} MB/s"
    print(f"  repeat {i}: {line}", flush=True)
    for path in (src, raw_out, *store_out.glob("*")):
        path.unlink(missing_ok=True)
    return ratios


def measure(store: ArtifactStore, work: Path, size_mb: int, repeats: int) -> dict[str, float]:
    """Median raw/store throughput ratios (and local ceilings) over `repeats` fresh files."""
    base = f"{store.root}/raw-{uuid.uuid4().hex}"
    store.fs.makedirs(base, exist_ok=True)
    runs = [_one_repeat(store, work, base, i, size_mb) for i in range(repeats)]
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


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
    local = results["file"]
    print(
        f"file:// ceilings: put / (raw copy + fsync) {local['put/durable']:.2f}; "
        f"every byte is hashed, and sha256 alone runs at {local['sha256']:.0f} MB/s "
        f"vs {local['copy']:.0f} MB/s for a raw copy"
    )


if __name__ == "__main__":
    main()
