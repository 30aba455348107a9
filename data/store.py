"""The artifact store: content-addressed blobs, self-addressed manifests and movable refs.

One fsspec code path serves `file://` (a local folder, the embedded default `./.flywheel`) and
`s3://bucket/prefix` (s3fs; endpoint and credentials from the usual AWS environment variables).

Layout under the root::

    blobs/sha256/ab/abcdef...      immutable file contents, named by their sha256
    manifests/<id>.json            immutable manifests, named by the sha256 of their bytes
    refs/<name>.json               movable pointers (`champion`, `model/smollm2`, user tags)
    prefect-results/               the flows' task cache (see flows/dispatch.py), nothing else reads it

Writes go blobs -> manifest -> ref, so a crash at any point leaves no ref to a missing manifest
and no manifest with a missing blob; at worst an unreferenced blob remains.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
from pydantic import ValidationError

from data.errors import ArtifactNotFound, CorruptBlobError, StoreError
from data.manifest import FileEntry, Manifest
from data.refs import LocalRefBackend, RefBackend, S3RefBackend, update_ref

DEFAULT_STORE = "./.flywheel"
STORE_ENV = "FLYWHEEL_STORE"
_CHUNK = 8 * 1024 * 1024
_MIN_PREFIX = 6

# A file, a directory, or {relative path: content (bytes or text) | local file (Path)}.
Source = str | os.PathLike[str] | Mapping[str, bytes | str | os.PathLike[str]]
Progress = Callable[[int], None]


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
            self._refs: RefBackend = LocalRefBackend(Path(self.root, "refs"))
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
        """Store one local file as a blob (de-duplicated by content) and return its entry."""
        path = Path(path)
        size = path.stat().st_size
        if self.local:
            # Copy and hash in parallel (both release the GIL), then publish by atomic rename.
            staging = Path(self.root, "tmp")
            staging.mkdir(exist_ok=True)
            tmp = staging / uuid.uuid4().hex
            with ThreadPoolExecutor(1) as pool:
                digest_future = pool.submit(_sha256_file, path, progress)
                shutil.copyfile(path, tmp)
                digest = digest_future.result()
            final = Path(self._blob_path(digest))
            if final.exists():
                tmp.unlink()
            else:
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, final)
        else:
            digest = _sha256_file(path, progress)
            final_key = self._blob_path(digest)
            if not self._exists(final_key):
                self._translate(lambda: self.fs.put_file(str(path), final_key))
        return FileEntry(sha256=digest, size=size)

    def put_bytes(self, data: bytes) -> FileEntry:
        """Store a small in-memory payload as a blob."""
        digest = hashlib.sha256(data).hexdigest()
        key = self._blob_path(digest)
        if not self._exists(key):
            self._write_atomic(key, data)
        return FileEntry(sha256=digest, size=len(data))

    def read_blob(self, entry: FileEntry, label: str = "") -> bytes:
        """Read a blob fully into memory, verifying its hash."""
        key = self._blob_path(entry.sha256)
        data = self._translate(lambda: self.fs.cat_file(key), missing=f"blob {entry.sha256} {label}")
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise CorruptBlobError(f"blob {entry.sha256} {label} is corrupted: its bytes no longer match")
        return data

    def _get_blob(self, entry: FileEntry, dest: Path, label: str, progress: Progress | None) -> None:
        """Copy a blob to `dest` atomically, verifying its hash; a bad blob leaves `dest` untouched."""
        key = self._blob_path(entry.sha256)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            if self.local:
                if not os.path.exists(key):
                    raise ArtifactNotFound(f"blob {entry.sha256} {label} is missing from {self.url}")
                with ThreadPoolExecutor(1) as pool:
                    digest_future = pool.submit(_sha256_file, Path(key), progress)
                    shutil.copyfile(key, tmp)
                    digest = digest_future.result()
            else:
                self._translate(lambda: self.fs.get_file(key, str(tmp)), missing=f"blob {entry.sha256} {label}")
                digest = _sha256_file(tmp, progress)
            if digest != entry.sha256:
                raise CorruptBlobError(f"blob {entry.sha256} {label} is corrupted: its bytes hash to {digest[:12]}…")
            os.replace(tmp, dest)
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

        The ref `kind/name` then points at it. Parents are resolved to manifest ids first, so a
        bad parent fails before any byte is written.
        """
        _check_name(kind, "kind")
        _check_name(name, "name", allow_slash=True)
        parent_ids = [self.resolve(parent) for parent in parents]
        files: dict[str, FileEntry] = {}
        for relpath, item in _iter_source(source):
            files[relpath] = self.put_bytes(item) if isinstance(item, bytes) else self.put_file(item, progress)
        manifest = Manifest(
            kind=kind,
            name=name,
            files=files,
            parents=parent_ids,
            params=dict(params or {}),
            metrics=dict(metrics or {}),
        )
        self._write_atomic(self._manifest_path(manifest.id), manifest.canonical_bytes(), create_only=True)
        self.set_ref(f"{kind}/{name}", manifest.id)
        return manifest

    def get(self, ref: str, dest: str | os.PathLike[str], progress: Progress | None = None) -> Path:
        """Materialise an artifact's files under `dest` (a directory), each verified and atomic."""
        manifest = self.manifest(ref)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        for relpath, entry in manifest.files.items():
            self._get_blob(entry, dest / relpath, f"({manifest.kind}/{manifest.name}:{relpath})", progress)
        return dest

    def materialize(self, ref: str, cache_dir: str | os.PathLike[str]) -> Path:
        """A local, verified copy of an artifact at `cache_dir/<id>`, downloaded once and reused."""
        manifest = self.manifest(ref)
        target = Path(cache_dir) / manifest.id
        if target.is_dir():
            return target
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
        """The manifest a ref, id or id prefix points to."""
        manifest_id = self.resolve(ref)
        raw = self._translate(
            lambda: self.fs.cat_file(self._manifest_path(manifest_id)), missing=f"manifest {manifest_id}"
        )
        if hashlib.sha256(raw).hexdigest() != manifest_id:
            raise CorruptBlobError(f"manifest {manifest_id} is corrupted: its bytes no longer match")
        try:
            return Manifest.model_validate_json(raw)
        except ValidationError as err:
            raise CorruptBlobError(f"manifest {manifest_id} is not a valid manifest: {err}") from err

    def resolve(self, ref: str) -> str:
        """Turn a ref name, `kind/name`, a manifest id or a unique id prefix into a manifest id."""
        ref = ref.strip()
        if not ref:
            raise ArtifactNotFound("empty artifact ref")
        value, _ = self._translate(lambda: self._refs.read(ref))
        if value is not None:
            return value["target"]
        if all(c in "0123456789abcdef" for c in ref) and len(ref) >= _MIN_PREFIX:
            matches = [mid for mid in self._manifest_ids() if mid.startswith(ref)]
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise ArtifactNotFound(f"id prefix '{ref}' is ambiguous: {len(matches)} manifests match")
        known = ", ".join(sorted(self.refs())[:10]) or "none yet"
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
        _check_name(name, "ref", allow_slash=True)
        target_id = self.resolve(target)
        check = (lambda _current: True) if expected is ... else expected
        update_ref(self._refs, name, target_id, check)  # type: ignore[arg-type]

    def ref_history(self, name: str) -> list[dict[str, str]]:
        """Every target the ref has had, oldest first."""
        value, _ = self._translate(lambda: self._refs.read(name))
        if value is None:
            raise ArtifactNotFound(f"unknown ref '{name}' in {self.url}")
        return value["history"]

    def refs(self) -> dict[str, str]:
        """All refs and the manifest id each points to."""
        prefix = f"{self.root}/refs/"
        out = {}
        for path in self._find(prefix):
            if path.endswith(".json"):
                name = path[len(prefix) : -len(".json")]
                value, _ = self._refs.read(name)
                if value is not None:
                    out[name] = value["target"]
        return out

    def list(self, kind: str | None = None) -> list[Manifest]:
        """Every manifest (optionally of one kind), oldest first."""
        manifests = [self.manifest(mid) for mid in self._manifest_ids()]
        return sorted((m for m in manifests if kind is None or m.kind == kind), key=lambda m: m.created)

    def _manifest_ids(self) -> list[str]:
        return [Path(p).stem for p in self._find(f"{self.root}/manifests/") if p.endswith(".json")]

    # -- integrity ------------------------------------------------------------------------------

    def verify(self) -> list[str]:
        """Check every manifest, blob and ref; return one line per problem (empty: all good)."""
        problems: list[str] = []
        manifests: dict[str, Manifest] = {}
        for manifest_id in self._manifest_ids():
            try:
                manifests[manifest_id] = self.manifest(manifest_id)
            except StoreError as err:
                problems.append(str(err))
        for manifest in manifests.values():
            for parent in manifest.parents:
                if parent not in manifests:
                    problems.append(f"manifest {manifest.id[:12]} names missing parent {parent[:12]}")
            for relpath, entry in manifest.files.items():
                try:
                    self._verify_blob(entry, f"({manifest.kind}/{manifest.name}:{relpath})")
                except StoreError as err:
                    problems.append(str(err))
        for name, target in self.refs().items():
            if target not in manifests:
                problems.append(f"ref '{name}' points to missing manifest {target[:12]}")
        return problems

    def _verify_blob(self, entry: FileEntry, label: str) -> None:
        key = self._blob_path(entry.sha256)
        if self.local:
            if not os.path.exists(key):
                raise ArtifactNotFound(f"blob {entry.sha256} {label} is missing")
            if _sha256_file(Path(key)) != entry.sha256:
                raise CorruptBlobError(f"blob {entry.sha256} {label} is corrupted")
        else:
            self.read_blob(entry, label)

    # -- fsspec plumbing ------------------------------------------------------------------------

    def _exists(self, key: str) -> bool:
        return self._translate(lambda: self.fs.exists(key))

    def _find(self, prefix: str) -> list[str]:
        if self.local:
            return [p.as_posix() for p in Path(prefix).rglob("*") if p.is_file()]
        return self._translate(lambda: self.fs.find(prefix, refresh=True) if self.fs.exists(prefix) else [])

    def _write_atomic(self, key: str, data: bytes, create_only: bool = False) -> None:
        """Whole-object write: temp + rename locally, a single PUT on S3."""
        if self.local:
            path = Path(key)
            if create_only and path.exists():
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
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


def _sha256_file(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def _iter_source(source: Source) -> Iterator[tuple[str, bytes | Path]]:
    """(relative path, bytes or local file) pairs for a file, a directory or a mapping."""
    if isinstance(source, Mapping):
        for relpath, item in source.items():
            _check_relpath(relpath)
            if isinstance(item, str):
                item = item.encode()
            yield relpath, item if isinstance(item, bytes) else Path(item)
        return
    path = Path(source)
    if path.is_file():
        yield path.name, path
    elif path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            yield file.relative_to(path).as_posix(), file
    else:
        raise StoreError(f"cannot store '{path}': no such file or directory")


def _check_relpath(relpath: str) -> None:
    parts = Path(relpath).parts
    if not parts or Path(relpath).is_absolute() or ".." in parts:
        raise StoreError(f"file name '{relpath}' must be a relative path inside the artifact")


def _check_name(value: str, what: str, allow_slash: bool = False) -> None:
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") | (
        {"/"} if allow_slash else set()
    )
    if not value or set(value) - allowed or value.startswith(("/", ".")) or "//" in value or ".." in value:
        raise StoreError(
            f"invalid {what} '{value}': use letters, digits, '-', '_', '.'" + (", '/'" if allow_slash else "")
        )
