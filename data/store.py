"""The artifact store: content-addressed blobs, self-addressed manifests and movable refs.

One fsspec code path serves `file://` (a local folder, the embedded default `./.flywheel`) and
`s3://bucket/prefix` (s3fs; endpoint and credentials from the usual AWS environment variables).

Layout under the root::

    blobs/sha256/ab/abcdef...      immutable file contents, named by their sha256
    manifests/<id>.json            immutable manifests, named by the sha256 of their bytes
    refs/<name>.json               movable pointers (`champion`, `model/smollm2`, user tags)
    tmp/                           local writes in progress (flocked while live), renamed into place
    prefect-results/               the flows' task cache (see flows/dispatch.py), nothing else reads it

Writes go blobs -> manifest -> ref, each fsynced (file and folder) before the next starts, so a
crash at any point leaves no ref to a missing manifest and no manifest with a missing blob; at
worst an unreferenced blob or a staging leftover remains, which `verify` reports and can clean.
Everything read back is checked: names, manifest paths, object types and sizes, and hashes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import itertools
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
from fsspec.asyn import sync
from pydantic import ValidationError

from data.errors import ArtifactNotFound, CorruptBlobError, StoreError
from data.manifest import FileEntry, Manifest, check_relpaths
from data.refs import (
    LocalRefBackend,
    RefBackend,
    S3RefBackend,
    check_ref_name,
    open_regular,
    publish,
    read_local_object,
    read_s3_object,
    staged_file,
    update_ref,
)

DEFAULT_STORE = "./.flywheel"
STORE_ENV = "FLYWHEEL_STORE"
STAGING = "tmp"
_CHUNK = 8 * 1024 * 1024  # Local copy and hash step.
_PART = 32 * 1024 * 1024  # S3 multipart part and ranged-GET size, sent or fetched 8 at a time.
_SINGLE_PUT_MAX = 100 * 1024 * 1024  # Below this one PUT, as s3fs itself does (2 x its 50 MiB part).
_MAX_PARTS = 10_000
_S3_CONCURRENCY = 8
_MIN_PREFIX = 6
_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK, errno.EOPNOTSUPP, errno.EXDEV}  # As shutil.
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KIND = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")

logger = logging.getLogger(__name__)

# A file, a directory, or {relative path: content (bytes or text) | local file (Path)}.
Source = str | os.PathLike[str] | Mapping[str, bytes | str | os.PathLike[str]]
Progress = Callable[[int], None]
Writer = Callable[[bytes], Any]


class ArtifactStore:
    """Immutable artifacts with lineage in a local folder or an S3 prefix."""

    def __init__(self, url: str | os.PathLike[str] | None = None, **storage_options: Any) -> None:
        url = os.fspath(url) if url is not None else os.environ.get(STORE_ENV, DEFAULT_STORE)
        protocol, _, rest = url.partition("://") if "://" in url else ("file", "", url)
        if protocol not in ("file", "s3"):
            raise StoreError(f"unsupported store URL '{url}': use a local path, file://PATH or s3://BUCKET/PREFIX")
        self.url = url
        self.local = protocol == "file"
        if self.local:
            self.fs = fsspec.filesystem("file")
            self.root = str(Path(rest).expanduser().resolve())
            os.makedirs(self.root, exist_ok=True)
            self._refs: RefBackend = LocalRefBackend(Path(self.root, "refs"), Path(self.root, STAGING))
        else:
            if not rest.strip("/"):
                raise StoreError(f"store URL '{url}' names no bucket: use s3://BUCKET/PREFIX")
            # Other processes write to the same prefix (stages run on other workers): never trust a cached listing.
            self.fs = fsspec.filesystem("s3", **{"use_listings_cache": False, **storage_options})
            self.root = rest.strip("/")
            self._check_bucket()
            self._refs = S3RefBackend(self.fs, f"{self.root}/refs")

    def __repr__(self) -> str:
        return f"ArtifactStore({self.url!r})"

    # -- blobs ----------------------------------------------------------------------------------

    def _blob_path(self, digest: str) -> str:
        return f"{self.root}/blobs/sha256/{digest[:2]}/{digest}"

    def put_file(self, path: str | os.PathLike[str], progress: Progress | None = None) -> FileEntry:
        """Store one local file as a blob (de-duplicated by content) and return its entry.

        The bytes hashed are the bytes stored, and a file that changes meanwhile is refused rather
        than stored torn.
        """
        path = Path(path)
        before = _source_state(path)
        if self.local:
            return self._put_local_file(path, before, progress)
        return self._put_s3_file(path, before, progress)

    def _put_local_file(self, path: Path, before: os.stat_result, progress: Progress | None) -> FileEntry:
        with staged_file(Path(self.root, STAGING)) as (staged, handle), open(path, "rb") as source:
            digest, size = _copy_file_hashing(source, handle, progress)
            _check_unchanged(path, before)
            self._publish_blob(staged, handle, digest, size)
        return FileEntry(sha256=digest, size=size)

    def _put_s3_file(self, path: Path, before: os.stat_result, progress: Progress | None) -> FileEntry:
        # The key is the hash, so hashing must finish before the upload starts.
        if before.st_size < _SINGLE_PUT_MAX:  # One read into memory: the bytes hashed are the bytes sent.
            chunks: list[bytes] = []
            with open(path, "rb") as source:
                digest, _ = _copy_hashing(source, chunks.append, None)
            _check_unchanged(path, before)
            entry = self._put_hashed_bytes(b"".join(chunks), digest)
        else:  # Too big for memory: hash, then upload in parts that are hashed again as they are sent.
            with open(path, "rb") as source:
                digest, _ = _copy_hashing(source, None, None)
            entry = FileEntry(sha256=digest, size=before.st_size)
            key = self._blob_path(digest)
            if not self._object_present(key, entry.size):
                self._translate(lambda: sync(self.fs.loop, self._upload, path, before, key, digest, progress))
                return entry
        if progress is not None:
            progress(entry.size)
        return entry

    def put_bytes(self, data: bytes) -> FileEntry:
        """Store a small in-memory payload as a blob."""
        return self._put_hashed_bytes(data, hashlib.sha256(data).hexdigest())

    def _put_hashed_bytes(self, data: bytes, digest: str) -> FileEntry:
        key = self._blob_path(digest)
        if not self._object_present(key, len(data)):
            self._write_atomic(key, data)
        return FileEntry(sha256=digest, size=len(data))

    def _object_present(self, key: str, size: int) -> bool:
        """De-duplication: an object of the right size is kept; a missing or truncated one is (re)written."""
        if self.local:
            try:
                info = os.lstat(key)
            except FileNotFoundError:
                return False
            return stat.S_ISREG(info.st_mode) and info.st_size == size
        try:
            return self._translate(lambda: self.fs.info(key))["size"] == size
        except FileNotFoundError:
            return False

    def _publish_blob(self, staged: Path, handle: BinaryIO, digest: str, size: int) -> None:
        final = Path(self._blob_path(digest))
        if not self._object_present(str(final), size):
            publish(staged, handle, final)

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

    def read_blob(self, entry: FileEntry, label: str = "") -> bytes:
        """Read a blob fully into memory, verifying its hash."""
        buffer = io.BytesIO()
        self._stream_blob(entry, label, buffer)
        return buffer.getvalue()

    def _stream_blob(
        self, entry: FileEntry, label: str, out: BinaryIO | None, progress: Progress | None = None
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
                    digest, size = _copy_hashing(source, write, progress)
        else:
            digest, size = self._translate(
                lambda: sync(self.fs.loop, self._download, key, entry.size, write, progress, what), missing=what
            )
        if digest != entry.sha256 or size != entry.size:
            raise CorruptBlobError(f"{what} is corrupted: its {size} bytes hash to {digest[:12]}…")

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

    def _get_blob(self, entry: FileEntry, dest: Path, label: str, progress: Progress | None) -> None:
        """Copy a blob to `dest` atomically, verifying its hash; a bad blob leaves `dest` untouched."""
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        except OSError as err:
            raise StoreError(f"cannot write '{dest}': {err.strerror}") from err
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                self._stream_blob(entry, label, out, progress)
            os.replace(tmp, dest)
        except OSError as err:
            raise StoreError(f"cannot copy {label} to '{dest}': {err.strerror}") from err
        finally:
            tmp.unlink(missing_ok=True)

    # -- artifacts ------------------------------------------------------------------------------

    def put(
        self,
        kind: str,
        name: str,
        source: Source,
        *,
        parents: list[str] | tuple[str, ...] = (),
        params: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        progress: Progress | None = None,
    ) -> Manifest:
        """Store a file, a directory, or a {relpath: bytes|path} mapping as a new artifact.

        The ref `kind/name` then points at it. Names, paths, parents and the current ref are all
        checked first, so bad input fails before any byte is written.
        """
        if not _KIND.fullmatch(kind):
            raise StoreError(f"invalid kind '{kind}': use letters, digits, '-', '_', '.' (no '/')")
        ref_name = f"{kind}/{name}"
        check_ref_name(ref_name)
        items = _source_items(source)
        parent_ids = [self.resolve(parent) for parent in parents]
        seen = self._translate(lambda: self._refs.read(ref_name))  # A corrupt ref fails now, not after the upload.
        files: dict[str, FileEntry] = {}
        for relpath, item in items:
            files[relpath] = self.put_bytes(item) if isinstance(item, bytes) else self.put_file(item, progress)
        manifest = Manifest(
            kind=kind,
            name=name,
            files=files,
            parents=parent_ids,
            params=dict(params or {}),
            metrics=dict(metrics or {}),
        )
        self._write_atomic(self._manifest_path(manifest.id), manifest.canonical_bytes())
        self._translate(lambda: update_ref(self._refs, ref_name, manifest.id, lambda _current: True, seen))
        return manifest

    def get(self, ref: str, dest: str | os.PathLike[str], progress: Progress | None = None) -> Path:
        """Materialise an artifact's files under `dest` (a directory), each verified and atomic."""
        manifest = self.manifest(ref)
        dest = Path(dest)
        try:
            dest.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"cannot write to '{dest}': {err.strerror}") from err
        root = dest.resolve()
        for relpath, entry in manifest.files.items():
            target = dest / relpath
            if not target.resolve().is_relative_to(root):  # Paths are checked; this catches links inside dest.
                raise StoreError(f"refusing to write '{target}': it leads outside '{dest}'")
            self._get_blob(entry, target, f"({manifest.kind}/{manifest.name}:{relpath})", progress)
        return dest

    def materialize(self, ref: str, cache_dir: str | os.PathLike[str]) -> Path:
        """A local, verified copy of an artifact at `cache_dir/<id>`; a cached copy is re-hashed before reuse."""
        manifest = self.manifest(ref)
        target = Path(cache_dir) / manifest.id
        if target.exists() or target.is_symlink():
            if _copy_matches(target, manifest):
                return target
            logger.warning("cached copy %s does not match its manifest: fetching it again", target)
            _discard(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{manifest.id[:12]}."))
        try:
            self.get(manifest.id, staging)
            try:
                os.rename(staging, target)
            except OSError:
                if not target.is_dir():  # Not a concurrent materialisation of the same id.
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def read_bytes(self, ref: str, relpath: str) -> bytes:
        """One file of an artifact, verified."""
        manifest = self.manifest(ref)
        entry = manifest.files.get(relpath)
        if entry is None:
            raise ArtifactNotFound(
                f"artifact {manifest.kind}/{manifest.name} ({manifest.id[:12]}) has no file '{relpath}'; "
                f"it has: {', '.join(sorted(manifest.files)) or 'no files'}"
            )
        return self.read_blob(entry, f"({manifest.kind}/{manifest.name}:{relpath})")

    def read_json(self, ref: str, relpath: str) -> Any:
        """One JSON file of an artifact, parsed."""
        return json.loads(self.read_bytes(ref, relpath))

    # -- manifests and refs ---------------------------------------------------------------------

    def _manifest_path(self, manifest_id: str) -> str:
        return f"{self.root}/manifests/{manifest_id}.json"

    def manifest_url(self, ref: str) -> str:
        """The manifest's URL (`file://` or `s3://`): what links in reports and in the UI point at."""
        return self.fs.unstrip_protocol(self._manifest_path(self.resolve(ref)))

    @property
    def root_url(self) -> str:
        """The store's absolute URL (`file:///abs/path` or `s3://bucket/prefix`), the same from any cwd."""
        return self.fs.unstrip_protocol(self.root)

    def sibling_url(self, name: str) -> str:
        """URL of a folder beside blobs/manifests/refs, for state that must live and die with the store."""
        return f"{self.root_url}/{name}"

    def manifest(self, ref: str) -> Manifest:
        """The manifest a ref, id or id prefix points to (a full id is read in one request)."""
        if _SHA256.fullmatch(ref):
            with contextlib.suppress(ArtifactNotFound):
                return self._read_manifest(ref)
        return self._read_manifest(self.resolve(ref))

    def _read_manifest(self, manifest_id: str) -> Manifest:
        """A manifest whose bytes match its id and whose paths all stay inside the artifact."""
        path, what = self._manifest_path(manifest_id), f"manifest {manifest_id}"
        if self.local:
            raw = read_local_object(Path(path), what)
        else:
            raw = self._translate(lambda: read_s3_object(self.fs, *path.split("/", 1), what))[0]
        if hashlib.sha256(raw).hexdigest() != manifest_id:
            raise CorruptBlobError(f"{what} is corrupted: its bytes no longer match")
        try:
            return Manifest.model_validate_json(raw)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise CorruptBlobError(f"{what} is not a valid manifest: {where}: {first['msg']}") from err

    def resolve(self, ref: str) -> str:
        """Turn a ref name, `kind/name`, a manifest id or a unique id prefix into a manifest id."""
        ref = ref.strip()
        if not ref:
            raise ArtifactNotFound("empty artifact ref")
        try:
            check_ref_name(ref)
        except StoreError:
            pass  # Cannot be a ref (e.g. `../x`): only an id could still match.
        else:
            value, _ = self._translate(lambda: self._refs.read(ref))
            if value is not None:
                return value["target"]
        if _SHA256.fullmatch(ref) and self._exists(self._manifest_path(ref)):
            return ref
        if all(c in "0123456789abcdef" for c in ref) and len(ref) >= _MIN_PREFIX:
            matches = [mid for mid in self._manifest_listing()[0] if mid.startswith(ref)]
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise ArtifactNotFound(f"id prefix '{ref}' is ambiguous: {len(matches)} manifests match")
        known = ", ".join(sorted(name for name, _ in self._scan_refs())[:10]) or "none yet"
        raise ArtifactNotFound(f"unknown artifact ref '{ref}' in {self.url} (refs: {known})")

    def try_resolve(self, *refs: str) -> str | None:
        """The manifest id of the first ref that exists, else None (e.g. `model/<spec>`, then `<spec>`)."""
        for ref in refs:
            try:
                return self.resolve(ref)
            except ArtifactNotFound:
                continue
        return None

    def set_ref(self, name: str, target: str, expected: str | object | None = ...) -> None:
        """Point ref `name` at `target` (a ref or id). With `expected`, only if it currently points there.

        `expected=None` means the ref must not exist yet; leaving it out moves the ref
        unconditionally (still atomically, so concurrent moves are all recorded in its history).
        """
        check_ref_name(name)
        target_id = self.resolve(target)
        check = (lambda _current: True) if expected is ... else expected
        self._translate(lambda: update_ref(self._refs, name, target_id, check))  # type: ignore[arg-type]

    def ref_history(self, name: str) -> list[dict[str, str]]:
        """Every target the ref has had, oldest first."""
        value, _ = self._translate(lambda: self._refs.read(check_ref_name(name)))
        if value is None:
            raise ArtifactNotFound(f"unknown ref '{name}' in {self.url}")
        return value["history"]

    def refs(self) -> dict[str, str]:
        """All refs and the manifest id each points to; a bad ref raises an error naming it."""
        out = {}
        for name, target in self._scan_refs():
            if isinstance(target, StoreError):
                raise target
            out[name] = target
        return out

    def _scan_refs(self) -> Iterator[tuple[str, str | StoreError]]:
        """(name, target or the error reading it) for every object under refs/."""
        prefix = f"{self.root}/refs/"
        for path in self._find(prefix):
            if not path.endswith(".json"):
                continue  # `.lock` files beside local refs.
            name = path[len(prefix) : -len(".json")]
            try:
                check_ref_name(name)
                value, _ = self._translate(functools.partial(self._refs.read, name))
                yield name, value["target"] if value else ArtifactNotFound(f"ref '{name}' vanished while listed")
            except StoreError as err:
                yield name, err

    def list(self, kind: str | None = None) -> list[Manifest]:
        """Every manifest (optionally of one kind), oldest first."""
        manifests = [self._read_manifest(mid) for mid in self._manifest_listing()[0]]
        return sorted((m for m in manifests if kind is None or m.kind == kind), key=lambda m: m.created)

    def _manifest_listing(self) -> tuple[list[str], list[str]]:
        """Manifest ids, and the names under manifests/ that are not `<sha256>.json`."""
        ids, strays = [], []
        for path in self._find(f"{self.root}/manifests/"):
            name = path.rsplit("/", 1)[-1]
            if name.endswith(".json") and _SHA256.fullmatch(name[: -len(".json")]):
                ids.append(name[: -len(".json")])
            else:
                strays.append(path[len(self.root) + 1 :])
        return ids, strays

    # -- integrity ------------------------------------------------------------------------------

    def verify(self, clean_staging: bool = False, staging_grace_s: float = 3600.0) -> list[str]:
        """Check every manifest, blob, ref and staging area; return one line per problem (empty: all good).

        Leftovers of interrupted writes are problems; `clean_staging=True` removes them instead.
        A local staging file is a leftover once no writer holds its lock; S3 has no locks, so an
        unfinished multipart upload is one once it is older than `staging_grace_s`.
        """
        ids, strays = self._manifest_listing()
        problems = [f"unexpected object {stray} (not a <sha256>.json manifest)" for stray in strays]
        manifests: dict[str, Manifest] = {}
        for manifest_id in ids:
            try:
                manifests[manifest_id] = self._read_manifest(manifest_id)
            except StoreError as err:
                problems.append(str(err))
        checked: set[str] = set()
        for manifest in manifests.values():
            problems += [
                f"manifest {manifest.id} names missing parent {parent}"
                for parent in manifest.parents
                if parent not in ids
            ]
            for relpath, entry in manifest.files.items():
                if entry.sha256 in checked:
                    continue
                checked.add(entry.sha256)
                try:
                    self._stream_blob(entry, f"({manifest.kind}/{manifest.name}:{relpath})", None)
                except StoreError as err:
                    problems.append(str(err))
        for name, target in self._scan_refs():
            if isinstance(target, StoreError):
                problems.append(str(target))
            elif target not in ids:
                problems.append(f"ref '{name}' points to missing manifest {target}")
        return problems + self._staging_problems(clean_staging, staging_grace_s)

    def _staging_problems(self, clean: bool, grace_s: float) -> list[str]:
        """Leftovers of killed writes: unlocked files in tmp/ (local), stale multipart uploads (S3)."""
        problems = []
        if self.local:
            staging = Path(self.root, STAGING)
            for entry in sorted(staging.iterdir()) if staging.is_dir() else []:
                if _held_by_writer(entry):
                    continue
                if clean:
                    _discard(entry)
                    logger.info("removed staging leftover %s", entry)
                else:
                    problems.append(
                        f"staging leftover {STAGING}/{entry.name} ({entry.lstat().st_size} bytes) "
                        "from an interrupted write: verify with clean_staging removes it"
                    )
            return problems
        bucket, _, prefix = self.root.partition("/")
        cutoff = datetime.now(UTC) - timedelta(seconds=grace_s)
        for upload in self._multipart_uploads(bucket, f"{prefix}/" if prefix else ""):
            if upload["Initiated"] > cutoff:
                continue
            if clean:
                abort = functools.partial(
                    self.fs.call_s3,
                    "abort_multipart_upload",
                    Bucket=bucket,
                    Key=upload["Key"],
                    UploadId=upload["UploadId"],
                )
                self._translate(abort)
                logger.info("aborted unfinished upload of %s", upload["Key"])
            else:
                problems.append(
                    f"unfinished upload of {upload['Key']} since {upload['Initiated']:%Y-%m-%d %H:%M} "
                    "from an interrupted write: verify with clean_staging aborts it"
                )
        return problems

    def _multipart_uploads(self, bucket: str, prefix: str) -> Iterator[dict[str, Any]]:
        """Every unfinished multipart upload under `prefix`, page by page."""
        after: dict[str, str] = {}
        while True:
            page = self._translate(
                functools.partial(self.fs.call_s3, "list_multipart_uploads", Bucket=bucket, Prefix=prefix, **after)
            )
            yield from page.get("Uploads", [])
            if not page.get("IsTruncated"):
                return
            after = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    # -- fsspec plumbing ------------------------------------------------------------------------

    def _exists(self, key: str) -> bool:
        return self._translate(lambda: self.fs.exists(key))

    def _find(self, prefix: str) -> list[str]:
        """Every object under `prefix`; locally also FIFOs, links and folders named like an object (`*.json`)."""
        if self.local:
            found = []
            for folder, dirs, names in os.walk(prefix.rstrip("/")):
                objects = [d for d in dirs if d.endswith(".json")]
                dirs[:] = [d for d in dirs if d not in objects]
                found += [f"{folder}/{name}" for name in names + objects]
            return sorted(found)
        return self._translate(lambda: self.fs.find(prefix, refresh=True) if self.fs.exists(prefix) else [])

    def _write_atomic(self, key: str, data: bytes) -> None:
        """Whole-object write: staged, fsynced and renamed locally (an existing object is kept), a single PUT on S3."""
        if self.local:
            with staged_file(Path(self.root, STAGING)) as (staged, handle):
                handle.write(data)
                if not self._object_present(key, len(data)):
                    publish(staged, handle, Path(key))
        else:
            self._translate(lambda: self.fs.pipe_file(key, data))

    def _check_bucket(self) -> None:
        bucket = self.root.split("/", 1)[0]
        self._translate(lambda: self.fs.call_s3("head_bucket", Bucket=bucket), missing=f"S3 bucket '{bucket}' of store")

    def _translate(self, call: Callable[[], Any], missing: str | None = None) -> Any:
        """Run an fsspec call, turning transport and credential failures into one-line StoreErrors."""
        try:
            return call()
        except StoreError:
            raise
        except FileNotFoundError as err:
            if missing is None:
                raise
            raise ArtifactNotFound(f"{missing} is missing from {self.url}") from err
        except Exception as err:  # botocore raises many unrelated classes; name the cause.
            name = type(err).__name__
            if name == "NoCredentialsError":
                raise StoreError(
                    f"no S3 credentials for {self.url}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
                ) from err
            if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"):
                endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                raise StoreError(f"cannot reach the S3 endpoint {endpoint or '(AWS default)'} for {self.url}") from err
            if isinstance(err, PermissionError):
                raise StoreError(f"access denied to {self.url}: {err}") from err
            raise


def _copy_hashing(source: BinaryIO, write: Writer | None, progress: Progress | None) -> tuple[str, int]:
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


def _copy_file_hashing(source: BinaryIO, dest: BinaryIO, progress: Progress | None) -> tuple[str, int]:
    """Copy file to file in the kernel (shutil's sendfile path), hashing each chunk read back from `dest`.

    What gets hashed is the copy itself, at the cost of one memory copy per byte rather than two
    for read+write; a second core hashes chunk k while the kernel copies chunk k+1. Where the
    system cannot sendfile between these files, it falls back to read + write, as shutil does.
    """
    in_fd, out_fd = source.fileno(), dest.fileno()
    digest = hashlib.sha256()
    size = 0
    hashed: Future[None] | None = None

    def hash_back(offset: int, length: int) -> None:
        digest.update(os.pread(out_fd, length, offset))

    with ThreadPoolExecutor(1) as pool:
        while True:
            try:
                sent = os.sendfile(out_fd, in_fd, None, _CHUNK)
            except OSError as err:
                if size or err.errno not in _NO_SENDFILE:
                    raise
                return _copy_hashing(source, dest.write, progress)
            if not sent:
                break
            if hashed is not None:
                hashed.result()
            hashed = pool.submit(hash_back, size, sent)
            size += sent
            if progress is not None:
                progress(sent)
        if hashed is not None:
            hashed.result()
    return digest.hexdigest(), size


def _source_state(path: Path) -> os.stat_result:
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


def _held_by_writer(path: Path) -> bool:
    """True while a live writer holds the staging file's lock (a killed writer's lock is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # A link or something unreadable: no writer of ours made it.
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _copy_matches(folder: Path, manifest: Manifest) -> bool:
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
                digest, size = _copy_hashing(source, None, None)
        except StoreError:
            return False
        if (digest, size) != (manifest.files[relpath].sha256, manifest.files[relpath].size):
            return False
    return True


def _discard(path: Path) -> None:
    """Remove a file, link or folder; a folder is first renamed aside so it never looks half-deleted."""
    if path.is_dir() and not path.is_symlink():
        aside = path.with_name(f".{path.name}.discard.{uuid.uuid4().hex[:8]}")
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _source_items(source: Source) -> list[tuple[str, bytes | Path]]:
    """(relative path, bytes or local file) pairs for a file, a directory or a mapping, all checked."""
    if isinstance(source, Mapping):
        items = [
            (relpath, item.encode() if isinstance(item, str) else item if isinstance(item, bytes) else Path(item))
            for relpath, item in source.items()
        ]
    else:
        path = Path(source)
        if path.is_file():
            items = [(path.name, path)]
        elif path.is_dir():
            items = [(file.relative_to(path).as_posix(), file) for file in sorted(path.rglob("*")) if file.is_file()]
        else:
            raise StoreError(f"cannot store '{path}': no such file or directory")
    try:
        check_relpaths(relpath for relpath, _ in items)
    except ValueError as err:
        raise StoreError(str(err)) from None
    for _, item in items:
        if isinstance(item, Path):
            _source_state(item)
    return items
