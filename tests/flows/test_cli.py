"""The `flywheel` CLI as a user runs it: a real subprocess, real stores, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from data import ArtifactStore

FLYWHEEL = str(Path(sys.executable).parent / "flywheel")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run([FLYWHEEL, *args], capture_output=True, text=True, env=full_env, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.fixture
def filled_store(store_url: str) -> ArtifactStore:
    store = ArtifactStore(store_url)
    data = store.put("dataset", "sft-r1", {"train.jsonl": b'{"messages": []}\n'})
    ckpt = store.put("checkpoint", "sft-r1", {"model.safetensors": os.urandom(2048)}, parents=[data.id])
    store.put("eval", "r1", {"results.json": b"{}"}, parents=[ckpt.id])
    return store


def test_artifact_commands_on_both_backends(filled_store: ArtifactStore, tmp_path: Path) -> None:
    url = filled_store.url
    listing = run("--store", url, "artifacts", "ls")
    assert listing.returncode == 0, listing.stderr
    for name in ("dataset", "checkpoint", "eval", "sft-r1"):
        assert name in listing.stdout
    only_eval = run("--store", url, "artifacts", "ls", "eval")
    assert "eval" in only_eval.stdout and "dataset" not in only_eval.stdout

    show = run("--store", url, "artifacts", "show", "checkpoint/sft-r1")
    assert show.returncode == 0 and '"kind": "checkpoint"' in show.stdout

    tree = run("--store", url, "artifacts", "lineage", "eval/r1")
    assert tree.returncode == 0
    order = [tree.stdout.index(f"{k}/") for k in ("eval", "checkpoint", "dataset")]
    assert order == sorted(order)

    got = run("--store", url, "artifacts", "get", "dataset/sft-r1", str(tmp_path / "out"))
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "out" / "train.jsonl").read_bytes() == b'{"messages": []}\n'

    assert run("--store", url, "artifacts", "verify").returncode == 0


def test_verify_fails_on_a_corrupted_blob(filled_store: ArtifactStore) -> None:
    digest = filled_store.manifest("checkpoint/sft-r1").files["model.safetensors"].sha256
    filled_store.fs.pipe_file(filled_store._blob_path(digest), b"bitrot")
    result = run("--store", filled_store.url, "artifacts", "verify")
    assert result.returncode == 1 and digest in result.stderr


def test_env_var_selects_the_store(filled_store: ArtifactStore) -> None:
    result = run("artifacts", "ls", env={"FLYWHEEL_STORE": filled_store.url})
    assert result.returncode == 0 and "sft-r1" in result.stdout


def test_unknown_ref_and_bad_url_are_one_line_errors(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    assert_one_line_error(run("--store", store, "artifacts", "show", "nope"), "unknown artifact ref 'nope'")
    assert_one_line_error(run("--store", "ftp://host/x", "artifacts", "ls"), "unsupported store URL")
    assert_one_line_error(run("--store", store, "serve", "gpt5"), "not a built-in")


def test_s3_without_credentials_or_endpoint_is_one_line_error(tmp_path: Path) -> None:
    no_keys = {
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    }
    env = {k: v for k, v in no_keys.items()}
    result = run("--store", "s3://bucket/prefix", "artifacts", "ls", env=env)
    assert_one_line_error(result, "no S3 credentials")
    unreachable = {**no_keys, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    result = run("--store", "s3://bucket/prefix", "artifacts", "ls", env=unreachable)
    assert_one_line_error(result, "cannot reach the S3 endpoint http://127.0.0.1:9")


def test_serve_dry_run_builds_the_vllm_command(model_store: ArtifactStore, tiny_model: Path) -> None:
    result = run(
        "--store",
        model_store.url,
        "serve",
        "tiny",
        "--backend",
        "vllm",
        "--tensor-parallel-size",
        "2",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("vllm serve ")
    assert "--tensor-parallel-size 2" in result.stdout and "--served-model-name tiny" in result.stdout
