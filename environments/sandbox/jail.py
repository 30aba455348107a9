"""The isolated backend's boundary: bubblewrap namespaces, a uid pool, cgroups, a capped workspace.

Every command runs under `bwrap` in fresh PID, network, IPC, UTS and mount namespaces. The
filesystem is an empty tmpfs with only the system folders (read-only), the Python environment
(read-only) and the task's workspace bound in: no project source, no other workspace, no /root,
a private /tmp and /run, and a /proc that shows only the sandbox's own processes. `setpriv`
then drops to the sandbox's uid with no capabilities and `no_new_privs`. When the namespace's
first process ends, the kernel kills every process in it: nothing a command starts outlives it,
whatever it forks, `setsid`s or leaves as a half-dead thread group.

The uid comes from one pool of lock files per machine (`flock`, released by the kernel when the
holder dies), so two sandboxes never share a uid, across processes and sandbox roots too. Keys are
per uid, not per namespace: a leased uid's user keyrings are emptied before its new holder runs.
The workspace is its own tmpfs (size and inode caps), and a cgroup per sandbox caps memory and
processes when the machine has one.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

_UID_BASE = 200_000
_UID_COUNT = 60_000
# Where a lease starts looking. Not the global RNG: every trainer seeds that alike, so every rank would start
# at the same uid, and each lease would shift the trainer's RNG state.
_LEASE_STARTS = random.SystemRandom()
UID_LOCKS = Path("/run/flywheel/sandbox-uids")  # One pool per machine: the uid range is the machine's.
_CLEAR_KEYRINGS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
keyctl = {"x86_64": 250, "aarch64": 219}[os.uname().machine]
for keyring in (-4, -5):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
    serial = libc.syscall(keyctl, 0, ctypes.c_int(keyring), 0)  # KEYCTL_GET_KEYRING_ID, no create.
    if serial > 0 and libc.syscall(keyctl, 7, ctypes.c_int(serial)) != 0:  # KEYCTL_CLEAR
        raise SystemExit(os.strerror(ctypes.get_errno()))
"""
_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_SCRATCH = ("/tmp", "/var/tmp", "/run", "/dev/shm")

_libc = ctypes.CDLL(None, use_errno=True)


def bwrap_path() -> str | None:
    """The bubblewrap binary, if installed."""
    return shutil.which("bwrap")


class UidLease:
    """A uid no other live sandbox on this machine holds, for as long as this object is open."""

    def __init__(self, lock_dir: Path) -> None:
        lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        start = _LEASE_STARTS.randrange(_UID_COUNT)
        for offset in range(_UID_COUNT):
            uid = _UID_BASE + (start + offset) % _UID_COUNT
            fd = os.open(lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            kill_uid(uid)  # A crashed holder's stragglers (the namespaces should have left none).
            clear_keyrings(uid)
            return
        raise OSError(f"no free sandbox uid in {_UID_BASE}..{_UID_BASE + _UID_COUNT}")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def clear_keyrings(uid: int) -> None:
    """Empty `uid`'s user and user-session keyrings, as `uid` (only the owner may): a key the last holder
    of the uid planted would otherwise be readable by the next sandbox leased it. A uid with no keyring
    (no line in /proc/key-users, the usual case) needs no child process on each lease."""
    if uid not in _uids_with_keys():
        return
    done = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-I", "-c", _CLEAR_KEYRINGS],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if done.returncode != 0:
        raise OSError(f"cannot clear the keyrings of sandbox uid {uid}: {done.stderr.strip()[-300:]}")


def _uids_with_keys() -> set[int]:
    """The uids that own keys or keyrings now (`/proc/key-users`: `<uid>: <usage> ...`); all of them if it
    cannot be read, so a lease clears rather than skips."""
    try:
        lines = Path("/proc/key-users").read_text().splitlines()
    except OSError:
        return set(range(_UID_BASE, _UID_BASE + _UID_COUNT))
    return {int(line.split(":")[0]) for line in lines if line.split(":")[0].strip().isdigit()}


def mount_workspace(path: Path, uid: int, size_bytes: int, max_inodes: int) -> None:
    """Make `path` a private tmpfs owned by `uid`: the sandbox's disk and inode caps."""
    options = f"size={size_bytes},nr_inodes={max_inodes},mode=0700,uid={uid},gid={uid}"
    if _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot mount the workspace tmpfs on {path}: {os.strerror(code)}")


def unmount_workspace(path: Path) -> None:
    """Detach the workspace tmpfs (its content goes with it) and remove the mount point."""
    _libc.umount2(str(path).encode(), _MNT_DETACH)
    with contextlib.suppress(OSError):
        path.rmdir()


def workspace_mounts(base: Path) -> list[tuple[Path, int]]:
    """The tmpfs workspaces mounted directly under `base`, with the uid each was made for."""
    found, base = [], base.resolve()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        point = Path(left.split()[4].replace("\\040", " "))  # mountinfo writes a space as \040.
        fstype, _source, options = [*right.split(), "", "", ""][:3]
        uid = next((int(o[4:]) for o in options.split(",") if o.startswith("uid=") and o[4:].isdigit()), None)
        if fstype == "tmpfs" and point.parent == base and uid is not None:
            found.append((point, uid))
    return found


def sweep_stale_workspaces(base: Path, lock_dir: Path) -> int:
    """Unmount the workspaces of sandboxes that died without cleaning up; returns how many.

    A workspace is mounted only while its uid is leased, and the kernel drops a dead holder's
    `flock`: a mount whose uid lock can be taken has no live sandbox. The lock is held while the
    mount goes, so no new sandbox can lease that uid meanwhile.
    """
    swept = 0
    for point, uid in workspace_mounts(base):
        fd = os.open(lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # A live sandbox.
        try:
            kill_uid(uid)
            unmount_workspace(point)
            swept += 1
        finally:
            os.close(fd)
    return swept


class Cgroup:
    """A per-sandbox memory + pids cgroup (v2, or v1 hierarchies); absent when the machine has none."""

    def __init__(self, name: str, memory_bytes: int, max_processes: int) -> None:
        self.paths: list[Path] = []
        for base, files in _cgroup_bases():
            path = base / name
            try:
                path.mkdir(exist_ok=True)
                for file, value in files(memory_bytes, max_processes).items():
                    if (path / file).exists():
                        (path / file).write_text(str(value))
            except OSError:
                continue
            self.paths.append(path)

    def attach(self, pid: int) -> None:
        """Move `pid` (the command, before it execs) into every hierarchy of this cgroup."""
        for path in self.paths:
            with open(path / "cgroup.procs", "w") as handle:
                handle.write(str(pid))

    def kill(self) -> None:
        """SIGKILL whatever is still in the cgroup (defence in depth behind the PID namespace)."""
        for path in self.paths:
            if (path / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    (path / "cgroup.kill").write_text("1")
                continue
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)

    def remove(self) -> None:
        self.kill()
        for path in self.paths:
            with contextlib.suppress(OSError):
                path.rmdir()


def _cgroup_bases() -> list[tuple[Path, object]]:
    """Writable cgroup folders of this process: v2 with memory+pids, else the v1 memory/pids trees."""
    root = Path("/sys/fs/cgroup")
    own = _own_cgroups()
    if "memory" in _read(root / "cgroup.controllers").split():
        return [(root / own.get("", "/").lstrip("/"), _v2_files)]
    bases: list[tuple[Path, object]] = []
    if (root / "memory" / "memory.limit_in_bytes").exists():
        bases.append((root / "memory" / own.get("memory", "/").lstrip("/"), _v1_memory_files))
    if (root / "pids" / "cgroup.procs").exists():  # The v1 root has no pids.max; only its children do.
        bases.append((root / "pids" / own.get("pids", "/").lstrip("/"), _v1_pids_files))
    return [(base, files) for base, files in bases if os.access(base, os.W_OK)]


def _v2_files(memory: int, processes: int) -> dict[str, int]:
    return {"memory.max": memory, "memory.swap.max": 0, "pids.max": processes}


def _v1_memory_files(memory: int, processes: int) -> dict[str, int]:
    return {"memory.limit_in_bytes": memory}


def _v1_pids_files(memory: int, processes: int) -> dict[str, int]:
    return {"pids.max": processes}


def _own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path ('' is the v2 tree)."""
    out = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            out[controller] = path
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def bwrap_argv(workspace: Path, uid: int, tmp_bytes: int, command: str) -> list[str]:
    """The `bwrap ... setpriv ... bash -c command` line of one isolated command."""
    argv = [
        bwrap_path() or "bwrap",
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--hostname", "sandbox",
    ]  # fmt: skip
    for folder in _SYSTEM_DIRS:
        if os.path.islink(folder):
            argv += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            argv += ["--ro-bind", folder, folder]
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "0755", "--dir", "/var"]
    for folder in _SCRATCH:
        argv += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", folder]
    made: set[str] = {"/", *_SYSTEM_DIRS, *_SCRATCH, "/proc", "/dev", "/var"}
    for source, writable in [*((p, False) for p in python_dirs()), (str(workspace), True)]:
        for ancestor in reversed(Path(source).parents):
            if str(ancestor) not in made and not _under_system_dir(ancestor):
                argv += ["--perms", "0755", "--dir", str(ancestor)]
                made.add(str(ancestor))
        argv += ["--bind" if writable else "--ro-bind", source, source]
    argv += ["--chdir", str(workspace), "--", shutil.which("setpriv") or "setpriv"]
    argv += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
    argv += ["--no-new-privs", "/bin/bash", "-c", command]
    return argv


def _under_system_dir(path: Path) -> bool:
    return any(path == Path(d) or Path(d) in path.parents for d in _SYSTEM_DIRS)


def python_dirs() -> list[str]:
    """The interpreter's folders the sandbox needs (venv and base install), outside the system dirs."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))}
    keep = sorted(d for d in dirs if not _under_system_dir(Path(d)))
    return [d for d in keep if not any(d != other and d.startswith(other + os.sep) for other in keep)]


def kill_uid(uid: int) -> bool:
    """SIGKILL every live process owned by `uid`; True if any was found.

    A zombie leader whose other threads still run (main thread exited, a thread alive) counts as
    live and is killed; a plain zombie only waits to be reaped and is skipped.
    """
    found = False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid or _fully_dead(entry):
                continue
            os.kill(int(entry), signal.SIGKILL)
            found = True
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def kill_uid_until_gone(uid: int, patience_s: float = 10.0) -> None:
    """Kill `uid`'s processes until none is left (a dying namespace takes a few ms to empty)."""
    deadline = time.monotonic() + patience_s
    while kill_uid(uid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _fully_dead(pid: str) -> bool:
    with open(f"/proc/{pid}/stat") as handle:
        state = handle.read().rsplit(")", 1)[1].split()[0]
    return state in ("Z", "X") and len(os.listdir(f"/proc/{pid}/task")) <= 1
