"""Movable refs with compare-and-swap: a file lock on local disks, conditional PUTs on S3.

A ref is a small JSON object `{"target": <manifest id>, "history": [...]}`. Every move appends to
`history`, so a lost update would show as a missing entry (the concurrency tests count them).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from data.errors import RefConflict

RefValue = dict[str, Any]
_MAX_CAS_ATTEMPTS = 200


class RefBackend(Protocol):
    """Reads a ref with a version token and writes it only if the token still holds."""

    def read(self, key: str) -> tuple[RefValue | None, Any]: ...

    def write_if(self, key: str, value: RefValue, token: Any) -> bool: ...

    @contextlib.contextmanager
    def exclusive(self, key: str) -> Iterator[None]: ...


class LocalRefBackend:
    """Refs as files; an exclusive flock serialises writers and `os.replace` makes writes atomic."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.json"

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

    def read(self, key: str) -> tuple[RefValue | None, Any]:
        try:
            raw = self._path(key).read_bytes()
        except FileNotFoundError:
            return None, None
        return json.loads(raw), raw

    def write_if(self, key: str, value: RefValue, token: Any) -> bool:
        # Callers hold `exclusive(key)`, so the token check and the replace are one atomic step.
        path = self._path(key)
        current = path.read_bytes() if path.exists() else None
        if current != token:
            return False
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as handle:
            handle.write(json.dumps(value, sort_keys=True).encode())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        return True


class S3RefBackend:
    """Refs as S3 objects; writes are conditional on the ETag (or on absence) the reader saw."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")

    def _bucket_key(self, key: str) -> tuple[str, str]:
        bucket, _, prefix = f"{self.root}/{key}.json".partition("/")
        return bucket, prefix

    @contextlib.contextmanager
    def exclusive(self, key: str) -> Iterator[None]:
        yield  # Conditional PUTs make the write safe; there is nothing to lock.

    def read(self, key: str) -> tuple[RefValue | None, Any]:
        bucket, object_key = self._bucket_key(key)
        try:
            response = self.fs.call_s3("get_object", Bucket=bucket, Key=object_key)
        except FileNotFoundError:
            return None, None
        body = _read_body(self.fs, response["Body"])
        return json.loads(body), response["ETag"]

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
        except (OSError, PermissionError) as err:
            if _is_precondition_failure(err):
                return False
            raise
        self.fs.invalidate_cache(f"{bucket}/{object_key}")
        return True


def _read_body(fs: Any, body: Any) -> bytes:
    """Read an aiobotocore streaming body on s3fs's event loop."""
    from fsspec.asyn import sync

    async def _read() -> bytes:
        async with body as stream:
            return await stream.read()

    return sync(fs.loop, _read)


def _is_precondition_failure(err: BaseException) -> bool:
    text = f"{err} {err.__cause__ or ''}"
    return "PreconditionFailed" in text or "412" in text or "ConditionalRequestConflict" in text


def update_ref(
    backend: RefBackend, key: str, target: str, expected: str | Callable[[str | None], bool] | None
) -> RefValue:
    """Move ref `key` to `target` if its current target satisfies `expected`; retry on races.

    `expected` is the target the caller believes is current (None: the ref must not exist), or a
    predicate over the current target. A mismatch raises `RefConflict`; a concurrent writer that
    wins the race only causes a retry, so no update is ever lost.
    """
    for _ in range(_MAX_CAS_ATTEMPTS):
        with backend.exclusive(key):
            current, token = backend.read(key)
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
