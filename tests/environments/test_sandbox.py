"""Hostile agents: each action is contained and the run goes on (a test per attack)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.environments.errors import SandboxViolation
from flywheel.environments.sandbox.box import LocalSandbox, SandboxLimits
from flywheel.environments.sandbox.jail import kill_uid as _kill_uid
from tests.security.test_sandbox_attacks import isolated  # Skips unisolated, fails under FLYWHEEL_REQUIRE_ISOLATION=1.


@pytest.fixture
def box() -> Iterator[LocalSandbox]:
    sandbox = LocalSandbox("hostile", limits=SandboxLimits(timeout_s=10, max_output_bytes=4096))
    yield sandbox
    sandbox.cleanup()


def _uid_processes(uid: int) -> list[int]:
    """Live (not zombie) processes of `uid`."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid and not _is_zombie(p)]


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return None


def _is_zombie(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_read_with_dotdot_escape_is_refused(box: LocalSandbox) -> None:
    with pytest.raises(SandboxViolation, match="outside the workspace"):
        box.read_file("../../etc/passwd")


def test_read_absolute_path_is_refused(box: LocalSandbox) -> None:
    with pytest.raises(SandboxViolation):
        box.read_file("/etc/passwd")


def test_symlink_to_a_file_outside_is_refused(box: LocalSandbox) -> None:
    assert box.run("ln -s /etc/passwd link").exit_code == 0
    with pytest.raises(SandboxViolation):
        box.read_file("link")


def test_symlinked_folder_cannot_be_written_through(box: LocalSandbox, tmp_path: Path) -> None:
    box.run(f"ln -s {tmp_path} out")
    with pytest.raises(SandboxViolation):
        box.write_file("out/planted.txt", "x")
    assert not (tmp_path / "planted.txt").exists()


def test_write_outside_is_refused(box: LocalSandbox) -> None:
    with pytest.raises(SandboxViolation):
        box.write_file("../escaped.txt", "x")
    assert not (box.workspace.parent / "escaped.txt").exists()


def test_oversized_file_write_is_refused(box: LocalSandbox) -> None:
    with pytest.raises(SandboxViolation, match="exceed"):
        box.write_file("big.txt", "x" * (box.limits.max_file_bytes + 1))


@isolated
def test_shell_cannot_write_system_files(box: LocalSandbox) -> None:
    result = box.run("echo pwned > /etc/flywheel-pwned; echo pwned > /usr/flywheel-pwned")
    assert result.output.count("Read-only file system") == 2
    assert not Path("/etc/flywheel-pwned").exists() and not Path("/usr/flywheel-pwned").exists()


@isolated
def test_tmp_is_private(box: LocalSandbox) -> None:
    marker = f"flywheel-leak-{os.getpid()}"
    assert box.run(f"echo x > /tmp/{marker} && cat /tmp/{marker}").output.strip() == "x"
    assert not Path("/tmp", marker).exists()


@isolated
def test_no_network_even_to_loopback(box: LocalSandbox) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(3)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    threading.Thread(target=lambda: accepted.append(_accept(listener)), daemon=True).start()
    result = box.run(f"python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\"")
    assert result.exit_code != 0
    time.sleep(0.5)
    assert accepted in ([], [None])
    listener.close()


def _accept(listener: socket.socket) -> object:
    try:
        return listener.accept()
    except OSError:
        return None


def test_sleep_forever_times_out(box: LocalSandbox) -> None:
    started = time.monotonic()
    result = box.run("sleep 1000", timeout_s=1)
    assert result.timed_out and result.exit_code == -1
    assert time.monotonic() - started < 8


def test_endless_output_is_capped(box: LocalSandbox) -> None:
    started = time.monotonic()
    result = box.run("yes flood")
    assert result.truncated and len(result.output) < 5000
    assert time.monotonic() - started < 8


def test_memory_hog_fails_alone(box: LocalSandbox) -> None:
    result = box.run("python -c 'x = bytearray(8 << 30)'")
    assert result.exit_code != 0 and "MemoryError" in result.output


@isolated
def test_fork_bomb_is_contained(box: LocalSandbox) -> None:
    started = time.monotonic()
    result = box.run(":(){ :|:& };:; sleep 2", timeout_s=5)
    assert time.monotonic() - started < 20
    assert "Resource temporarily unavailable" in result.output  # The process cap bit, not the timeout.
    assert _uid_processes(box.uid) == []
    assert box.run("echo alive").output.strip() == "alive"  # The sandbox still works afterwards.


@isolated
def test_background_processes_do_not_outlive_the_command(box: LocalSandbox) -> None:
    box.run("(sleep 1000 &); setsid sleep 1000 & nohup sleep 1000 >/dev/null 2>&1 &")
    assert _uid_processes(box.uid) == []


@isolated
def test_cannot_kill_the_parent(box: LocalSandbox) -> None:
    result = box.run(f"kill -9 {os.getpid()}; kill -9 $PPID; kill -9 1; echo done")
    assert "done" in result.output
    assert "Operation not permitted" in result.output


@isolated
def test_cannot_read_another_tasks_workspace(box: LocalSandbox) -> None:
    other = LocalSandbox("neighbour")
    try:
        other.write_file("secret.txt", "s3cr3t")
        result = box.run(f"cat {other.workspace}/secret.txt; ls {other.workspace}")
        assert "s3cr3t" not in result.output and "No such file" in result.output
    finally:
        other.cleanup()


@isolated
def test_sandbox_root_shows_only_its_own_workspace(box: LocalSandbox) -> None:
    other = LocalSandbox("neighbour")
    try:
        result = box.run(f"ls -a {box.workspace.parent}")
        assert result.output.split() == [".", "..", box.workspace.name]
    finally:
        other.cleanup()


@isolated
def test_root_home_is_hidden(box: LocalSandbox) -> None:
    result = box.run("ls -a /root; cat /root/.bashrc /root/.profile 2>&1")
    assert ".bashrc" not in result.output.split("\n")[0]
    assert "No such file" in result.output


def test_huge_file_hits_the_size_limit(box: LocalSandbox) -> None:
    result = box.run("head -c 200M /dev/zero > big.bin")
    assert result.exit_code != 0
    assert (box.workspace / "big.bin").stat().st_size <= box.limits.max_file_bytes


def test_too_many_open_files_fails_alone(box: LocalSandbox) -> None:
    result = box.run("python -c \"fs = [open('f%d' % i, 'w') for i in range(5000)]\"")
    assert result.exit_code != 0 and "Too many open files" in result.output


def test_reading_stdin_does_not_hang(box: LocalSandbox) -> None:
    started = time.monotonic()
    result = box.run("read line; cat; echo ok")
    assert result.output.strip().endswith("ok") and time.monotonic() - started < 5


def test_locked_down_workspace_is_still_cleaned_up(box: LocalSandbox) -> None:
    box.run("mkdir -p a/b && touch a/b/f && chmod -R 000 a && chmod 000 .")
    workspace = box.workspace
    box.cleanup()
    assert not workspace.exists()


def test_commands_after_cleanup_are_refused(box: LocalSandbox) -> None:
    from flywheel.environments.errors import InfraError

    box.cleanup()
    with pytest.raises(InfraError, match="cleaned up"):
        box.run("echo hi")


@isolated
def test_setuid_escalation_is_not_possible(box: LocalSandbox) -> None:
    result = box.run("id -u; python -c 'import os; os.setuid(0)'")
    assert result.output.split()[0] == str(box.uid)
    assert "PermissionError" in result.output or "Operation not permitted" in result.output


def test_kill_uid_helper_ignores_unknown_uids() -> None:
    assert _kill_uid(4_000_000) is False


_DIE_WITH_A_MOUNTED_WORKSPACE = """
import os, signal, sys
from pathlib import Path
from flywheel.environments.sandbox.box import LocalSandbox
box = LocalSandbox("killed", root=Path(sys.argv[1]))
box.write_file("big.bin", "x" * 1000)
print(box.workspace, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@isolated
def test_workspaces_a_killed_process_left_mounted_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    import subprocess
    import sys

    from flywheel.environments.sandbox import jail

    root = tmp_path / "boxes"
    killed = subprocess.run([sys.executable, "-c", _DIE_WITH_A_MOUNTED_WORKSPACE, str(root)], capture_output=True,
                            text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    stale = Path(killed.stdout.strip())
    assert stale in [point for point, _ in jail.workspace_mounts(root)]
    live = LocalSandbox("live", root=root)  # The first sandbox of a process on a root sweeps it.
    try:
        mounted = [point for point, _ in jail.workspace_mounts(root)]
        assert stale not in mounted and not stale.exists() and live.workspace in mounted
        assert jail.sweep_stale_workspaces(root, jail.UID_LOCKS) == 0  # Its uid lock is held.
        assert live.run("echo ok").output.strip() == "ok"
    finally:
        live.cleanup()
    assert jail.workspace_mounts(root) == []
