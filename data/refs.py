"""Movable refs with compare-and-swap: a file lock on local disks, conditional PUTs on S3.

A ref is a small JSON object `{"target": <manifest id>, "history": [...]}`. Every move appends to
`history`, so a lost update would show as a missing entry (the concurrency tests count them).

Refs are also where untrusted names meet paths, so every read and write checks the name, and
every read checks the object (a regular file of bounded size holding a well-formed ref). The
bounded, type-checked reads are shared with the store's manifests.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import stat
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from flywheel.data.errors import ArtifactNotFound, CorruptBlobError, RefConflict, StoreError

RefValue = dict[str, Any]
_MAX_OBJECT_BYTES = 64 * 1024 * 1024  # Refs and manifests; a larger one is corrupt, not read into memory.
_MAX_CAS_ATTEMPTS = 200
_MAX_REF_CHARS = 200  # Leaves room for the `.json.lock` suffix within a 255-byte file name.
_REF_PART = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PRECONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict"}


def check_ref_name(name: str) -> str:
    """Return `name` if it can be a ref: the same check guards every read and write of a ref.

    Parts are letters, digits, '-', '_', '.', joined by '/'; no part starts with '.' or ends in
    `.json`/`.lock` (a ref `a.json/b` would need a folder where ref `a`'s file lives).
    """
    parts = name.split("/")
    if (
        len(name) > _MAX_REF_CHARS
        or not all(_REF_PART.fullmatch(part) for part in parts)
        or any(".." in part or part.endswith((".json", ".lock")) for part in parts)
    ):
        raise StoreError(
            f"invalid ref name {name[:80]!r}{'…' if len(name) > 80 else ''}: use at most {_MAX_REF_CHARS} "
            "letters, digits, '-', '_', '.' in parts joined by '/', none starting with '.' or ending in .json/.lock"
        )
    return name


def _parse_ref(raw: bytes, name: str) -> RefValue:
    """A ref's bytes as `{"target", "history"}`, or a one-line CorruptBlobError naming the ref."""
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptBlobError(f"ref '{name}' is corrupted: not JSON (truncated or overwritten?)") from err
    target = value.get("target") if isinstance(value, dict) else None
    if not isinstance(target, str) or not _SHA256.fullmatch(target):
        raise CorruptBlobError(f"ref '{name}' is corrupted: it has no valid 'target' manifest id")
    history = value.get("history")
    if not isinstance(history, list) or not all(isinstance(h, dict) and "target" in h for h in history):
        raise CorruptBlobError(f"ref '{name}' is corrupted: its 'history' is not a list of moves")
    return value


def read_local_object(path: Path, label: str, limit: int = _MAX_OBJECT_BYTES) -> bytes:
    """Read a small store object, refusing symlinks, FIFOs, devices, folders and oversized files.

    A plain `read_bytes` would hang on a FIFO and exhaust memory on a link to /dev/zero.
    """
    with open_regular(path, label) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise CorruptBlobError(f"{label} is corrupted: {size} bytes, more than any valid one ({limit})")
        return handle.read(limit + 1)


@contextlib.contextmanager
def open_regular(path: Path, label: str) -> Iterator[Any]:
    """Open a store file for reading only if it is a regular file (not a link, FIFO, device or folder)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as err:
        raise ArtifactNotFound(f"{label} is missing") from err
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CorruptBlobError(f"{label} is corrupted: it is a symlink, not a file") from err
        raise CorruptBlobError(f"{label} cannot be read: {err.strerror}") from err
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise CorruptBlobError(f"{label} is corrupted: it is {kind}, not a file")
    with os.fdopen(fd, "rb") as handle:
        yield handle


@contextlib.contextmanager
def staged_file(staging: Path) -> Iterator[tuple[Path, BinaryIO]]:
    """A new file in `staging`, flocked while open so that `verify` tells a live write from a leftover.

    Move it into place with `publish` inside the block; whatever is still staged at the end is removed.
    """
    staging.mkdir(parents=True, exist_ok=True)
    path = staging / uuid.uuid4().hex
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)  # Readable: the copy is hashed back from it.
    fcntl.flock(fd, fcntl.LOCK_EX)
    with os.fdopen(fd, "wb") as handle:
        try:
            yield path, handle
        finally:
            path.unlink(missing_ok=True)  # Still locked: a concurrent verify cannot mistake it for a leftover.


def publish(staged: Path, handle: BinaryIO, final: Path) -> None:
    """fsync a staged file, rename it to `final` and fsync the folder: once this returns, a crash keeps it."""
    handle.flush()
    os.fsync(handle.fileno())
    _makedirs_durably(final.parent)
    os.replace(staged, final)
    _fsync_dir(final.parent)


def _makedirs_durably(folder: Path) -> None:
    if folder.is_dir():
        return
    _makedirs_durably(folder.parent)
    folder.mkdir(exist_ok=True)
    _fsync_dir(folder.parent)


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (fsync of the file alone does not)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RefBackend(Protocol):
    """Reads a ref with a version token and writes it only if the token still holds."""

    def read(self, key: str) -> tuple[RefValue | None, Any]: ...

    def write_if(self, key: str, value: RefValue, token: Any) -> bool: ...

    @contextlib.contextmanager
    def exclusive(self, key: str) -> Iterator[None]: ...


class LocalRefBackend:
    """Refs as files; an exclusive flock serialises writers and `os.replace` makes writes atomic."""

    def __init__(self, root: Path, staging: Path) -> None:
        self.root = root
        self.staging = staging

    def _path(self, key: str) -> Path:
        return self.root / f"{check_ref_name(key)}.json"

    @contextlib.contextmanager
    def exclusive(self, key: str) -> Iterator[None]:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{path}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read_raw(self, key: str) -> bytes | None:
        try:
            return read_local_object(self._path(key), f"ref '{key}'")
        except ArtifactNotFound:
            return None

    def read(self, key: str) -> tuple[RefValue | None, Any]:
        raw = self._read_raw(key)
        return (None, None) if raw is None else (_parse_ref(raw, key), raw)

    def write_if(self, key: str, value: RefValue, token: Any) -> bool:
        # Callers hold `exclusive(key)`, so the token check and the replace are one atomic step.
        path = self._path(key)
        if self._read_raw(key) != token:
            return False
        with staged_file(self.staging) as (staged, handle):
            handle.write(json.dumps(value, sort_keys=True).encode())
            publish(staged, handle, path)
        return True


class S3RefBackend:
    """Refs as S3 objects; writes are conditional on the ETag (or on absence) the reader saw."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")

    def _bucket_key(self, key: str) -> tuple[str, str]:
        bucket, _, prefix = f"{self.root}/{check_ref_name(key)}.json".partition("/")
        return bucket, prefix

    @contextlib.contextmanager
    def exclusive(self, key: str) -> Iterator[None]:
        yield  # Conditional PUTs make the write safe; there is nothing to lock.

    def read(self, key: str) -> tuple[RefValue | None, Any]:
        bucket, object_key = self._bucket_key(key)
        try:
            raw, etag = read_s3_object(self.fs, bucket, object_key, f"ref '{key}'")
        except ArtifactNotFound:
            return None, None
        return _parse_ref(raw, key), etag

    def write_if(self, key: str, value: RefValue, token: Any) -> bool:
        bucket, object_key = self._bucket_key(key)
        condition = {"IfNoneMatch": "*"} if token is None else {"IfMatch": token}
        try:
            self.fs.call_s3(
                "put_object",
                Bucket=bucket,
                Key=object_key,
                Body=json.dumps(value, sort_keys=True).encode(),
                ContentType="application/json",
                **condition,
            )
        except OSError as err:
            if _is_precondition_failure(err):
                return False
            raise
        self.fs.invalidate_cache(f"{bucket}/{object_key}")
        return True


def read_s3_object(fs: Any, bucket: str, key: str, label: str, limit: int = _MAX_OBJECT_BYTES) -> tuple[bytes, str]:
    """A small S3 object's bytes and ETag; refuses one larger than `limit` before reading its body."""
    try:
        response = fs.call_s3("get_object", Bucket=bucket, Key=key)
    except FileNotFoundError as err:
        raise ArtifactNotFound(f"{label} is missing") from err
    if response.get("ContentLength", 0) > limit:
        _read_body(fs, response["Body"], 0)
        size = response["ContentLength"]
        raise CorruptBlobError(f"{label} is corrupted: {size} bytes, more than any valid one ({limit})")
    return _read_body(fs, response["Body"], limit + 1), response["ETag"]


def _read_body(fs: Any, body: Any, limit: int) -> bytes:
    """Read at most `limit` bytes of an aiobotocore streaming body on s3fs's event loop, then close it."""
    from fsspec.asyn import sync

    async def _read() -> bytes:
        async with body as stream:
            return await stream.read(limit)

    return sync(fs.loop, _read)


def _is_precondition_failure(err: BaseException) -> bool:
    """True when S3 refused a conditional write (s3fs wraps botocore's ClientError in an OSError)."""
    response = getattr(err.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in _PRECONDITION_CODES


def update_ref(
    backend: RefBackend,
    key: str,
    target: str,
    expected: str | Callable[[str | None], bool] | None,
    seen: tuple[RefValue | None, Any] | None = None,
) -> RefValue:
    """Move ref `key` to `target` if its current target satisfies `expected`; retry on races.

    `expected` is the target the caller believes is current (None: the ref must not exist), or a
    predicate over the current target. A mismatch raises `RefConflict`; a concurrent writer that
    wins the race only causes a retry, so no update is ever lost. `seen` is a `read` the caller
    already made: the first attempt uses it (its token is checked by the write) instead of reading again.
    """
    for _ in range(_MAX_CAS_ATTEMPTS):
        with backend.exclusive(key):
            current, token = seen or backend.read(key)
            seen = None
            current_target = current["target"] if current else None
            accepted = expected(current_target) if callable(expected) else current_target == expected
            if not accepted:
                raise RefConflict(
                    f"ref '{key}' points to {current_target or 'nothing'}, not the expected "
                    f"{'a matching target' if callable(expected) else expected or 'nothing'}"
                )
            history = [*(current or {}).get("history", []), _entry(target)]
            value = {"target": target, "history": history}
            if backend.write_if(key, value, token):
                return value
    raise RefConflict(f"ref '{key}': gave up after {_MAX_CAS_ATTEMPTS} contended attempts")


def _entry(target: str) -> dict[str, str]:
    return {"target": target, "at": datetime.now(UTC).isoformat(timespec="microseconds")}
