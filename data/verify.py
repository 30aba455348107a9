"""What `ArtifactStore.verify` checks, and the clean-up verify and `materialize` may do.

Apart from the store because checking reads everything and owns nothing: it takes the store's
listings and readers as arguments and reports one line per problem. Leftovers of interrupted
writes are told apart from live writes here: an unlocked local staging file, or an S3 multipart
upload older than a grace period (S3 has no locks).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from flywheel.data.errors import StoreError, translate
from flywheel.data.manifest import FileEntry, Manifest
from flywheel.data.refs import open_regular
from flywheel.data.transfer import STAGING, Transfer, copy_hashing

logger = logging.getLogger(__name__)


def artifact_problems(
    manifest_ids: list[str],
    strays: list[str],
    read_manifest: Callable[[str], Manifest],
    check_blob: Callable[[FileEntry, str], None],
    refs: Iterable[tuple[str, str | StoreError]],
) -> list[str]:
    """One line per stray object, unreadable manifest, missing parent, bad blob and dangling or bad ref."""
    problems = [f"unexpected object {stray} (not a <sha256>.json manifest)" for stray in strays]
    manifests: dict[str, Manifest] = {}
    for manifest_id in manifest_ids:
        try:
            manifests[manifest_id] = read_manifest(manifest_id)
        except StoreError as err:
            problems.append(str(err))
    checked: set[tuple[str, int]] = set()  # A blob is read once per size listed: `get` checks the size too.
    for manifest in manifests.values():
        problems += [
            f"manifest {manifest.id} names missing parent {parent}"
            for parent in manifest.parents
            if parent not in manifest_ids
        ]
        for relpath, entry in manifest.files.items():
            if (entry.sha256, entry.size) in checked:
                continue
            checked.add((entry.sha256, entry.size))
            try:
                check_blob(entry, f"({manifest.kind}/{manifest.name}:{relpath})")
            except StoreError as err:
                problems.append(str(err))
    for name, target in refs:
        if isinstance(target, StoreError):
            problems.append(str(target))
        elif target not in manifest_ids:
            problems.append(f"ref '{name}' points to missing manifest {target}")
    return problems


def staging_problems(transfer: Transfer, clean: bool, grace_s: float) -> list[str]:
    """Leftovers of killed writes: unlocked files in tmp/ (local), stale multipart uploads (S3); or remove them."""
    if transfer.local:
        return _local_staging_problems(transfer.staging, clean)
    problems = []
    bucket, _, prefix = transfer.root.partition("/")
    cutoff = datetime.now(UTC) - timedelta(seconds=grace_s)
    for upload in _multipart_uploads(transfer, bucket, f"{prefix}/" if prefix else ""):
        if upload["Initiated"] > cutoff:
            continue
        if clean:
            abort = functools.partial(
                transfer.fs.call_s3,
                "abort_multipart_upload",
                Bucket=bucket,
                Key=upload["Key"],
                UploadId=upload["UploadId"],
            )
            translate(transfer.url, abort)
            logger.info("aborted unfinished upload of %s", upload["Key"])
        else:
            problems.append(
                f"unfinished upload of {upload['Key']} since {upload['Initiated']:%Y-%m-%d %H:%M} "
                "from an interrupted write: verify with clean_staging aborts it"
            )
    return problems


def _multipart_uploads(transfer: Transfer, bucket: str, prefix: str) -> Iterator[dict[str, Any]]:
    """Every unfinished multipart upload under `prefix`, page by page."""
    after: dict[str, str] = {}
    while True:
        page = translate(
            transfer.url,
            functools.partial(transfer.fs.call_s3, "list_multipart_uploads", Bucket=bucket, Prefix=prefix, **after),
        )
        yield from page.get("Uploads", [])
        if not page.get("IsTruncated"):
            return
        after = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}


def _local_staging_problems(staging: Path, clean: bool) -> list[str]:
    """Unlocked files in tmp/, or remove them; never through a link, so nothing outside the store is touched."""
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    except OSError as err:
        what = "a symlink" if staging.is_symlink() else f"unusable ({err.strerror})"
        return [f"staging folder {STAGING}/ is {what}: verify leaves it alone; replace it with a plain folder"]
    try:
        return [problem for name in sorted(os.listdir(fd)) if (problem := _staged_leftover(fd, name, clean))]
    finally:
        os.close(fd)


def _staged_leftover(staging_fd: int, name: str, clean: bool) -> str | None:
    """The problem line for one entry of tmp/ (None: a live write, or removed); links are removed, never followed."""
    if _held_by_writer(staging_fd, name):
        return None
    try:
        info = os.stat(name, dir_fd=staging_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None  # A write that finished meanwhile.
    if not clean:
        return (
            f"staging leftover {STAGING}/{name} ({info.st_size} bytes) "
            "from an interrupted write: verify with clean_staging removes it"
        )
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, ignore_errors=True, dir_fd=staging_fd)  # Its fd-based walk never follows a link.
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=staging_fd)  # A link itself, never its target.
    logger.info("removed staging leftover %s/%s", STAGING, name)
    return None


def _held_by_writer(staging_fd: int, name: str) -> bool:
    """True while a live writer holds the staging file's lock (a killed writer's lock is gone)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=staging_fd)
    except OSError:
        return False  # A link or something unreadable: no writer of ours made it.
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def copy_matches(folder: Path, manifest: Manifest) -> bool:
    """True if `folder` holds exactly the manifest's files (regular files, right bytes) and nothing else."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    found = {}
    for parent, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if Path(parent, d).is_symlink()]:
            found[Path(parent, name).relative_to(folder).as_posix()] = Path(parent, name)
    if found.keys() != manifest.files.keys():
        return False
    for relpath, path in found.items():
        try:
            with open_regular(path, str(path)) as source:
                digest, size = copy_hashing(source, None, None)
        except StoreError:
            return False
        if (digest, size) != (manifest.files[relpath].sha256, manifest.files[relpath].size):
            return False
    return True


def discard(path: Path) -> None:
    """Remove a file, link or folder; a folder is first renamed aside so it never looks half-deleted."""
    if path.is_dir() and not path.is_symlink():
        aside = path.with_name(f".{path.name}.discard.{uuid.uuid4().hex[:8]}")
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
