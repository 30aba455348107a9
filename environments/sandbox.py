"""Sandboxes: a workspace per task where the agent's commands and file edits happen.

`LocalSandbox` is the local backend. As root it runs every command as a task-specific
unprivileged uid, in fresh network and mount namespaces (no network, a private /tmp), under
rlimits (memory, processes, file size, open files), in its own session with a timeout, with
output capped; after each command every process of that uid is killed, so nothing outlives it.
Without root it falls back to rlimits + timeout + process-group kill. File access through the
sandbox refuses any path that resolves outside the workspace (symlinks included).

A docker or modal backend implements the same `Sandbox` protocol.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

from environments.errors import InfraError, SandboxViolation

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_REC = 16384
_MS_BIND = 4096
_MS_PRIVATE = 1 << 18
_UID_BASE = 200_000
_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


class SandboxLimits(BaseModel):
    """Resource limits for every command run in a sandbox."""

    timeout_s: float = Field(default=30.0, gt=0, description="Wall-clock limit per command.")
    max_output_bytes: int = Field(default=16_384, gt=0, description="Output kept per command; the rest is cut.")
    memory_bytes: int = Field(default=2 << 30, description="Address-space limit (RLIMIT_AS).")
    max_processes: int = Field(default=128, description="Processes of the sandbox uid (RLIMIT_NPROC).")
    max_file_bytes: int = Field(default=64 << 20, description="Largest file a command may write.")
    max_open_files: int = Field(default=256, description="Open file descriptors per process.")
    tmpfs_size: str = Field(default="64m", description="Size of the private /tmp when isolated.")


@dataclass
class CommandResult:
    """What a command did: exit code (-1 on timeout) and combined, capped output."""

    exit_code: int
    output: str
    timed_out: bool = False
    truncated: bool = False

    def as_dict(self) -> dict[str, object]:
        return {"exit_code": self.exit_code, "output": self.output}


class Sandbox(Protocol):
    """What tools and verifiers need from a sandbox backend."""

    workspace: Path

    def run(self, command: str, timeout_s: float | None = None) -> CommandResult: ...

    def read_file(self, path: str) -> str: ...

    def write_file(self, path: str, content: str) -> None: ...

    def list_files(self, path: str = ".") -> list[str]: ...

    def cleanup(self) -> None: ...


def default_sandbox_root() -> Path:
    """`$FLYWHEEL_SANDBOX_ROOT`, else a folder outside /tmp and /root (both are hidden from the agent)."""
    configured = os.environ.get("FLYWHEEL_SANDBOX_ROOT")
    if configured:
        return Path(configured)
    if os.geteuid() == 0:
        return Path("/var/lib/flywheel/sandboxes")
    return Path.home() / ".cache" / "flywheel" / "sandboxes"


def isolation_available() -> bool:
    """True when commands can run as another uid in their own namespaces (root on Linux)."""
    return sys.platform == "linux" and os.geteuid() == 0 and _probe_namespaces()


_NAMESPACES_OK: bool | None = None


def _probe_namespaces() -> bool:
    global _NAMESPACES_OK
    if _NAMESPACES_OK is None:
        try:
            subprocess.run(["true"], preexec_fn=lambda: _unshare(_CLONE_NEWNET), check=True, timeout=10)
            _NAMESPACES_OK = True
        except (OSError, subprocess.SubprocessError):
            _NAMESPACES_OK = False
    return _NAMESPACES_OK


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare failed")


class LocalSandbox:
    """A temporary workspace plus contained command execution on this machine."""

    def __init__(self, task_id: str, root: Path | None = None, limits: SandboxLimits | None = None) -> None:
        self.task_id = task_id
        self.limits = limits or SandboxLimits()
        self.isolated = isolation_available()
        base = root or default_sandbox_root()
        base.mkdir(parents=True, exist_ok=True)
        if self.isolated:
            os.chmod(base, 0o711)  # The sandbox uid may traverse, not list.
        self.workspace = Path(tempfile.mkdtemp(prefix=f"{_safe(task_id)[:40]}-", dir=base)).resolve()
        with _uid_lock:
            self.uid = _UID_BASE + (os.getpid() % 1000) * 1000 + next(_uid_counter) % 1000
        if self.isolated:
            os.chown(self.workspace, self.uid, self.uid)
            os.chmod(self.workspace, 0o700)
        self._closed = False
        self._ran_commands = False
        self._hides = _plan_hides(self.workspace) if self.isolated else []

    # -- commands ---------------------------------------------------------------------------------

    def run(self, command: str, timeout_s: float | None = None) -> CommandResult:
        """Run a shell command in the workspace; never raises for the command's own failures."""
        if self._closed:
            raise InfraError(f"sandbox {self.task_id} is already cleaned up")
        timeout = min(timeout_s or self.limits.timeout_s, self.limits.timeout_s * 4)
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.workspace),
            "TMPDIR": "/tmp" if self.isolated else str(self.workspace),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # Fast, and no host plugins in the task.
        }
        try:
            process = subprocess.Popen(
                ["/bin/bash", "-c", command],
                cwd=self.workspace,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self._preexec,
            )
        except OSError as err:
            raise InfraError(f"sandbox {self.task_id}: cannot start a command: {err}") from err
        self._ran_commands = True
        output, truncated, timed_out = _collect(process, timeout, self.limits.max_output_bytes)
        self._kill_everything(process)
        code = -1 if timed_out else process.returncode
        text = output.decode(errors="replace")
        if truncated:
            text += f"\n[output truncated at {self.limits.max_output_bytes} bytes]"
        if timed_out:
            text += f"\n[command timed out after {timeout:.0f} s and was killed]"
        return CommandResult(code, text, timed_out, truncated)

    def _preexec(self) -> None:
        """In the child, before exec: namespaces, private /tmp, rlimits, then drop to the task uid."""
        limits = self.limits
        if self.isolated:
            _unshare(_CLONE_NEWNS | _CLONE_NEWNET)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)
            for hidden, keep in self._hides:
                _hide(libc, hidden, keep, limits.tmpfs_size)
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.isolated:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)

    def _kill_everything(self, process: subprocess.Popen[bytes]) -> None:
        """Kill the command's session and, when isolated, every process the task uid still owns."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        if self.isolated:
            for _ in range(3):
                if not _kill_uid(self.uid):
                    break
                time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)

    # -- files ------------------------------------------------------------------------------------

    def resolve(self, path: str) -> Path:
        """The absolute path for `path` inside the workspace; refuses anything that leaves it."""
        candidate = Path(path)
        full = candidate if candidate.is_absolute() else self.workspace / candidate
        resolved = full.resolve()  # Follows symlinks, so a link pointing out is caught here.
        if resolved != self.workspace and self.workspace not in resolved.parents:
            raise SandboxViolation(f"path '{path}' is outside the workspace")
        return resolved

    def read_file(self, path: str) -> str:
        target = self.resolve(path)
        if not target.is_file():
            raise FileNotFoundError(f"no such file: {path}")
        with open(target, "rb") as handle:
            data = handle.read(self.limits.max_file_bytes)
        return data.decode(errors="replace")

    def write_file(self, path: str, content: str) -> None:
        target = self.resolve(path)
        if len(content.encode()) > self.limits.max_file_bytes:
            raise SandboxViolation(f"file '{path}' would exceed {self.limits.max_file_bytes} bytes")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()
        target.write_text(content)
        if self.isolated:  # Hand the file and any new folders to the task uid.
            path = target
            while path != self.workspace:
                os.lchown(path, self.uid, self.uid)
                path = path.parent

    def list_files(self, path: str = ".") -> list[str]:
        base = self.resolve(path)
        if not base.is_dir():
            raise FileNotFoundError(f"no such directory: {path}")
        out = []
        for item in sorted(base.rglob("*")):
            rel = item.relative_to(self.workspace)
            if ".git" in rel.parts:
                continue
            out.append(f"{rel}/" if item.is_dir() else str(rel))
            if len(out) >= 500:
                out.append("[listing truncated]")
                break
        return out

    def cleanup(self) -> None:
        """Kill leftovers and delete the workspace; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.isolated and self._ran_commands:
            _kill_uid(self.uid)
        shutil.rmtree(self.workspace, ignore_errors=True)


def _plan_hides(workspace: Path) -> list[tuple[str, list[str]]]:
    """Folders to cover with a private tmpfs, each with the paths to bind back inside it.

    The scratch folders (/tmp, /var/tmp, /dev/shm) become private. A folder the task uid cannot
    traverse on the way to the Python interpreter (e.g. /root holding pyenv) is replaced by one
    that exposes only the interpreter; the rest of it stays invisible to the agent.
    """
    needed = [Path(p).resolve() for p in {sys.prefix, sys.base_prefix}] + [workspace]
    hides: dict[str, list[str]] = {d: [] for d in _SCRATCH if os.path.isdir(d)}
    for path in needed[:2]:
        for ancestor in reversed(path.parents):
            if ancestor != Path("/") and not os.stat(ancestor).st_mode & stat.S_IXOTH:
                hides.setdefault(str(ancestor), [])
                break
    for folder, keep in hides.items():
        keep.extend(str(p) for p in needed if Path(folder) in p.parents)
    return list(hides.items())


def _hide(libc: Any, folder: str, keep: list[str], size: str) -> None:
    """Mount a private tmpfs over `folder`, then bind `keep` (paths inside it) back in place."""
    fds = [os.open(path, os.O_PATH | os.O_DIRECTORY) for path in keep]
    mode = "1777" if folder in _SCRATCH else "0755"
    if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, f"size={size},mode={mode}".encode()) != 0:
        raise OSError(ctypes.get_errno(), f"cannot mount a private {folder}")
    for path, fd in zip(keep, fds, strict=True):
        os.makedirs(path, exist_ok=True)
        if libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, _MS_BIND | _MS_REC, None) != 0:
            raise OSError(ctypes.get_errno(), f"cannot expose {path} in the sandbox")
        os.close(fd)


def _collect(process: subprocess.Popen[bytes], timeout: float, cap: int) -> tuple[bytes, bool, bool]:
    """Read output until exit, timeout, or the cap (then the command is killed: endless output)."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    size = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"".join(chunks), False, True
        ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
        if ready:
            data = os.read(fd, 65536)
            if not data:
                break
            chunks.append(data)
            size += len(data)
            if size > cap:
                return b"".join(chunks)[:cap], True, False
    try:
        process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return b"".join(chunks), False, True
    return b"".join(chunks), False, False


def _kill_uid(uid: int) -> bool:
    """SIGKILL every process owned by `uid`; True if any was found."""
    found = False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid or _is_zombie(entry):
                continue
            os.kill(int(entry), signal.SIGKILL)
            found = True
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def _is_zombie(pid: str) -> bool:
    """Dead, waiting to be reaped by whoever adopted it: nothing left to kill."""
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] == "Z"


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in text) or "task"
