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

This module is the `ArtifactStore` facade and what it alone knows: the layout, manifests and refs.
Moving bytes (hashed copies, S3 parts and ranged GETs) is `data/transfer.py`'s job; what `verify`
checks and the clean-up it may do are `data/verify.py`'s, so each can be read on its own.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import fsspec
from pydantic import ValidationError

from flywheel.data.costs import cost_metrics
from flywheel.data.errors import ArtifactNotFound, CorruptBlobError, StoreError, translate
from flywheel.data.manifest import FileEntry, Manifest, check_kind, check_relpaths
from flywheel.data.refs import (
    LocalRefBackend,
    RefBackend,
    S3RefBackend,
    check_ref_name,
    read_local_object,
    read_s3_object,
    update_ref,
)
from flywheel.data.transfer import STAGING, Progress, Transfer, source_state
from flywheel.data.verify import artifact_problems, copy_matches, discard, staging_problems

DEFAULT_STORE = "./.flywheel"
STORE_ENV = "FLYWHEEL_STORE"
_MIN_PREFIX = 6
_SHA256 = re.compile(r"[0-9a-f]{64}")

logger = logging.getLogger(__name__)

# A file, a directory, or {relative path: content (bytes or text) | local file (Path) | a blob
# already in the store (another artifact's FileEntry: composed without copying a byte)}.
Source = str | os.PathLike[str] | Mapping[str, bytes | str | os.PathLike[str] | FileEntry]


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
        self._transfer = Transfer(self.fs, self.url, self.root, self.local, self._blob_path)

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
        return self._transfer.put_file(Path(path), progress)

    def put_bytes(self, data: bytes) -> FileEntry:
        """Store a small in-memory payload as a blob."""
        return self._transfer.put_bytes(data)

    def read_blob(self, entry: FileEntry, label: str = "") -> bytes:
        """Read a blob fully into memory, verifying its hash."""
        buffer = io.BytesIO()
        self._transfer.stream_blob(entry, label, buffer)
        return buffer.getvalue()

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
        checked first, so bad input fails before any byte is written. Inside `track_costs()` the
        metrics gain the process's `peak_rss_mb`.
        """
        try:
            check_kind(kind)
        except ValueError as err:
            raise StoreError(str(err)) from None
        ref_name = f"{kind}/{name}"
        check_ref_name(ref_name)  # Stricter than the manifest's own name check, which every read repeats.
        items = _source_items(source)
        parent_ids = [self.resolve(parent) for parent in parents]
        seen = self._translate(lambda: self._refs.read(ref_name))  # A corrupt ref fails now, not after the upload.
        files: dict[str, FileEntry] = {}
        for relpath, item in items:
            if isinstance(item, FileEntry):
                self._check_blob(item, relpath)
                files[relpath] = item
            else:
                files[relpath] = self.put_bytes(item) if isinstance(item, bytes) else self.put_file(item, progress)
        manifest = Manifest(
            kind=kind,
            name=name,
            files=files,
            parents=parent_ids,
            params=dict(params or {}),
            metrics=cost_metrics() | dict(metrics or {}),
        )
        self._transfer.write_object(self._manifest_path(manifest.id), manifest.canonical_bytes())
        self._translate(lambda: update_ref(self._refs, ref_name, manifest.id, lambda _current: True, seen))
        return manifest

    def _check_blob(self, entry: FileEntry, relpath: str) -> None:
        """A file given as another artifact's entry names a blob of this store, at its size."""
        path = self._blob_path(entry.sha256)
        size = self._translate(lambda: self.fs.size(path) if self.fs.exists(path) else None)
        if size != entry.size:
            raise StoreError(
                f"'{relpath}' names blob {entry.sha256[:12]} of {entry.size} bytes, which this store lacks"
            )

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
            self._transfer.get_blob(entry, target, f"({manifest.kind}/{manifest.name}:{relpath})", progress)
        return dest

    def materialize(self, ref: str, cache_dir: str | os.PathLike[str]) -> Path:
        """A local, verified copy of an artifact at `cache_dir/<id>`; a cached copy is re-hashed before reuse."""
        manifest = self.manifest(ref)
        target = Path(cache_dir) / manifest.id
        if target.exists() or target.is_symlink():
            if copy_matches(target, manifest):
                return target
            logger.warning("cached copy %s does not match its manifest: fetching it again", target)
            discard(target)
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

    def file_urls(self, ref: str, suffix: str = "") -> list[str]:
        """URLs (`file://` or `s3://`) of an artifact's blobs whose paths end in `suffix`, in path order:
        `data_files` for a library that reads through fsspec, as `datasets.load_dataset` does. Read
        that way a blob is not hash-verified (`read_bytes` is)."""
        manifest = self.manifest(ref)
        return [
            self.fs.unstrip_protocol(self._blob_path(entry.sha256))
            for relpath, entry in sorted(manifest.files.items())
            if relpath.endswith(suffix)
        ]

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
            message = first["msg"].removeprefix("Value error, ")
            raise CorruptBlobError(f"{what} is not a valid manifest: {where}: {message}") from err

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
        problems = artifact_problems(ids, strays, self._read_manifest, self._transfer.stream_blob, self._scan_refs())
        return problems + staging_problems(self._transfer, clean_staging, staging_grace_s)

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

    def _check_bucket(self) -> None:
        bucket = self.root.split("/", 1)[0]
        self._translate(lambda: self.fs.call_s3("head_bucket", Bucket=bucket), missing=f"S3 bucket '{bucket}' of store")

    def _translate(self, call: Callable[[], Any], missing: str | None = None) -> Any:
        """Run an fsspec call on this store, its transport and credential failures as one-line StoreErrors."""
        return translate(self.url, call, missing)


def _source_items(source: Source) -> list[tuple[str, bytes | Path | FileEntry]]:
    """(relative path, bytes, local file or stored blob) pairs for a file, a directory or a mapping, all checked."""
    if isinstance(source, Mapping):
        items: list[tuple[str, bytes | Path | FileEntry]] = [
            (
                relpath,
                item.encode() if isinstance(item, str) else item if isinstance(item, bytes | FileEntry) else Path(item),
            )
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
            source_state(item)
    return items
