"""The artifact store, run identically against file:// and a real S3 endpoint (moto server)."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
from botocore.exceptions import ClientError

from flywheel.data import ArtifactNotFound, ArtifactStore, CorruptBlobError, RefConflict, StoreError, lineage
from flywheel.data.manifest import FileEntry, Manifest, check_kind, check_relpaths
from flywheel.data.refs import update_ref


@pytest.fixture
def local_store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


def _make_dir(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"a": 1}')
    (root / "sub" / "weights.bin").write_bytes(os.urandom(300_000))
    return root


def _blob_count(store: ArtifactStore) -> int:
    return len(store._find(f"{store.root}/blobs/"))


def test_directory_round_trip_is_byte_identical(store: ArtifactStore, tmp_path: Path) -> None:
    src = _make_dir(tmp_path / "src")
    manifest = store.put("model", "tiny", src, params={"seed": 1}, metrics={"params": 10})

    assert set(manifest.files) == {"config.json", "sub/weights.bin"}
    assert store.resolve("model/tiny") == manifest.id
    assert store.resolve(manifest.id[:10]) == manifest.id
    out = store.get("model/tiny", tmp_path / "out")
    for rel in ("config.json", "sub/weights.bin"):
        assert (out / rel).read_bytes() == (src / rel).read_bytes()
    again = store.manifest(manifest.id)
    assert again == manifest and again.params == {"seed": 1} and again.code_version


def test_identical_blobs_are_stored_once(store: ArtifactStore, tmp_path: Path) -> None:
    payload = os.urandom(50_000)
    store.put("dataset", "a", {"x.bin": payload})
    blobs_after_first = _blob_count(store)
    store.put("dataset", "b", {"y.bin": payload, "z.bin": payload})
    assert _blob_count(store) == blobs_after_first
    assert store.read_bytes("dataset/b", "z.bin") == payload


def test_new_version_moves_name_ref_and_keeps_old(store: ArtifactStore) -> None:
    first = store.put("dataset", "sft", {"data.jsonl": b"one\n"})
    second = store.put("dataset", "sft", {"data.jsonl": b"two\n"})
    assert store.resolve("dataset/sft") == second.id
    assert store.read_bytes(first.id, "data.jsonl") == b"one\n"
    assert [h["target"] for h in store.ref_history("dataset/sft")] == [first.id, second.id]


def test_corrupted_blob_is_detected_and_destination_untouched(store: ArtifactStore, tmp_path: Path) -> None:
    manifest = store.put("dataset", "c", {"data.jsonl": b'{"ok": true}\n' * 100})
    digest = manifest.files["data.jsonl"].sha256
    store.fs.pipe_file(store._blob_path(digest), b"tampered")
    store.fs.invalidate_cache()

    with pytest.raises(CorruptBlobError, match=digest):
        store.get("dataset/c", tmp_path / "out")
    assert not (tmp_path / "out" / "data.jsonl").exists()
    with pytest.raises(CorruptBlobError, match=r"dataset/c:data\.jsonl"):
        store.read_bytes("dataset/c", "data.jsonl")
    problems = store.verify()
    assert len(problems) == 1 and digest in problems[0]


def test_compare_and_swap_refuses_stale_expectation(store: ArtifactStore) -> None:
    a = store.put("model", "m", {"w": b"a"})
    b = store.put("model", "m", {"w": b"b"})
    store.set_ref("champion", a.id, expected=None)
    with pytest.raises(RefConflict, match="champion"):
        store.set_ref("champion", b.id, expected=None)
    store.set_ref("champion", b.id, expected=a.id)
    with pytest.raises(RefConflict):
        store.set_ref("champion", a.id, expected=a.id)  # Stale: it now points at b.
    assert store.resolve("champion") == b.id


def test_a_refused_move_names_the_current_and_the_expected_target(store: ArtifactStore) -> None:
    a, b = store.put("model", "m", {"w": b"a"}), store.put("model", "m", {"w": b"b"})
    with pytest.raises(RefConflict, match=f"^ref 'champion' points to nothing, not the expected {a.id}$"):
        store.set_ref("champion", b.id, expected=a.id)
    store.set_ref("champion", a.id, expected=None)
    with pytest.raises(RefConflict, match=f"^ref 'champion' points to {a.id}, not the expected nothing$"):
        store.set_ref("champion", b.id, expected=None)
    with pytest.raises(RefConflict, match=f"^ref 'champion' points to {a.id}, not the expected a matching target$"):
        update_ref(store._refs, "champion", b.id, lambda current: current == b.id)
    assert store.resolve("champion") == a.id


_MOVER = textwrap.dedent(
    """
    import sys
    from flywheel.data import ArtifactStore
    store = ArtifactStore(sys.argv[1])
    for i in range(int(sys.argv[3])):
        store.set_ref("champion", sys.argv[2])
    """
)


def test_concurrent_ref_updates_from_two_processes_lose_nothing(store: ArtifactStore) -> None:
    a = store.put("model", "m", {"w": b"a"})
    b = store.put("model", "m", {"w": b"b"})
    moves = 15
    procs = [
        subprocess.Popen([sys.executable, "-c", _MOVER, store.url, target, str(moves)], env=os.environ.copy())
        for target in (a.id, b.id)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    history = [entry["target"] for entry in store.ref_history("champion")]
    assert len(history) == 2 * moves
    assert history.count(a.id) == moves and history.count(b.id) == moves


_CRASHER = textwrap.dedent(
    """
    import os, sys
    from flywheel.data import ArtifactStore
    from flywheel.data.transfer import Transfer as Cls
    original = Cls.write_object
    def crash_on_manifest(self, key, data):
        if "/manifests/" in key:
            os._exit(9)  # Power cut after the blobs, before the manifest.
        return original(self, key, data)
    Cls.write_object = crash_on_manifest
    ArtifactStore(sys.argv[1]).put("dataset", "d", {"big.bin": os.urandom(100_000), "x": b"new"})
    """
)


def test_crash_between_blob_and_manifest_leaves_no_dangling_ref(store: ArtifactStore) -> None:
    before = store.put("dataset", "d", {"x": b"old"})
    result = subprocess.run([sys.executable, "-c", _CRASHER, store.url], env=os.environ.copy())
    assert result.returncode == 9
    store.fs.invalidate_cache()
    assert store.resolve("dataset/d") == before.id
    assert store.read_bytes("dataset/d", "x") == b"old"
    assert store.verify() == []
    assert len(store.list()) == 1


def test_lineage_of_a_three_level_chain(store: ArtifactStore) -> None:
    dataset = store.put("dataset", "sft-r1", {"d.jsonl": b"1"})
    checkpoint = store.put("checkpoint", "sft-r1", {"w": b"2"}, parents=[dataset.id])
    report = store.put("eval", "r1", {"e.json": b"3"}, parents=["checkpoint/sft-r1"])
    next_dataset = store.put("dataset", "sft-r2", {"d.jsonl": b"4"}, parents=[report.id, dataset.id])

    tree = lineage(store, "dataset/sft-r2")
    assert tree.manifest.id == next_dataset.id
    eval_node, dataset_node = tree.parents
    assert eval_node.manifest.id == report.id
    assert eval_node.parents[0].manifest.id == checkpoint.id
    assert eval_node.parents[0].parents[0].manifest.id == dataset.id
    assert dataset_node.repeated and dataset_node.manifest.id == dataset.id
    assert [m.kind for m in tree.walk()] == ["dataset", "eval", "checkpoint", "dataset", "dataset"]


def put_chain(store: ArtifactStore, length: int) -> list[str]:
    """`length` artifacts, each made from the one before: the ids, oldest first."""
    ids: list[str] = []
    with mock.patch("os.fsync"):  # Durability is not under test: a second for 600 puts, not fifteen.
        for i in range(length):
            ids.append(store.put("dataset", f"step-{i}", {"d": str(i).encode()}, parents=ids[-1:]).id)
    return ids


def test_lineage_of_a_long_chain_is_walked_without_recursion(local_store: ArtifactStore) -> None:
    ids = put_chain(local_store, 600)  # Deeper than Python's recursion limit allows a recursive walk.
    tree = lineage(local_store, ids[-1])
    assert [m.id for m in tree.walk()] == ids[::-1]


def test_bad_input_fails_clearly_and_writes_nothing(store: ArtifactStore, tmp_path: Path) -> None:
    kept = store.put("dataset", "keep", {"x": b"1"})
    with pytest.raises(ArtifactNotFound, match=r"unknown artifact ref 'nope'.*dataset/keep"):
        store.manifest("nope")
    with pytest.raises(ArtifactNotFound, match="no file 'missing'"):
        store.read_bytes("dataset/keep", "missing")
    with pytest.raises(ArtifactNotFound, match="unknown artifact ref 'ghost'"):
        store.put("dataset", "child", {"x": b"2"}, parents=["ghost"])
    with pytest.raises(StoreError, match="relative path"):
        store.put("dataset", "escape", {"../evil": b"x"})
    with pytest.raises(StoreError, match="invalid kind"):
        store.put("bad kind", "x", {"x": b"1"})
    with pytest.raises(StoreError, match="no such file"):
        store.put("dataset", "x", tmp_path / "does-not-exist")
    assert [m.id for m in store.list()] == [kept.id]
    assert set(store.refs()) == {"dataset/keep"}


def test_materialize_downloads_once(store: ArtifactStore, tmp_path: Path) -> None:
    src = _make_dir(tmp_path / "src")
    manifest = store.put("model", "cached", src)
    first = store.materialize("model/cached", tmp_path / "cache")
    assert first.name == manifest.id
    marker = first / "config.json"
    os.utime(marker, (0, 0))
    assert store.materialize(manifest.id, tmp_path / "cache") == first
    assert marker.stat().st_mtime == 0
    assert hashlib.sha256((first / "sub/weights.bin").read_bytes()).hexdigest() == (
        manifest.files["sub/weights.bin"].sha256
    )


def test_unsupported_url_is_rejected() -> None:
    with pytest.raises(StoreError, match="unsupported store URL 'ftp://x'"):
        ArtifactStore("ftp://x")


def test_store_works_where_the_kernel_cannot_sendfile(
    local_store: ArtifactStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_sendfile(*_args: object) -> int:
        raise OSError(errno.ENOSYS, "sendfile not supported here")

    monkeypatch.setattr(os, "sendfile", no_sendfile)
    src = _make_dir(tmp_path / "src")
    manifest = local_store.put("model", "plain-copy", src)
    out = local_store.get("model/plain-copy", tmp_path / "out")
    assert (out / "sub/weights.bin").read_bytes() == (src / "sub/weights.bin").read_bytes()
    assert local_store.verify() == [] and manifest.files["config.json"].size == 8


# -- manifests, without a store ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "relpath", ["", "a\\b", "a\0b", "./a", "a/./b", "a/../b", "a//b", "/abs", "x" * 256, "d/" + "é" * 128]
)
def test_a_file_name_outside_its_artifact_is_refused(relpath: str) -> None:
    with pytest.raises(ValueError, match="must be a relative path inside the artifact"):
        check_relpaths(["ok.txt", relpath])


def test_a_file_name_part_may_take_255_bytes() -> None:
    check_relpaths(["x" * 255, "d/" + "é" * 127 + "x"])  # NAME_MAX: 255 bytes (é is 2), not characters.


def test_a_file_that_is_also_a_folder_deeper_down_is_named() -> None:
    with pytest.raises(ValueError, match=r"^'a/b' is both a file and a folder of the artifact$"):
        check_relpaths(["a/b", "a/b/c/d"])
    check_relpaths(["a/b/c", "a/bc", "a/b/d", "ab"])  # Siblings and mere prefixes are no folders.


def test_an_invalid_kind_is_quoted_by_its_first_80_characters() -> None:
    kind = "k" * 79 + "/" + "z" * 100
    with pytest.raises(ValueError) as err:
        check_kind(kind)
    assert str(err.value).startswith(f"invalid kind {kind[:80]!r}: ")


def test_a_manifest_id_is_the_sha256_of_its_sorted_compact_json() -> None:
    """Ids address stored manifests: the bytes they hash must never change. Parameters are dumped as JSON
    (a Path as its text)."""
    manifest = Manifest(
        kind="dataset",
        name="n",
        files={"b.txt": FileEntry(sha256="0" * 64, size=1)},
        params={"z": 1, "a": Path("x/y")},
        code_version="git:abc",
        created="2026-12-06T00:00:00.000+00:00",
    )
    expected = (
        b'{"code_version":"git:abc","created":"2026-12-06T00:00:00.000+00:00","files":{"b.txt":{"sha256":"'
        + b"0" * 64
        + b'","size":1}},"kind":"dataset","metrics":{},"name":"n","params":{"a":"x/y","z":1},"parents":[]}'
    )
    assert manifest.canonical_bytes() == expected
    assert manifest.id == hashlib.sha256(expected).hexdigest()


@pytest.mark.parametrize(
    ("cause", "refused"),
    [
        pytest.param(None, False, id="no-cause"),
        pytest.param(ValueError("no response"), False, id="cause-without-response"),
        pytest.param(ClientError({"ResponseMetadata": {}}, "PutObject"), False, id="response-without-error"),
        pytest.param(ClientError({"Error": {"Code": "NoSuchKey"}}, "PutObject"), False, id="another-error"),
        pytest.param(ClientError({"Error": {"Code": "PreconditionFailed"}}, "PutObject"), True, id="precondition"),
        pytest.param(ClientError({"Error": {"Code": "412"}}, "PutObject"), True, id="412"),
        pytest.param(ClientError({"Error": {"Code": "ConditionalRequestConflict"}}, "PutObject"), True, id="conflict"),
    ],
)
def test_only_a_refused_condition_is_a_lost_compare_and_swap(cause: BaseException | None, refused: bool) -> None:
    """s3fs wraps botocore's error in an OSError: a write refused by its condition is a lost race (retried);
    any other failure is not (it propagates)."""
    from flywheel.data.refs import _is_precondition_failure

    err = OSError("put_object failed")
    err.__cause__ = cause
    assert _is_precondition_failure(err) is refused
