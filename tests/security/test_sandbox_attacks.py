"""Red-team findings against the sandbox, each reproduced as an attack that must now fail.

Every test here runs isolated (root + bubblewrap); CI sets FLYWHEEL_REQUIRE_ISOLATION=1 so a
machine that cannot isolate fails instead of skipping them.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.environments.errors import SandboxViolation
from flywheel.environments.sandbox import box as sandbox_module
from flywheel.environments.sandbox.box import LocalSandbox, SandboxLimits, isolation_available, isolation_report

REQUIRED = os.environ.get("FLYWHEEL_REQUIRE_ISOLATION") == "1"
isolated = pytest.mark.skipif(not isolation_available() and not REQUIRED, reason="needs root and bubblewrap")


def test_ci_runs_the_sandbox_isolated() -> None:
    """On CI (root) the isolated tests must run, not skip."""
    if REQUIRED:
        assert os.geteuid() == 0, "CI must run as root"
        assert isolation_available(), isolation_report()
    else:
        pytest.skip("FLYWHEEL_REQUIRE_ISOLATION is not set")


@pytest.fixture
def box() -> Iterator[LocalSandbox]:
    sandbox = LocalSandbox("attack-7", limits=SandboxLimits(timeout_s=10, max_output_bytes=8192))
    yield sandbox
    sandbox.cleanup()


def _scan(uid: int) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state not in ("Z", "X") or len(os.listdir(f"/proc/{entry}/task")) > 1:
                return True
        except FileNotFoundError:
            continue
    return False


# -- processes -------------------------------------------------------------------------------------

HALF_DEAD = r"""
import ctypes, os, threading, time
if os.fork() == 0:
    os.setsid()
    def beat():
        while True:
            with open('beat', 'a') as f:
                f.write('.')
            time.sleep(0.05)
    threading.Thread(target=beat).start()
    ctypes.CDLL(None).pthread_exit(None)   # Only the main thread ends: the process shows Z.
time.sleep(0.5)
"""


@isolated
def test_half_dead_thread_group_in_a_new_session_dies_with_the_command(box: LocalSandbox) -> None:
    box.write_file("half_dead.py", HALF_DEAD)
    box.run("python half_dead.py")
    size = (box.workspace / "beat").stat().st_size
    time.sleep(0.4)
    assert (box.workspace / "beat").stat().st_size == size, "a thread kept writing after the command"
    assert not _scan(box.uid)


@isolated
def test_nothing_survives_cleanup(box: LocalSandbox) -> None:
    box.write_file("half_dead.py", HALF_DEAD)
    box.run("python half_dead.py & (setsid sleep 300 &); nohup sleep 300 >/dev/null 2>&1 & sleep 0.3")
    uid = box.uid
    box.cleanup()
    assert not _scan(uid)


@isolated
def test_fork_loop_hits_the_process_cap_not_the_timeout(box: LocalSandbox) -> None:
    script = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError as err:\n    print('capped', n, err.errno)\n"
    )
    box.write_file("forks.py", script)
    result = box.run("python forks.py")
    assert not result.timed_out
    words = result.output.split()
    assert words[0] == "capped" and int(words[1]) < box.limits.max_processes and words[2] == "11"


@isolated
def test_other_processes_are_invisible_in_proc(box: LocalSandbox) -> None:
    secret = f"--api-key=sk-planted-{os.getpid()}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", secret])
    try:
        result = box.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '; ls /proc | grep -c '^[0-9]'")
        assert "sk-planted" not in result.output
        assert int(result.output.split()[-1]) <= 4  # bwrap's init, bash, cat/ls, tr: the sandbox's own.
    finally:
        host.kill()


@isolated
def test_parent_environment_is_not_inherited(box: LocalSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_PLANTED_SECRET", "hunter2")
    result = box.run("env; cat /proc/1/environ; cat /proc/$PPID/environ")
    assert "hunter2" not in result.output


@isolated
def test_cannot_mount_or_rename_the_host(box: LocalSandbox) -> None:
    result = box.run("mount -t tmpfs none /tmp; hostname evil; echo end")
    assert "must be superuser" in result.output and "must be root" in result.output


@isolated
def test_a_user_namespace_gains_nothing_on_the_host(box: LocalSandbox) -> None:
    """`unshare -r` works (the kernel allows user namespaces), but its root is the sandbox uid outside."""
    result = box.run("unshare -r sh -c 'id -u; cat /etc/shadow; touch /usr/pwned; echo end'")
    assert "Permission denied" in result.output and not Path("/usr/pwned").exists()


@isolated
def test_cannot_ptrace_or_signal_the_sandbox_init(box: LocalSandbox) -> None:
    result = box.run("kill -9 1; python -c \"import ctypes; print('ptrace', ctypes.CDLL(None).ptrace(16, 1, 0, 0))\"")
    assert "ptrace -1" in result.output
    assert box.run("echo alive").output.strip() == "alive"


@isolated
def test_no_capabilities_and_no_new_privileges(box: LocalSandbox) -> None:
    result = box.run("grep -E 'CapEff|CapBnd|NoNewPrivs' /proc/self/status")
    fields = dict(line.split(":\t") for line in result.output.strip().splitlines())
    assert fields["CapEff"].strip() == "0000000000000000" and fields["CapBnd"].strip() == "0000000000000000"
    assert fields["NoNewPrivs"].strip() == "1"


@isolated
def test_device_nodes_cannot_be_made(box: LocalSandbox) -> None:
    result = box.run("mknod disk b 8 0; ls /dev/vda /dev/sda /dev/mem 2>&1; echo end")
    assert "No such file" in result.output and not (box.workspace / "disk").exists()


# -- uids ------------------------------------------------------------------------------------------


@isolated
def test_uids_stay_unique_past_a_thousand_sandboxes(box: LocalSandbox) -> None:
    for _ in range(1001):
        other = LocalSandbox("churn")
        try:
            assert other.uid != box.uid
        finally:
            other.cleanup()


@isolated
def test_uids_are_unique_across_processes(tmp_path: Path) -> None:
    held = [LocalSandbox("parent") for _ in range(40)]
    try:
        code = (
            "from flywheel.environments.sandbox.box import LocalSandbox\n"
            "boxes = [LocalSandbox('child') for _ in range(40)]\n"
            "print(' '.join(str(b.uid) for b in boxes))\n"
            "[b.cleanup() for b in boxes]\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        child = {int(u) for u in out.split()}
        assert len(child) == 40 and not child & {b.uid for b in held}
    finally:
        for b in held:
            b.cleanup()


# -- what the agent can see ------------------------------------------------------------------------


@isolated
def test_workspace_name_does_not_reveal_the_task(box: LocalSandbox) -> None:
    assert "attack" not in str(box.workspace)
    assert len(box.workspace.name) == 32 and int(box.workspace.name, 16) >= 0  # 128 random bits, nothing else.


@isolated
def test_project_source_cannot_be_imported_or_read(box: LocalSandbox) -> None:
    """The agent cannot regenerate its task (and its hidden answer) from our code."""
    repo = Path(__file__).resolve().parents[2]
    assert "ModuleNotFoundError" in box.run("python -c 'import flywheel.environments.task_stream'").output
    listing = box.run(f"ls -a {repo}").output
    # Only the Python environment is bound in (when it lies inside the checkout), or nothing at all.
    assert "No such file or directory" in listing or set(listing.split()) <= {".", "..", ".venv"}
    assert "No such file" in box.run(f"cat {repo}/environments/task_stream.py").output


@isolated
def test_root_home_marker_is_hidden(box: LocalSandbox) -> None:
    marker = Path("/root") / f"flywheel-marker-{os.getpid()}"
    marker.write_text("root-only")
    try:
        assert marker.name not in box.run("ls -a /root").output
        result = box.run(f"cat {marker}")
        assert "root-only" not in result.output and "No such file" in result.output
    finally:
        marker.unlink()


@isolated
def test_run_lock_is_private_and_does_not_survive(box: LocalSandbox) -> None:
    box.run("echo mine > /run/lock/planted || echo mine > /run/planted")
    other = LocalSandbox("neighbour")
    try:
        assert "mine" not in other.run("cat /run/lock/planted /run/planted").output
    finally:
        other.cleanup()
    assert not Path("/run/lock/planted").exists() and not Path("/run/planted").exists()


@isolated
def test_sys_and_host_sockets_are_out_of_reach(box: LocalSandbox) -> None:
    result = box.run(f"ls /sys /var/run; ls /run; ls {box.workspace.parent}")  # The root: FLYWHEEL_SANDBOX_ROOT's.
    assert result.output.count("No such file") == 2
    assert result.output.split()[-1] == box.workspace.name and "docker" not in result.output


# -- file tools ------------------------------------------------------------------------------------

SWAPPER = r"""
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
swaps, end = 0, time.time() + 3
while time.time() < end:
    swaps += libc.renameat2(-100, b'd', -100, b'l', 2) == 0  # RENAME_EXCHANGE: folder <-> symlink to the host.
print('swaps', swaps)
"""


@isolated
def test_file_tools_cannot_be_raced_out_of_the_workspace(box: LocalSandbox, tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret.txt").write_text("host-secret")
    os.chmod(tmp_path, 0o755)
    box.write_file("d/secret.txt", "decoy")
    box.write_file("swap.py", SWAPPER)
    box.run(f"ln -s {host} l")
    raced: list[str] = []
    racer = threading.Thread(target=lambda: raced.append(box.run("python swap.py").output), daemon=True)
    racer.start()
    time.sleep(0.3)
    seen, refused = Counter[object](), 0
    while racer.is_alive():  # Every tool call below races the swapper.
        for action in (lambda: box.read_file("d/secret.txt"), lambda: box.write_file("d/planted.txt", "pwn")):
            try:
                seen[action()] += 1
            except (SandboxViolation, OSError):
                refused += 1
    racer.join(timeout=15)
    # The racer swapped thousands of times while the tools ran: they read the decoy and were refused the symlink.
    assert raced and raced[0].startswith("swaps ") and int(raced[0].split()[1]) > 1000, raced
    assert seen["decoy"] and refused, (seen, refused)
    assert "host-secret" not in seen
    assert not (host / "planted.txt").exists()
    assert (host / "secret.txt").stat().st_uid == 0


@isolated
def test_write_file_on_a_fifo_does_not_hang(box: LocalSandbox) -> None:
    box.run("mkfifo pipe")
    outcome: list[object] = []

    def write() -> None:
        try:
            box.write_file("pipe", "x")
            outcome.append("wrote")
        except (OSError, SandboxViolation) as err:
            outcome.append(err)

    worker = threading.Thread(target=write, daemon=True)
    worker.start()
    worker.join(timeout=5)
    assert outcome and outcome[0] != "wrote"
    with pytest.raises((OSError, SandboxViolation)):
        box.read_file("pipe")


@isolated
def test_symlink_to_a_root_only_file_cannot_be_read(box: LocalSandbox) -> None:
    box.run("ln -s /etc/shadow shadow; ln -s / rootlink")
    with pytest.raises(SandboxViolation):
        box.read_file("shadow")
    with pytest.raises(SandboxViolation):
        box.read_file("rootlink/etc/shadow")


@isolated
def test_hard_link_to_a_host_file_is_impossible(box: LocalSandbox) -> None:
    result = box.run("ln /etc/passwd pw; ln /usr/bin/python3 py; ls pw py")
    assert "No such file" in result.output


def test_deeply_nested_folders_do_not_break_listing_or_cleanup(box: LocalSandbox) -> None:
    box.run("p=.; for i in $(seq 1100); do p=$p/d; done; mkdir -p $p && touch $p/f", timeout_s=30)
    listing = box.list_files(".")
    assert listing[0] == "d/" and len(listing) > 100
    workspace = box.workspace
    box.cleanup()
    assert not workspace.exists()


# -- resource caps ---------------------------------------------------------------------------------


@isolated
def test_workspace_disk_cap(box: LocalSandbox) -> None:
    limits = SandboxLimits(workspace_bytes=32 << 20, max_file_bytes=64 << 20)
    small = LocalSandbox("disk", limits=limits)
    try:
        result = small.run("head -c 48M /dev/zero > big; echo rc=$?")
        assert "No space left" in result.output
        assert os.statvfs(small.workspace).f_blocks * os.statvfs(small.workspace).f_frsize <= 32 << 20
    finally:
        small.cleanup()


@isolated
def test_workspace_inode_cap() -> None:
    small = LocalSandbox("inodes", limits=SandboxLimits(max_inodes=500))
    try:
        result = small.run("for i in $(seq 1000); do touch f$i || { echo stopped at $i; break; }; done")
        assert "No space left" in result.output and "stopped at" in result.output
    finally:
        small.cleanup()


@isolated
def test_total_memory_cap_holds_across_processes() -> None:
    limits = SandboxLimits(total_memory_bytes=160 << 20, memory_bytes=1 << 30, timeout_s=30)
    small = LocalSandbox("memory", limits=limits)
    try:
        if not small._cgroup or not small._cgroup.paths:
            assert not REQUIRED, "CI machines must offer a memory cgroup"
            pytest.skip("no writable memory cgroup here")
        hog = "python -c 'b = bytearray(100 << 20); import time; time.sleep(3)'"
        result = small.run(f"{hog} & {hog} & {hog} & wait; echo done")
        assert "done" in result.output
        assert "Killed" in result.output or "MemoryError" in result.output
    finally:
        small.cleanup()


# -- without root ----------------------------------------------------------------------------------


def test_unisolated_sandbox_says_so_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sandbox_module, "_ISOLATION", False)
    monkeypatch.setattr(sandbox_module, "_WARNED", False)
    monkeypatch.delenv("FLYWHEEL_REQUIRE_ISOLATION", raising=False)  # Development: allowed, with a warning.
    with caplog.at_level(logging.WARNING, logger="flywheel.environments.sandbox.box"):
        boxes = [LocalSandbox("plain") for _ in range(3)]
    for b in boxes:
        assert b.run("echo ok").output.strip() == "ok"
        b.cleanup()
    warnings = [r for r in caplog.records if "NOT isolated" in r.getMessage()]
    assert len(warnings) == 1
    assert isolation_report()["isolated"] is False and "rlimits" in isolation_report()["backend"]


def test_where_isolation_is_required_an_unisolated_sandbox_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sandbox_module, "_ISOLATION", False)
    monkeypatch.setenv("FLYWHEEL_REQUIRE_ISOLATION", "1")
    with pytest.raises(sandbox_module.SandboxUnavailable, match="FLYWHEEL_REQUIRE_ISOLATION=1.*bubblewrap"):
        LocalSandbox("refused", root=tmp_path)
    assert list(tmp_path.iterdir()) == []  # No workspace left behind.


_PLANT_KEY = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
print(libc.syscall(248, b"user", b"planted", b"secret", 6, ctypes.c_int(-4)))  # add_key to the user keyring.
"""
_FIND_KEY = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.syscall(250, 10, ctypes.c_int(-4), b"user", b"planted", 0))  # KEYCTL_SEARCH of @u: serial, or -1.
"""


def _as_uid(uid: int, script: str) -> int:
    """Run `script` as `uid` (as a sandbox command runs) and return the number it prints."""
    done = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-I",
                           "-c", script], capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    return int(done.stdout)


@isolated
def test_a_key_planted_in_the_uids_keyring_is_gone_for_the_next_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keyrings belong to the uid, not to a namespace: the pool empties them when it leases the uid again."""
    from flywheel.environments.sandbox import jail

    monkeypatch.setattr(jail._LEASE_STARTS, "randrange", lambda n: 12_345)  # The same first-free uid twice.
    first = jail.UidLease(jail.UID_LOCKS)
    uid = first.uid
    assert _as_uid(uid, _PLANT_KEY) > 0 and _as_uid(uid, _FIND_KEY) > 0  # Planted; readable by the uid.
    first.release()
    second = jail.UidLease(jail.UID_LOCKS)
    try:
        assert second.uid == uid and _as_uid(uid, _FIND_KEY) == -1
    finally:
        second.release()


@isolated
def test_leasing_a_uid_leaves_the_global_rng_as_the_trainer_seeded_it(tmp_path: Path) -> None:
    """Every rank seeds the global RNG alike: drawn from it, their leases would all start at one uid, and each
    lease would shift the RNG state a step checkpoint saves (a resumed run would then differ)."""
    from flywheel.environments.sandbox import jail

    random.seed(7)
    before = random.getstate()
    leases = [jail.UidLease(tmp_path / "uids") for _ in range(2)]
    try:
        assert random.getstate() == before and leases[0].uid != leases[1].uid
    finally:
        for lease in leases:
            lease.release()


@isolated
def test_two_sandbox_roots_never_lease_the_same_uid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The uid range is the machine's: a pool per root let B's clean-up kill A's command."""
    from flywheel.environments.sandbox import jail

    monkeypatch.setattr(jail._LEASE_STARTS, "randrange", lambda n: 23_456)  # Both pools would try the same uid first.
    a = LocalSandbox("roots-a", root=tmp_path / "a")
    b = LocalSandbox("roots-b", root=tmp_path / "b")
    try:
        assert a.uid != b.uid
    finally:
        a.cleanup()
        b.cleanup()


@isolated
def test_the_pids_cgroup_is_made_on_cgroup_v1_too() -> None:
    """On v1 the pids hierarchy's root has no pids.max (only its children do): it was never created."""
    from flywheel.environments.sandbox import jail

    if not (Path("/sys/fs/cgroup/pids/cgroup.procs").exists() or Path("/sys/fs/cgroup/cgroup.controllers").exists()):
        pytest.skip("no pids cgroup on this machine")
    group = jail.Cgroup(f"flywheel-test-{os.getpid()}", 64 << 20, 7)
    try:
        assert [(p / "pids.max").read_text().strip() for p in group.paths if (p / "pids.max").exists()] == ["7"]
    finally:
        group.remove()
