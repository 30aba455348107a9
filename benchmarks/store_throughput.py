"""Store put/get throughput as a ratio to the same work done plainly, side by side.

Run: .venv/bin/python benchmarks/store_throughput.py [--mb 256] [--s3-mb 64] [--repeats 3]

For each backend (file:// and a moto S3 server on loopback) and each repeat, a fresh random file
goes through the store and through its plain equivalent, alternating which goes first. A store put
hashes, fsyncs (file://) and publishes atomically; its plain equivalent is an fsspec copy that is
fsynced where the backend has a disk (put_file, then fsync). A store get verifies every byte's
sha256; its plain equivalent is an fsspec get_file and a sha256 of the bytes. Ratios near 1.0 mean
the store adds little beyond the work its guarantees need; the goal is >= 0.8 on both backends.
The raw copy (no fsync, no hash) is printed per repeat too, for scale.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
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
    """Time the plain work and the store's operation, in the given order."""
    if ours_first:
        ours_s = _timed(ours)
        return _timed(raw), ours_s
    raw_s = _timed(raw)
    return raw_s, _timed(ours)


def _durable_copy(store: ArtifactStore, src: Path, key: str) -> None:
    """An fsspec copy made as durable as a store put: fsynced where the backend has a local disk."""
    store.fs.put_file(str(src), key)
    if store.local:
        with open(key, "rb+") as handle:
            os.fsync(handle.fileno())


def _hashed_get(store: ArtifactStore, key: str, dest: Path) -> None:
    """An fsspec download whose bytes are then sha256-hashed, as a store get verifies them."""
    store.fs.get_file(key, str(dest))
    digest = hashlib.sha256()
    with open(dest, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)


def _one_repeat(store: ArtifactStore, work: Path, base: str, i: int, size_mb: int) -> dict[str, float]:
    """Plain/store time ratios for one fresh random file."""
    src = work / f"src-{i}.bin"
    src.write_bytes(os.urandom(size_mb * 1024 * 1024))
    plain_key, plain_out, store_out = f"{base}/{i}.bin", work / f"plain-out-{i}", work / f"store-out-{i}"
    plain_put, store_put = _side_by_side(
        lambda: _durable_copy(store, src, plain_key), lambda: store.put("bench", f"blob-{i}", src), i % 2 == 1
    )
    plain_get, store_get = _side_by_side(
        lambda: _hashed_get(store, plain_key, plain_out),
        lambda: store.get(f"bench/blob-{i}", store_out),
        i % 2 == 1,
    )
    raw_get = _timed(lambda: store.fs.get_file(plain_key, str(plain_out)))
    print(
        f"  repeat {i}: put {size_mb / store_put:.0f} MB/s (plain {size_mb / plain_put:.0f}), "
        f"get {size_mb / store_get:.0f} MB/s (plain {size_mb / plain_get:.0f}, raw copy {size_mb / raw_get:.0f})",
        flush=True,
    )
    for path in (src, plain_out, *store_out.glob("*")):
        path.unlink(missing_ok=True)
    return {"put": plain_put / store_put, "get": plain_get / store_get}


def measure(store: ArtifactStore, work: Path, size_mb: int, repeats: int) -> dict[str, float]:
    """Median plain/store throughput ratios over `repeats` fresh files."""
    base = f"{store.root}/plain-{uuid.uuid4().hex}"
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
    print("\nstore throughput / the same work done plainly (median; goal >= 0.80)")
    print("  put: copy + fsync (file://) or upload (S3); get: download + sha256")
    for backend, ratio in results.items():
        print(f"  {backend:5s} put {ratio['put']:.2f}   get {ratio['get']:.2f}")


if __name__ == "__main__":
    main()
