"""Hostile or broken store contents (issue 13): each finding is a test, on file:// and on S3 where it applies.

Every bad object must give a one-line StoreError that names it, never a crash, a hang or a write
outside the destination, and must lose nothing that was already stored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flywheel.data import ArtifactNotFound, ArtifactStore, CorruptBlobError, Manifest, StoreError
from flywheel.data.refs import read_local_object, read_s3_object, update_ref

PART = 8 * 1024 * 1024
BIG = 2 * PART + 4096  # Three S3 parts once `_multipart` lowers the store's thresholds.
pytestmark = pytest.mark.timeout(120)  # A regression here shows as a hang (FIFO, /dev/zero): fail instead.


@pytest.fixture
def local_store(tmp_path: Path) -> ArtifactStore:
    """A file:// store, for attacks that need local file types (FIFOs, folders, links)."""
    return ArtifactStore(tmp_path / "store")


def _forge_manifest(store: ArtifactStore, base: Manifest, files: dict, **fields: object) -> str:
    """Write a manifest with any `files` and fields under its true hash, as an attacker with write access could."""
    forged = {**base.model_dump(mode="json"), "files": files, **fields}
    raw = json.dumps(forged, sort_keys=True, separators=(",", ":")).encode()
    manifest_id = hashlib.sha256(raw).hexdigest()
    store.fs.pipe_file(store._manifest_path(manifest_id), raw)
    store.fs.invalidate_cache()
    return manifest_id


def _one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def _count(store: ArtifactStore, folder: str) -> int:
    return len(store._find(f"{store.root}/{folder}/"))


# -- manifest paths -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_files",
    [
        pytest.param(lambda e, _tmp: {"../../escaped.txt": e}, id="dotdot"),
        pytest.param(lambda e, _tmp: {"sub/../../../escaped.txt": e}, id="dotdot-inside"),
        pytest.param(lambda e, tmp: {f"{tmp}/escaped-absolute.txt": e}, id="absolute"),
        pytest.param(lambda e, _tmp: {"a": e, "a/b": e}, id="file-and-folder"),
        pytest.param(lambda e, _tmp: {"ok.txt": {**e, "sha256": "../../../../escaped"}}, id="digest-path"),
    ],
)
def test_manifest_paths_are_checked_on_every_read(store: ArtifactStore, tmp_path: Path, bad_files) -> None:
    good = store.put("dataset", "good", {"x.txt": b"payload"})
    entry = good.files["x.txt"].model_dump()
    forged = _forge_manifest(store, good, bad_files(entry, tmp_path))
    store.set_ref("evil", forged)
    dest = tmp_path / "a" / "b" / "dest"

    problems = store.verify()
    assert len(problems) == 1 and forged in problems[0] and "\n" not in problems[0]
    with pytest.raises(CorruptBlobError, match=forged) as err:
        store.get("evil", dest)
    _one_line(err)
    with pytest.raises(CorruptBlobError, match=forged):
        store.materialize("evil", tmp_path / "cache")
    assert not list(tmp_path.rglob("escaped*")) and not (tmp_path / "cache").exists()
    assert store.read_bytes("dataset/good", "x.txt") == b"payload"  # Nothing stored was lost.


def test_verify_checks_every_size_a_blob_is_listed_with(store: ArtifactStore, tmp_path: Path) -> None:
    good = store.put("dataset", "good", {"x.txt": b"payload"})
    entry = good.files["x.txt"].model_dump()
    # The same blob twice: first at its true size (verify used to read each blob once), then a forged one.
    forged = _forge_manifest(store, good, {"a.txt": entry, "b.txt": {**entry, "size": 999}}, name="forged")

    problems = store.verify()
    assert len(problems) == 1 and "dataset/forged:b.txt" in problems[0] and "\n" not in problems[0]
    with pytest.raises(CorruptBlobError, match=entry["sha256"]):
        store.get(forged, tmp_path / "out")
    assert store.read_bytes("dataset/good", "x.txt") == b"payload"


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"name": "evil[/]"}, id="markup"),
        pytest.param({"name": "\x1b[2Jclear"}, id="terminal-escape"),
        pytest.param({"name": "x" * 201}, id="too-long"),
        pytest.param({"kind": "\x1b]8;;http://e\x07link"}, id="kind-escape"),
    ],
)
def test_manifest_names_are_checked_on_every_read(store: ArtifactStore, fields: dict) -> None:
    good = store.put("dataset", "good", {"x.txt": b"payload"})
    forged = _forge_manifest(store, good, good.model_dump(mode="json")["files"], **fields)
    store.set_ref("evil", forged)

    bad = rf"manifest {forged} is not a valid manifest: (name|kind): invalid"
    with pytest.raises(CorruptBlobError, match=bad) as err:
        store.manifest("evil")
    assert "\x1b" not in _one_line(err)  # The bad value is named, its control characters escaped.
    problems = store.verify()
    assert len(problems) == 1 and forged in problems[0]
    assert store.read_bytes("dataset/good", "x.txt") == b"payload"


def test_names_with_control_characters_are_refused_on_write(store: ArtifactStore) -> None:
    with pytest.raises(StoreError, match="invalid ref name") as err:
        store.put("dataset", "\x1b[2Jclear", {"x.txt": b"x"})
    assert "\x1b" not in _one_line(err) and "\\x1b[2Jclear" in str(err.value)
    with pytest.raises(StoreError, match="invalid kind") as err:
        store.put("\x1b[2J", "name", {"x.txt": b"x"})
    assert "\x1b" not in _one_line(err)
    with pytest.raises(ValueError, match="invalid artifact name 'evil\\[/\\]'"):
        Manifest(kind="dataset", name="evil[/]")
    assert store.list() == []


# -- put: the stored bytes are the hashed bytes ---------------------------------------------------


@pytest.fixture
def _multipart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send BIG files to S3 in parallel parts (the path of files over 100 MiB), so tests stay small."""
    monkeypatch.setattr("flywheel.data.transfer._SINGLE_PUT_MAX", 0)
    monkeypatch.setattr("flywheel.data.transfer._PART", PART)


@pytest.mark.usefixtures("_multipart")
def test_file_changing_during_put_is_refused_and_nothing_corrupt_is_stored(
    store: ArtifactStore, tmp_path: Path
) -> None:
    src = tmp_path / "growing.bin"
    src.write_bytes(os.urandom(BIG))
    os.utime(src, (1_000_000_000, 1_000_000_000))  # Written long ago, as a real file being rewritten would be.
    changed = []

    def rewrite_tail(_n: int) -> None:
        if not changed:
            with open(src, "r+b") as handle:
                handle.seek(-100, os.SEEK_END)
                handle.write(b"\xff" * 100)
            changed.append(True)

    with pytest.raises(StoreError, match="growing.bin.*changed while") as err:
        store.put("dataset", "torn", src, progress=rewrite_tail)
    _one_line(err)
    assert changed and store.verify() == []
    assert _count(store, "manifests") == 0 and "dataset/torn" not in store.refs()
    manifest = store.put("dataset", "torn", src)  # Once stable, it stores, and what is stored hashes right.
    assert store.read_bytes(manifest.id, "growing.bin") == src.read_bytes()


# -- unreadable objects: one line each, no crash, no hang -----------------------------------------


def _ref_with_history(history: object) -> bytes:
    return json.dumps({"target": "0" * 64, "history": history}).encode()


def _truncate_ref(store: ArtifactStore, path: str) -> None:
    store.fs.pipe_file(path, store.fs.cat_file(path)[:25])


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(_truncate_ref, id="truncated"),
        pytest.param(lambda s, p: s.fs.pipe_file(p, json.dumps({"history": []}).encode()), id="no-target"),
        pytest.param(lambda s, p: s.fs.pipe_file(p, b"\x00\xffnot json at all"), id="not-json"),
        pytest.param(lambda s, p: s.fs.pipe_file(p, b'{"target": "../../x", "history": []}'), id="target-not-an-id"),
        pytest.param(lambda s, p: s.fs.pipe_file(p, _ref_with_history(5)), id="history-not-a-list"),
        pytest.param(lambda s, p: s.fs.pipe_file(p, _ref_with_history([1])), id="history-not-moves"),
    ],
)
def test_bad_ref_is_one_line_in_ls_verify_get_and_loses_nothing(store: ArtifactStore, tmp_path: Path, damage) -> None:
    kept = store.put("dataset", "kept", {"k": b"keep"})
    store.put("dataset", "hit", {"h": b"hit"})
    damage(store, f"{store.root}/refs/dataset/hit.json")
    store.fs.invalidate_cache()

    with pytest.raises(CorruptBlobError, match="ref 'dataset/hit'") as err:
        store.get("dataset/hit", tmp_path / "out")
    _one_line(err)
    with pytest.raises(CorruptBlobError, match="ref 'dataset/hit'"):
        store.refs()  # `artifacts ls` reads every ref: it fails with this line, not a traceback.
    with pytest.raises(CorruptBlobError, match="ref 'dataset/hit'"):
        store.put("dataset", "hit", {"h": b"new"})  # Refused before writing over the evidence.
    problems = store.verify()
    assert len(problems) == 1 and "ref 'dataset/hit'" in problems[0] and "\n" not in problems[0]
    assert store.read_bytes("dataset/kept", "k") == b"keep" and store.resolve("dataset/kept") == kept.id
    assert len(store.list()) == 2


def test_an_object_over_its_limit_is_refused_before_its_body_is_read(store: ArtifactStore) -> None:
    """A ref or manifest larger than any valid one is corrupt: on either backend, one line, nothing read."""
    store.put("dataset", "big", {"b": b"b"})
    path = f"{store.root}/refs/dataset/big.json"
    store.fs.pipe_file(path, b"x" * 11)
    with pytest.raises(CorruptBlobError, match=r"^ref 'big' is corrupted: 11 bytes, more than any valid one \(10\)$"):
        if store.url.startswith("s3://"):
            read_s3_object(store.fs, *path.split("/", 1), "ref 'big'", limit=10)
        else:
            read_local_object(Path(path), "ref 'big'", limit=10)


def _blob_file(store: ArtifactStore, manifest: Manifest) -> Path:
    return Path(store._blob_path(manifest.files["w.bin"].sha256))


def _replace(path: Path, make) -> None:
    path.unlink()
    make(path)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: p.mkdir(), id="folder"),
        pytest.param(os.mkfifo, id="fifo"),
        pytest.param(lambda p: p.symlink_to("/dev/zero"), id="symlink-to-dev-zero"),
        pytest.param(lambda p: p.write_bytes(b"short"), id="truncated"),
    ],
)
def test_bad_blob_is_one_line_in_ls_verify_get(local_store: ArtifactStore, tmp_path: Path, make) -> None:
    manifest = local_store.put("model", "m", {"w.bin": os.urandom(10_000)})
    _replace(_blob_file(local_store, manifest), make)
    digest = manifest.files["w.bin"].sha256

    assert [m.id for m in local_store.list()] == [manifest.id]  # `ls` reads manifests only.
    problems = local_store.verify()
    assert len(problems) == 1 and digest in problems[0] and "\n" not in problems[0]
    with pytest.raises(CorruptBlobError, match=digest) as err:
        local_store.get("model/m", tmp_path / "out")
    _one_line(err)
    assert not (tmp_path / "out" / "w.bin").exists()
    with pytest.raises(CorruptBlobError, match=digest):
        local_store.read_bytes("model/m", "w.bin")


@pytest.mark.usefixtures("_multipart")  # Ranged GETs of several parts on S3.
@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: b"", id="emptied"),
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: data + b"appended", id="appended"),
    ],
)
def test_blob_of_the_wrong_size_is_one_line_on_both_backends(store: ArtifactStore, tmp_path: Path, damage) -> None:
    payload = os.urandom(BIG)
    manifest = store.put("model", "m", {"w.bin": payload})
    digest = manifest.files["w.bin"].sha256
    store.fs.pipe_file(store._blob_path(digest), damage(payload))
    store.fs.invalidate_cache()

    problems = store.verify()
    assert len(problems) == 1 and digest in problems[0] and "\n" not in problems[0]
    with pytest.raises(CorruptBlobError, match=digest) as err:
        store.get("model/m", tmp_path / "out")
    _one_line(err)
    assert not (tmp_path / "out" / "w.bin").exists()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(os.mkfifo, id="fifo"),
        pytest.param(lambda p: p.symlink_to("/dev/zero"), id="symlink-to-dev-zero"),
        pytest.param(lambda p: p.mkdir(), id="folder"),
    ],
)
def test_ref_or_manifest_of_the_wrong_file_type_is_one_line(local_store: ArtifactStore, make) -> None:
    manifest = local_store.put("model", "m", {"w.bin": b"w"})
    _replace(Path(local_store.root, "refs", "model", "m.json"), make)
    with pytest.raises(CorruptBlobError, match="ref 'model/m'") as err:
        local_store.manifest("model/m")
    _one_line(err)
    _replace(Path(local_store._manifest_path(manifest.id)), make)
    with pytest.raises(CorruptBlobError, match=f"manifest {manifest.id}"):
        local_store.manifest(manifest.id)
    problems = local_store.verify()
    assert len(problems) == 2 and all("\n" not in p for p in problems)


# -- names ----------------------------------------------------------------------------------------


def test_ref_names_are_checked_on_read(local_store: ArtifactStore, tmp_path: Path) -> None:
    secret = local_store.put("model", "secret", {"w": b"w"})
    outside = Path(local_store.root).parent / "outside_ref.json"  # What refs/../../outside_ref.json names.
    outside.write_text(json.dumps({"target": secret.id, "history": [{"target": secret.id, "at": "now"}]}))

    for read in (local_store.manifest, local_store.resolve):
        with pytest.raises(ArtifactNotFound, match="unknown artifact ref '../../outside_ref'") as err:
            read("../../outside_ref")
        _one_line(err)
    with pytest.raises(StoreError, match="invalid ref name"):
        local_store.ref_history("../../outside_ref")
    assert local_store.try_resolve("../../outside_ref", "model/secret") == secret.id


@pytest.mark.parametrize(
    "name", [pytest.param("x" * 300, id="300-chars"), pytest.param("r1.json/x", id="ref-file-as-folder")]
)
def test_bad_name_is_refused_before_anything_is_written(store: ArtifactStore, name: str) -> None:
    store.put("dataset", "r1", {"d": b"one"})
    manifests, blobs = _count(store, "manifests"), _count(store, "blobs")
    with pytest.raises(StoreError, match="invalid ref name") as err:
        store.put("dataset", name, {"fresh.bin": os.urandom(1000)})
    _one_line(err)
    assert (_count(store, "manifests"), _count(store, "blobs")) == (manifests, blobs)
    assert store.verify() == [] and set(store.refs()) == {"dataset/r1"}


# -- killed writes --------------------------------------------------------------------------------

_KILLED_PUT = textwrap.dedent(
    """
    import os, sys
    from flywheel.data import ArtifactStore, transfer
    transfer._SINGLE_PUT_MAX, transfer._PART = 0, int(sys.argv[3])  # As the `_multipart` fixture.
    store = ArtifactStore(sys.argv[1])
    store.put("dataset", "big", sys.argv[2], progress=lambda n: os._exit(9))  # Killed mid-copy.
    """
)


def test_killed_put_leaves_leftovers_that_verify_reports_and_cleans(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(BIG))
    result = subprocess.run([sys.executable, "-c", _KILLED_PUT, store.url, str(src), str(PART)], env=os.environ.copy())
    assert result.returncode == 9
    store.fs.invalidate_cache()

    problems = store.verify(staging_grace_s=0)
    assert len(problems) == 1 and ("staging leftover" in problems[0] or "unfinished upload" in problems[0])
    assert store.verify(clean_staging=True, staging_grace_s=0) == []
    assert store.verify(staging_grace_s=0) == []
    if store.local:
        assert not any(Path(store.root, "tmp").iterdir())
    else:
        bucket, _, prefix = store.root.partition("/")
        assert not store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads")
    assert store.put("dataset", "big", src).files["big.bin"].size == src.stat().st_size


def test_verify_never_cleans_a_live_write(local_store: ArtifactStore) -> None:
    from flywheel.data.refs import staged_file

    with staged_file(Path(local_store.root, "tmp")) as (staged, handle):
        handle.write(b"in progress")
        assert local_store.verify(clean_staging=True) == []
        assert staged.exists()


def _outside_folder(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "keep.txt").write_text("not the store's")
    (outside / "sub" / "deep.txt").write_text("not the store's either")
    return outside


def test_clean_staging_never_follows_a_link(local_store: ArtifactStore, tmp_path: Path) -> None:
    outside = _outside_folder(tmp_path)
    staging = Path(local_store.root, "tmp")
    staging.mkdir(exist_ok=True)
    (staging / "link-to-folder").symlink_to(outside)
    (staging / "link-to-file").symlink_to(outside / "keep.txt")
    (staging / "folder").mkdir()
    (staging / "folder" / "link").symlink_to(outside)

    assert len(local_store.verify()) == 3
    assert local_store.verify(clean_staging=True) == []
    assert not any(staging.iterdir())  # The links themselves are gone ...
    assert sorted(p.name for p in outside.rglob("*")) == ["deep.txt", "keep.txt", "sub"]  # ... their targets stay.

    staging.rmdir()
    staging.symlink_to(outside)  # The staging folder itself a link: refused, not emptied.
    for clean in (False, True):
        problems = local_store.verify(clean_staging=clean)
        assert len(problems) == 1 and "staging folder tmp/ is a symlink" in problems[0]
    assert sorted(p.name for p in outside.rglob("*")) == ["deep.txt", "keep.txt", "sub"]


# -- durability -----------------------------------------------------------------------------------


def test_blobs_and_manifests_are_fsynced_before_the_ref(
    local_store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append(f"dir:{path.name}" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    manifest = local_store.put("model", "durable", {"w.bin": os.urandom(5000)})
    ref_bytes = Path(local_store.root, "refs", "model", "durable.json").read_bytes()

    blob, ref = synced.index(manifest.files["w.bin"].sha256), synced.index(hashlib.sha256(ref_bytes).hexdigest())
    assert blob < synced.index(manifest.id) < ref
    assert "dir:manifests" in synced[:ref] and f"dir:{manifest.files['w.bin'].sha256[:2]}" in synced[:ref]


# -- materialize ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda d: (d / "w.bin").write_bytes(b"X" * 4096), id="same-size-rewrite"),
        pytest.param(lambda d: (d / "w.bin").unlink(), id="file-deleted"),
        pytest.param(lambda d: (d / "adapter_config.json").write_text("{}"), id="file-added"),
    ],
)
def test_materialize_hit_is_verified(store: ArtifactStore, tmp_path: Path, tamper) -> None:
    payload = os.urandom(4096)
    manifest = store.put("model", "cached", {"w.bin": payload, "config.json": b"{}"})
    cached = store.materialize("model/cached", tmp_path / "cache")
    tamper(cached)

    again = store.materialize("model/cached", tmp_path / "cache")
    assert again == cached and (again / "w.bin").read_bytes() == payload
    assert sorted(p.name for p in again.iterdir()) == ["config.json", "w.bin"]
    assert again.name == manifest.id


# -- compare-and-swap is enforced by the server, not only by the client ----------------------------


def test_stale_writer_is_refused_by_the_backend_if_none_match(store: ArtifactStore) -> None:
    a = store.put("model", "m", {"w": b"a"})
    backend = store._refs
    value, token = backend.read("champion")  # Writer A: the ref does not exist yet.
    assert value is None and token is None
    store.set_ref("champion", a.id, expected=None)  # Writer B gets there first.
    stale = {"target": a.id, "history": [{"target": a.id, "at": "A"}]}
    assert backend.write_if("champion", stale, token) is False  # A's create-only PUT is refused.
    assert [h["at"] != "A" for h in store.ref_history("champion")] == [True]


def test_stale_writer_is_refused_by_the_backend_if_match(store: ArtifactStore) -> None:
    a = store.put("model", "m", {"w": b"a"})
    b = store.put("model", "m", {"w": b"b"})
    store.set_ref("champion", a.id)
    _, token = store._refs.read("champion")  # Writer A reads version 1.
    store.set_ref("champion", b.id)  # Writer B moves it.
    stale = {"target": a.id, "history": [{"target": a.id, "at": "A"}]}
    assert store._refs.write_if("champion", stale, token) is False  # A's PUT with the old token is refused.
    assert store.resolve("champion") == b.id and len(store.ref_history("champion")) == 2


def test_interleaved_writer_forces_a_retry_and_loses_no_update(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = store.put("model", "m", {"w": b"a"})
    b = store.put("model", "m", {"w": b"b"})
    store.set_ref("champion", a.id)
    writer_b = ArtifactStore(store.url)  # Another process, in effect: its own backend and connection.
    backend, outcomes = store._refs, []
    real_write = backend.write_if

    def b_writes_between_read_and_put(key: str, value: dict, token: object) -> bool:
        if not outcomes:
            writer_b.set_ref(key, b.id)
        outcomes.append(real_write(key, value, token))
        return outcomes[-1]

    monkeypatch.setattr(backend, "write_if", b_writes_between_read_and_put)
    # A skips its lock so that B can write: what refuses A's first PUT must be the token check itself.
    monkeypatch.setattr(backend, "exclusive", lambda _key: contextlib.nullcontext())
    update_ref(backend, "champion", a.id, lambda _current: True)
    assert outcomes == [False, True]
    assert [h["target"] for h in store.ref_history("champion")] == [a.id, b.id, a.id]
