"""Moving bytes into and out of the store, hashing every byte on its way.

Apart from the store because this is where speed and integrity meet: the kernel copy hashed back
from the staged file, the single PUT below s3fs's multipart threshold, parts and ranged GETs in
flight in parallel. The store decides where objects live (`blob_path`); `Transfer` only moves
bytes there and refuses any whose hash is not the address they were meant for.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hashlib
import io
import itertools
import os
import stat
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from fsspec.asyn import sync

from flywheel.data.errors import CorruptBlobError, StoreError, translate
from flywheel.data.manifest import FileEntry
from flywheel.data.refs import open_regular, publish, staged_file

STAGING = "tmp"
_CHUNK = 8 * 1024 * 1024  # Local copy and hash step.
_HASH_LAG = 16  # Chunks a local copy may run ahead of its hash: 128 MiB, still in the page cache.
_PART = 32 * 1024 * 1024  # S3 multipart part and ranged-GET size, sent or fetched 8 at a time.
_SINGLE_PUT_MAX = 100 * 1024 * 1024  # Below this one PUT, as s3fs itself does (2 x its 50 MiB part).
_MAX_PARTS = 10_000
_S3_CONCURRENCY = 8
_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK, errno.EOPNOTSUPP, errno.EXDEV}  # As shutil.

Progress = Callable[[int], None]
Writer = Callable[[bytes], Any]


class Transfer:
    """Hashed copies between local files or memory and one store's objects, on `file://` or S3."""

    def __init__(self, fs: Any, url: str, root: str, local: bool, blob_path: Callable[[str], str]) -> None:
        self.fs = fs
        self.url = url
        self.root = root
        self.local = local
        self.staging = Path(root, STAGING)  # Local stores only: S3 objects appear whole or not at all.
        self._blob_path = blob_path

    # -- in -------------------------------------------------------------------------------------

    def put_file(self, path: Path, progress: Progress | None) -> FileEntry:
        """Store one local regular file as a blob; a file that changes meanwhile is refused, not stored torn."""
        before = source_state(path)
        if self.local:
            return self._put_local_file(path, before, progress)
        return self._put_s3_file(path, before, progress)

    def _put_local_file(self, path: Path, before: os.stat_result, progress: Progress | None) -> FileEntry:
        with staged_file(self.staging) as (staged, handle), open(path, "rb") as source:
            digest, size = _copy_file_hashing(source, handle, progress, flush=True)
            _check_unchanged(path, before)
            final = Path(self._blob_path(digest))
            if not self._present(str(final), size):
                publish(staged, handle, final)
        return FileEntry(sha256=digest, size=size)

    def _put_s3_file(self, path: Path, before: os.stat_result, progress: Progress | None) -> FileEntry:
        # The key is the hash, so hashing must finish before the upload starts.
        if before.st_size < _SINGLE_PUT_MAX:  # One read into memory: the bytes hashed are the bytes sent.
            chunks: list[bytes] = []
            with open(path, "rb") as source:
                digest, _ = copy_hashing(source, chunks.append, None)
            _check_unchanged(path, before)
            entry = self._put_hashed_bytes(b"".join(chunks), digest)
        else:  # Too big for memory: hash, then upload in parts that are hashed again as they are sent.
            with open(path, "rb") as source:
                digest, _ = copy_hashing(source, None, None)
            entry = FileEntry(sha256=digest, size=before.st_size)
            key = self._blob_path(digest)
            if not self._present(key, entry.size):
                translate(self.url, lambda: sync(self.fs.loop, self._upload, path, before, key, digest, progress))
                return entry
        if progress is not None:
            progress(entry.size)
        return entry

    def put_bytes(self, data: bytes) -> FileEntry:
        """Store an in-memory payload as a blob."""
        return self._put_hashed_bytes(data, hashlib.sha256(data).hexdigest())

    def _put_hashed_bytes(self, data: bytes, digest: str) -> FileEntry:
        key = self._blob_path(digest)
        if not self._present(key, len(data)):
            self.write_object(key, data)
        return FileEntry(sha256=digest, size=len(data))

    def write_object(self, key: str, data: bytes) -> None:
        """Whole-object write: staged, fsynced and renamed locally (an existing object is kept), a single PUT on S3."""
        if self.local:
            with staged_file(self.staging) as (staged, handle):
                handle.write(data)
                if not self._present(key, len(data)):
                    publish(staged, handle, Path(key))
        else:
            translate(self.url, lambda: self.fs.pipe_file(key, data))

    def _present(self, key: str, size: int) -> bool:
        """De-duplication: an object of the right size is kept; a missing or truncated one is (re)written."""
        if self.local:
            try:
                info = os.lstat(key)
            except FileNotFoundError:
                return False
            return stat.S_ISREG(info.st_mode) and info.st_size == size
        try:
            return translate(self.url, lambda: self.fs.info(key))["size"] == size
        except FileNotFoundError:
            return False

    async def _upload(
        self, path: Path, before: os.stat_result, key: str, digest: str, progress: Progress | None
    ) -> None:
        """Multipart upload with parts in flight in parallel; completed only if what was sent hashes to `digest`."""
        bucket, object_key = key.split("/", 1)
        loop = asyncio.get_running_loop()
        part_size = max(_PART, -(-before.st_size // _MAX_PARTS))
        upload = await self.fs._call_s3("create_multipart_upload", Bucket=bucket, Key=object_key)
        ids = {"Bucket": bucket, "Key": object_key, "UploadId": upload["UploadId"]}
        slots = asyncio.Semaphore(_S3_CONCURRENCY)
        hasher = hashlib.sha256()

        async def send(number: int, data: bytes) -> dict[str, Any]:
            try:
                result = await self.fs._call_s3("upload_part", PartNumber=number, Body=data, **ids)
            finally:
                slots.release()
            if progress is not None:
                progress(len(data))
            return {"PartNumber": number, "ETag": result["ETag"]}

        def read_part(source: BinaryIO) -> bytes:
            data = source.read(part_size)
            hasher.update(data)
            return data

        sends: list[asyncio.Future[dict[str, Any]]] = []
        try:
            with open(path, "rb") as source:
                for number in range(1, -(-before.st_size // part_size) + 1):
                    await slots.acquire()
                    data = await loop.run_in_executor(None, read_part, source)
                    sends.append(asyncio.ensure_future(send(number, data)))
                parts = await asyncio.gather(*sends)
            if hasher.hexdigest() != digest:
                raise StoreError(f"'{path}' changed while it was being stored; store it again once it is complete")
            _check_unchanged(path, before)
            await self.fs._call_s3("complete_multipart_upload", MultipartUpload={"Parts": parts}, **ids)
        except BaseException:
            for pending in sends:
                pending.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
            with contextlib.suppress(Exception):  # Keep the original error; verify reports what remains.
                await self.fs._call_s3("abort_multipart_upload", **ids)
            raise

    # -- out ------------------------------------------------------------------------------------

    def stream_blob(
        self, entry: FileEntry, label: str, out: BinaryIO | None = None, progress: Progress | None = None
    ) -> None:
        """Copy a blob to `out` (or only read it) while hashing it; raise if it is not the entry's bytes."""
        key = self._blob_path(entry.sha256)
        what = f"blob {entry.sha256} {label}".rstrip()
        write = None if out is None else out.write
        if self.local:
            with open_regular(Path(key), what) as source:
                if isinstance(out, io.BufferedWriter):
                    digest, size = _copy_file_hashing(source, out, progress)
                else:
                    digest, size = copy_hashing(source, write, progress)
        else:
            digest, size = translate(
                self.url, lambda: sync(self.fs.loop, self._download, key, entry.size, write, progress, what), what
            )
        if digest != entry.sha256 or size != entry.size:
            raise CorruptBlobError(f"{what} is corrupted: its {size} bytes hash to {digest[:12]}…")

    def get_blob(self, entry: FileEntry, dest: Path, label: str, progress: Progress | None) -> None:
        """Copy a blob to `dest` atomically, verifying its hash; a bad blob leaves `dest` untouched."""
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        except OSError as err:
            raise StoreError(f"cannot write '{dest}': {err.strerror}") from err
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                self.stream_blob(entry, label, out, progress)
            os.replace(tmp, dest)
        except OSError as err:
            raise StoreError(f"cannot copy {label} to '{dest}': {err.strerror}") from err
        finally:
            tmp.unlink(missing_ok=True)

    async def _download(
        self, key: str, size: int, write: Writer | None, progress: Progress | None, what: str
    ) -> tuple[str, int]:
        """Ranged GETs in parallel, written and hashed in order; the object's total size is checked too."""
        bucket, object_key = key.split("/", 1)
        loop = asyncio.get_running_loop()
        hasher = hashlib.sha256()

        async def fetch(start: int) -> bytes:
            ranged = {"Range": f"bytes={start}-{min(start + _PART, size) - 1}"} if size else {}
            try:
                response = await self.fs._call_s3("get_object", Bucket=bucket, Key=object_key, **ranged)
            except OSError as err:
                if err.errno != errno.EINVAL:  # s3fs's InvalidRange: the object is shorter than the manifest says.
                    raise
                raise CorruptBlobError(f"{what} is corrupted: it holds fewer than {size} bytes") from err
            total = int(response.get("ContentRange", "/").rsplit("/", 1)[1] or response["ContentLength"])
            async with response["Body"] as body:
                if total != size:
                    raise CorruptBlobError(f"{what} is corrupted: it holds {total} bytes, not {size}")
                return await body.read()

        def consume(data: bytes) -> None:
            hasher.update(data)
            if write is not None:
                write(data)

        starts = iter(range(0, max(size, 1), _PART))
        window = collections.deque(asyncio.ensure_future(fetch(s)) for s in itertools.islice(starts, _S3_CONCURRENCY))
        received = 0
        try:
            while window:
                data = await window.popleft()
                if (start := next(starts, None)) is not None:
                    window.append(asyncio.ensure_future(fetch(start)))
                await loop.run_in_executor(None, consume, data)
                received += len(data)
                if progress is not None:
                    progress(len(data))
        finally:
            for pending in window:
                pending.cancel()
            await asyncio.gather(*window, return_exceptions=True)
        return hasher.hexdigest(), received


def copy_hashing(source: BinaryIO, write: Writer | None, progress: Progress | None) -> tuple[str, int]:
    """Copy `source` to `write` chunk by chunk, hashing the very bytes written on a second core."""
    digest = hashlib.sha256()
    size = 0
    hashed: Future[None] | None = None
    with ThreadPoolExecutor(1) as pool:
        while chunk := source.read(_CHUNK):
            if hashed is not None:
                hashed.result()
            hashed = pool.submit(digest.update, chunk)
            if write is not None:
                write(chunk)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
        if hashed is not None:
            hashed.result()
    return digest.hexdigest(), size


def _copy_file_hashing(
    source: BinaryIO, dest: BinaryIO, progress: Progress | None, flush: bool = False
) -> tuple[str, int]:
    """Copy file to file in the kernel (shutil's sendfile path), hashing each chunk read back from `dest`.

    What gets hashed is the copy itself, at the cost of one memory copy per byte rather than two
    for read+write. SHA-256 is slower than a kernel copy, so the copy runs up to `_HASH_LAG` chunks
    ahead of a second core hashing behind it, and with `flush` the copy's write-back to disk starts
    as soon as the last chunk is copied, while the hash catches up: the fsync before publishing then
    finds little left. Where the system cannot sendfile between these files, it falls back to
    read + write, as shutil does.
    """
    in_fd, out_fd = source.fileno(), dest.fileno()
    digest = hashlib.sha256()
    size = 0
    behind: collections.deque[Future[None]] = collections.deque()

    def hash_back(offset: int, length: int) -> None:
        digest.update(os.pread(out_fd, length, offset))

    # One worker each: hashes must run in order, and the flush must not wait behind them.
    with ThreadPoolExecutor(1) as hasher, ThreadPoolExecutor(1) as flusher:
        while True:
            try:
                sent = os.sendfile(out_fd, in_fd, None, _CHUNK)
            except OSError as err:
                if size or err.errno not in _NO_SENDFILE:
                    raise
                return copy_hashing(source, dest.write, progress)
            if not sent:
                break
            if len(behind) == _HASH_LAG:
                behind.popleft().result()
            behind.append(hasher.submit(hash_back, size, sent))
            size += sent
            if progress is not None:
                progress(sent)
        flushed = flusher.submit(os.fsync, out_fd) if flush else None
        for hashed in behind:
            hashed.result()
        if flushed is not None:
            flushed.result()
    return digest.hexdigest(), size


def source_state(path: Path) -> os.stat_result:
    """The source's stat before a copy; only a regular file can be stored (a FIFO would hang the copy)."""
    try:
        state = path.stat()
    except OSError as err:
        raise StoreError(f"cannot store '{path}': {err.strerror}") from err
    if not stat.S_ISREG(state.st_mode):
        raise StoreError(f"cannot store '{path}': not a regular file")
    return state


def _check_unchanged(path: Path, before: os.stat_result) -> None:
    try:
        after = path.stat()
    except OSError as err:
        raise StoreError(f"'{path}' vanished while it was being stored") from err
    if (after.st_size, after.st_mtime_ns, after.st_ino) != (before.st_size, before.st_mtime_ns, before.st_ino):
        raise StoreError(f"'{path}' changed while it was being stored; store it again once it is complete")
