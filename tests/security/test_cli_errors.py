"""Bad input to the real `flywheel` entry point ends as exactly one `error: ...` line on stderr and
exit code 2 (a bad command line) or 1 (anything else), never a traceback. Every subcommand and
command group is enumerated from the Typer app itself, so a new one is covered without edits here.
Every input fails before a model loads or a server starts."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from flywheel.flows import cli
from flywheel.flows.cli_errors import failure_line
from flywheel.training.config import MAX_CONFIG_BYTES
from tests.flows.test_cli import GROUPS, SUBCOMMANDS, run

SFT_CONFIG = Path(__file__).resolve().parents[2] / "training" / "configs" / "sft_tiny.yaml"


def assert_one_error_line(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The exit code is `code`, stderr is one `error: ` line holding every needle, no traceback anywhere."""
    output = result.stdout + result.stderr
    assert result.returncode == code, output
    assert "Traceback" not in output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_the_app_has_the_subcommands_we_expect_to_cover() -> None:
    assert ("artifacts", "ls") in SUBCOMMANDS and ("serve",) in SUBCOMMANDS and ("infra", "setup") in SUBCOMMANDS
    assert () in GROUPS and ("train",) in GROUPS


@pytest.mark.parametrize("path", SUBCOMMANDS, ids=" ".join)
def test_every_subcommand_answers_an_unknown_option_with_one_usage_line(path: tuple[str, ...]) -> None:
    result = run(*path, "--no-such-option")
    assert_one_error_line(result, 2, "No such option: --no-such-option", f"flywheel {' '.join(path)} --help")


@pytest.mark.parametrize("path", GROUPS, ids=lambda path: " ".join(path) or "flywheel")
def test_every_command_group_without_a_subcommand_lists_the_commands(path: tuple[str, ...]) -> None:
    assert_one_error_line(run(*path), 2, "Missing command.", "Commands: ")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["serve"], "Missing argument"),
        (["serve", "tiny", "--port"], "Option '--port' requires an argument"),
        (["serve", "tiny", "--port", "abc"], "Invalid value for '--port'"),
        (["nope"], "No such command 'nope'"),
        (["artifacts", "show"], "Missing argument"),
    ],
    ids=["missing-argument", "missing-value", "port-abc", "unknown-subcommand", "missing-ref"],
)
def test_usage_errors_are_one_line_and_exit_2(argv: list[str], needle: str) -> None:
    assert_one_error_line(run(*argv), 2, needle)


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_store_that_cannot_be_a_directory_is_one_line(tmp_path: Path, where: str) -> None:
    url = "/proc/version/store" if where == "proc" else str(tmp_path / "a-file")
    (tmp_path / "a-file").write_text("not a store")
    assert_one_error_line(run("--store", url, "artifacts", "ls"), 1)


def test_get_into_a_file_is_a_usage_error(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    store.put("dataset", "d", {"train.jsonl": b"{}\n"})
    target = tmp_path / "a-file"
    target.write_text("keep me")
    result = run("--store", store.url, "artifacts", "get", "dataset/d", str(target))
    assert_one_error_line(result, 2, "is a file")
    assert target.read_text() == "keep me"


def test_an_unreachable_prefect_server_is_one_line(tmp_path: Path) -> None:
    env = {
        "PREFECT_API_URL": "http://127.0.0.1:9/api",
        "PREFECT_CLIENT_MAX_RETRIES": "0",
        "PREFECT_HOME": str(tmp_path / "prefect"),
    }
    assert_one_error_line(run("infra", "setup", env=env), 1, "cannot reach the Prefect API at http://127.0.0.1:9/api")


@pytest.mark.parametrize("case", ["binary", "mixed-keys", "bad-override"])
def test_an_unparsable_config_or_override_is_one_line(tmp_path: Path, case: str) -> None:
    config, overrides = tmp_path / "config.yaml", []
    if case == "binary":
        config.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    elif case == "mixed-keys":
        config.write_text("colour: blue\n2: two\n")  # Two unknown keys, a str and an int.
    else:
        config, overrides = SFT_CONFIG, ["x=["]
    result = run("--store", str(tmp_path / "store"), "train", "sft", "--config", str(config), *overrides)
    assert_one_error_line(result, 1)
    wanted = {"binary": "not UTF-8", "mixed-keys": "field names must be strings", "bad-override": "not valid YAML"}
    assert wanted[case] in result.stderr and "(-v shows the traceback)" not in result.stderr


@pytest.mark.parametrize("option, value", [("--gpus", "-3"), ("--gpus", "0"), ("--nodes", "0")])
def test_gpu_and_machine_counts_below_one_are_usage_errors(tmp_path: Path, option: str, value: str) -> None:
    result = run("--store", str(tmp_path / "store"), "train", "sft", "--config", str(SFT_CONFIG), option, value,
                 "--dry-run")  # fmt: skip
    assert_one_error_line(result, 2, f"Invalid value for '{option}'")
    assert "accelerate" not in result.stdout


@pytest.mark.timeout(120)  # Reading /dev/zero whole would not end.
@pytest.mark.parametrize("command", [["train", "sft"], ["plan"]], ids=" ".join)
@pytest.mark.parametrize("source", ["dev-zero", "over-the-cap"])
def test_a_config_larger_than_the_cap_is_one_line_and_never_read_whole(
    tmp_path: Path, command: list[str], source: str
) -> None:
    config = Path("/dev/zero") if source == "dev-zero" else tmp_path / "huge.yaml"
    if source == "over-the-cap":
        config.write_text("# a comment\n" * (MAX_CONFIG_BYTES // 12 + 1))  # Valid YAML, just too big.
    result = run("--store", str(tmp_path / "store"), *command, "--config", str(config))
    assert_one_error_line(result, 1, f"config {config} is larger than 1 MiB")


def test_failure_lines_are_one_line_and_name_unexpected_error_types() -> None:
    assert failure_line(ValueError("while parsing\n  line 1:\n    [\n"), (ValueError,)) == "while parsing line 1: ["
    assert failure_line(KeyError("k"), (ValueError,)) == "KeyError: 'k' (-v shows the traceback)"
    assert failure_line(KeyError("k"), (ValueError,), verbose=True) == "KeyError: 'k'"
    assert failure_line(RuntimeError(), ()) == "RuntimeError (-v shows the traceback)"


def test_verbose_logs_the_traceback_of_an_unexpected_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "resolve_model", broken)
    with caplog.at_level(logging.DEBUG, logger="flywheel.flows.cli"), pytest.raises(SystemExit) as done:
        cli.main(["-v", "serve", "tiny"])
    assert done.value.code == 1
    assert capsys.readouterr().err.strip() == "error: RuntimeError: a bug"
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [RuntimeError]
