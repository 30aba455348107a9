"""The `flywheel` CLI as a user runs it: a real subprocess, real stores, one-line errors, `--store`
after any subcommand, `--json` for scripts, unwrapped output when piped."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from flywheel.data import ArtifactStore
from flywheel.data.columnar import ShardWriter, format_params
from flywheel.flows import cli
from flywheel.inference.server import vllm_cli
from flywheel.training.launch import accelerate_cli
from tests.data.test_columnar import sft_row
from tests.data.test_store import put_chain

FLYWHEEL = str(Path(sys.executable).parent / "flywheel")
SFT_CONFIG = str(Path(__file__).resolve().parents[2] / "training" / "configs" / "sft_h100_zero3.yaml")


def command_paths(command: Any, prefix: tuple[str, ...] = ()) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """(command groups, runnable subcommands) of the CLI's click tree, as argv prefixes."""
    subcommands = getattr(command, "commands", None)
    if subcommands is None:
        return [], [prefix]
    groups, leaves = [prefix], []
    for name, sub in sorted(subcommands.items()):
        sub_groups, sub_leaves = command_paths(sub, (*prefix, name))
        groups += sub_groups
        leaves += sub_leaves
    return groups, leaves


GROUPS, SUBCOMMANDS = command_paths(typer.main.get_command(cli.app))


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run([FLYWHEEL, *args], capture_output=True, text=True, env=full_env, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str, code: int = 1) -> None:
    assert result.returncode == code, result.stdout + result.stderr
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


def test_export_writes_a_parquet_dataset_as_jsonl_and_names_the_splits_it_has(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    writer = ShardWriter(tmp_path / "shards", "sft")
    for number in range(2):
        writer.write(sft_row(number))
    store.put("dataset", "sft-r1", {p.name: p for p in writer.close()}, params=format_params("sft"))
    out = tmp_path / "rows.jsonl"
    done = run("--store", store.url, "artifacts", "export", "dataset/sft-r1", str(out))
    assert done.returncode == 0 and "2 rows" in done.stdout, done.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == [sft_row(0), sft_row(1)]
    wrong = run("--store", store.url, "artifacts", "export", "dataset/sft-r1", str(out), "--split", "test")
    assert_one_line_error(wrong, "has no split test", "it has: train")


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
    assert result.stdout.startswith(" ".join([*vllm_cli(), "serve", ""]))  # The GPU runtime's vLLM, not PATH's.
    assert "--tensor-parallel-size 2" in result.stdout and "--served-model-name tiny" in result.stdout


@pytest.fixture
def local_store(tmp_path: Path) -> ArtifactStore:
    store = ArtifactStore(str(tmp_path / "store"))
    data = store.put("dataset", "sft-r1", {"train.jsonl": b'{"messages": []}\n'})
    store.put("checkpoint", "sft-r1", {"model.safetensors": b"weights"}, parents=[data.id])
    return store


@pytest.mark.parametrize("path", SUBCOMMANDS, ids=" ".join)
def test_every_subcommand_accepts_store(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main([*path, "--store", "/tmp/any-store", "--help"])
    assert done.value.code == 0, capsys.readouterr().err
    assert "--store" in capsys.readouterr().out


def test_store_after_the_subcommand_selects_the_store(local_store: ArtifactStore) -> None:
    listing = run("artifacts", "ls", "--store", local_store.url, env={"FLYWHEEL_STORE": "/nonexistent/elsewhere"})
    assert listing.returncode == 0, listing.stderr
    assert "sft-r1" in listing.stdout


def test_artifacts_ls_and_show_print_json(local_store: ArtifactStore) -> None:
    listing = run("--store", local_store.url, "artifacts", "ls", "--json")
    assert listing.returncode == 0, listing.stderr
    rows = json.loads(listing.stdout)
    assert [(r["kind"], r["name"]) for r in rows] == [("dataset", "sft-r1"), ("checkpoint", "sft-r1")]
    assert rows[1]["refs"] == ["checkpoint/sft-r1"] and rows[1]["parents"] == [rows[0]["id"]]
    only = json.loads(run("--store", local_store.url, "artifacts", "ls", "checkpoint", "--json").stdout)
    assert [r["kind"] for r in only] == ["checkpoint"]

    show = run("--store", local_store.url, "artifacts", "show", "checkpoint/sft-r1", "--json")
    assert show.returncode == 0, show.stderr
    assert json.loads(show.stdout) == {key: value for key, value in rows[1].items() if key != "refs"}


def test_model_prepare_prints_json(model_store: ArtifactStore, tiny_model: Path) -> None:
    result = run("--store", model_store.url, "model", "prepare", "tiny", "--json")
    assert result.returncode == 0, result.stderr
    prepared = json.loads(result.stdout)
    assert prepared["ref"] == "model/tiny" and prepared["id"] == model_store.manifest("model/tiny").id
    assert (Path(prepared["path"]) / "config.json").exists()


def test_eval_prints_its_results_as_json(
    local_store: ArtifactStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import flywheel.evaluation.lm_eval_runner as runner

    results = {"arith": {"acc,none": 0.5, "acc_stderr,none": 0.1}}

    def fake_lm_eval(cfg: Any, store: ArtifactStore, model_dir: Path, model_ref: str | None = None) -> Any:
        assert cfg.tasks == ["arith"] and model_dir == model.resolve()
        return store.put("eval", "fake", {"results.json": json.dumps({"results": results}).encode()})

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(runner, "run_lm_eval", fake_lm_eval)
    with pytest.raises(SystemExit) as done:
        cli.main(["--store", local_store.url, "eval", "--model", str(model), "--tasks", "arith", "--json"])
    assert done.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"lm_eval": {"ref": "eval/fake", "id": local_store.manifest("eval/fake").id, "results": results}}


def test_printed_paths_do_not_wrap_when_piped(local_store: ArtifactStore, tmp_path: Path) -> None:
    dest = tmp_path / ("a-long-directory-name-" * 6) / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    result = subprocess.run(
        [FLYWHEEL, "--store", local_store.url, "artifacts", "get", "dataset/sft-r1", str(dest)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(str(dest)) > 80 and result.stdout.strip().endswith(f"-> {dest}")
    assert len(result.stdout.strip().splitlines()) == 1


def test_multi_gpu_dry_run_carries_every_override_and_the_store(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    result = run("train", "sft", "--store", store, "--config", SFT_CONFIG, "--gpus", "2", "--dry-run", "total_steps=5",
                 "learning_rate=1e-4")  # fmt: skip
    assert result.returncode == 0, result.stderr
    command = result.stdout.split()
    assert command[:5] == [*accelerate_cli(), "--num_processes", "2"]
    cli = command[command.index("flywheel.flows.cli") :]
    assert cli == ["flywheel.flows.cli", "--store", store, "train", "sft", "--config", SFT_CONFIG,
                   "total_steps=5", "learning_rate=1e-4"]  # fmt: skip


def test_verify_reports_then_cleans_staging_leftovers(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert run("--store", str(store), "artifacts", "verify").returncode == 0
    (store / "tmp").mkdir(exist_ok=True)
    (store / "tmp" / "0123abcd").write_bytes(b"left by a killed put: no writer holds its lock")
    # A leftover is reported (exit 1) until --clean-staging removes it.
    reported = run("artifacts", "verify", "--store", str(store))
    assert reported.returncode == 1 and "staging leftover" in reported.stderr
    assert run("artifacts", "verify", "--clean-staging", "--store", str(store)).returncode == 0
    assert run("artifacts", "verify", "--store", str(store)).returncode == 0


def test_user_text_is_printed_as_text_never_as_markup_or_terminal_codes(
    local_store: ArtifactStore, tmp_path: Path
) -> None:
    for dest in ("out[/x]", "out[link=http://e]here[/link]", "out\x1b[2Jcleared"):
        got = run("--store", local_store.url, "artifacts", "get", "dataset/sft-r1", str(tmp_path / dest))
        assert got.returncode == 0, got.stderr
        assert (tmp_path / dest / "train.jsonl").exists()
        assert got.stdout.strip().endswith(f"-> {tmp_path / dest}".replace("\x1b", "\\x1b"))
        assert "\x1b" not in got.stdout + got.stderr
    unknown = run("--store", local_store.url, "artifacts", "show", "\x1b[2J[/x]")
    assert_one_line_error(unknown, "unknown artifact ref '\\x1b[2J[/x]'")
    assert "\x1b" not in unknown.stderr


def test_a_forged_manifest_name_is_one_escaped_line_in_ls_and_lineage(local_store: ArtifactStore) -> None:
    base = local_store.manifest("dataset/sft-r1").model_dump(mode="json")
    raw = json.dumps({**base, "name": "evil\x1b[2J[/]"}, sort_keys=True, separators=(",", ":")).encode()
    forged = hashlib.sha256(raw).hexdigest()
    Path(local_store._manifest_path(forged)).write_bytes(raw)
    local_store.set_ref("evil", forged)
    for argv in (["artifacts", "ls"], ["artifacts", "lineage", "evil"]):
        result = run("--store", local_store.url, *argv)
        assert_one_line_error(result, f"manifest {forged}", "invalid artifact name 'evil\\x1b[2J[/]'")
        assert "\x1b" not in result.stderr


def test_lineage_of_a_long_chain_prints_every_artifact(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    ids = put_chain(store, 600)
    result = run("--store", store.url, "artifacts", "lineage", ids[-1])
    assert result.returncode == 0, result.stderr
    assert [line.split()[-2] for line in result.stdout.splitlines()[1:]] == [i[:12] for i in ids[-2::-1]]


def test_eval_takes_the_infra_failure_threshold_and_checks_its_range(tmp_path: Path) -> None:
    result = run("--store", str(tmp_path), "eval", "--model", "tiny", "--suite", "agentic",
                 "--max-infra-failure-rate", "1.5")  # fmt: skip
    assert_one_line_error(result, "--max-infra-failure-rate", code=2)


def test_every_json_command_prints_only_json_on_stdout(tmp_path: Path) -> None:
    """On a fresh store `model prepare` builds the model (transformers and DeepSpeed imported, and
    DeepSpeed logs to stdout on import): stdout still parses as JSON. `eval --json` runs in
    tests/flows/test_user_folder.py."""
    with_json = {path for path in SUBCOMMANDS if any(p.name == "as_json" for p in _command(path).params)}
    assert with_json == {("model", "prepare"), ("artifacts", "ls"), ("artifacts", "show"), ("eval",)}
    env = {"FLYWHEEL_CACHE": str(tmp_path / "cache")}
    store = str(tmp_path / "store")
    for argv in (["model", "prepare", "tiny"], ["artifacts", "ls"], ["artifacts", "show", "model/tiny"]):
        result = run("--store", store, *argv, "--json", env=env)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout), argv


def _command(path: tuple[str, ...]) -> Any:
    command = typer.main.get_command(cli.app)
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    return command
