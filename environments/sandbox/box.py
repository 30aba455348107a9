"""Sandboxes: a workspace per task where the agent's commands and file edits happen.

`LocalSandbox` is the local backend. Isolated (root on Linux with bubblewrap installed), every
command runs in its own PID, network, IPC and mount namespaces as a uid leased to this sandbox
alone, sees only the system folders, the Python environment and its workspace, and dies with
everything it started (`environments/sandbox/jail.py`); the workspace is a tmpfs with size and
inode caps, and a cgroup caps memory and processes where the machine has one. File tools open
paths with `openat2(RESOLVE_BENEATH)` as the sandbox uid (`environments/sandbox/files.py`).
Without that, commands get rlimits, a timeout and a process-group kill only, and a warning
says so once (`isolation_report()` puts it in evaluation metadata) - or, where
`FLYWHEEL_REQUIRE_ISOLATION=1` (the production pools set it), no sandbox starts at all.

A docker or modal backend implements the same `Sandbox` protocol.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, Field

from flywheel.environments.errors import InfraError, SandboxViolation
from flywheel.environments.sandbox import files, jail

logger = logging.getLogger(__name__)


class SandboxLimits(BaseModel):
    """Resource limits for every command run in a sandbox."""

    timeout_s: float = Field(default=30.0, gt=0, description="Wall-clock limit per command.")
    max_output_bytes: int = Field(default=16_384, gt=0, description="Output kept per command; the rest is cut.")
    memory_bytes: int = Field(default=2 << 30, description="Address-space limit per process (RLIMIT_AS).")
    total_memory_bytes: int = Field(default=2 << 30, description="Memory of the whole sandbox (cgroup).")
    max_processes: int = Field(default=128, description="Processes of the sandbox uid (RLIMIT_NPROC, cgroup pids).")
    max_file_bytes: int = Field(default=64 << 20, description="Largest file a command may write.")
    max_open_files: int = Field(default=256, description="Open file descriptors per process.")
    workspace_bytes: int = Field(default=256 << 20, description="Disk space of the workspace (tmpfs size).")
    max_inodes: int = Field(default=20_000, description="Files and folders the workspace may hold.")
    tmp_bytes: int = Field(default=64 << 20, description="Size of each private scratch folder (/tmp, /run, ...).")


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
    """`$FLYWHEEL_SANDBOX_ROOT`, else a folder outside /tmp and /root."""
    configured = os.environ.get("FLYWHEEL_SANDBOX_ROOT")
    if configured:
        return Path(configured)
    if os.geteuid() == 0:
        return Path("/var/lib/flywheel/sandboxes")
    return Path.home() / ".cache" / "flywheel" / "sandboxes"


_ISOLATION: bool | None = None
_WARNED = False


def isolation_available() -> bool:
    """True when commands can run in bubblewrap namespaces as another uid (root on Linux + bwrap)."""
    global _ISOLATION
    if _ISOLATION is None:
        _ISOLATION = sys.platform == "linux" and os.geteuid() == 0 and jail.bwrap_path() is not None and _probe()
    return _ISOLATION


def _probe() -> bool:
    try:
        return subprocess.run([jail.bwrap_path() or "bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"],
                              capture_output=True, timeout=20).returncode == 0  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False


def isolation_report() -> dict[str, object]:
    """How contained commands are on this machine, for logs and evaluation metadata."""
    if isolation_available():
        return {"isolated": True, "backend": "bubblewrap", "note": "namespaces, leased uid, capped tmpfs workspace"}
    reasons = [r for r, bad in [("not root", os.geteuid() != 0), ("bwrap missing", jail.bwrap_path() is None)] if bad]
    return {
        "isolated": False,
        "backend": "rlimits",
        "note": f"{', '.join(reasons) or 'namespaces unavailable'}: commands run as the current user with the "
        "loopback network, its other processes and its files in reach; only rlimits, timeouts and "
        "process-group kills apply",
    }


def isolation_required() -> bool:
    """`FLYWHEEL_REQUIRE_ISOLATION=1`: refuse to run agent commands unisolated (a pod that lost
    bubblewrap or its namespaces fails loudly instead of handing the agent the host)."""
    return os.environ.get("FLYWHEEL_REQUIRE_ISOLATION") == "1"


class SandboxUnavailable(RuntimeError):
    """Isolation is required here but this machine cannot provide it."""


def _warn_once() -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        logger.warning("sandbox is NOT isolated (%s)", isolation_report()["note"])


class LocalSandbox:
    """A workspace plus contained command execution on this machine."""

    def __init__(self, task_id: str, root: Path | None = None, limits: SandboxLimits | None = None) -> None:
        self.task_id = task_id
        self.limits = limits or SandboxLimits()
        self.isolated = isolation_available()
        if not self.isolated:
            if isolation_required():
                raise SandboxUnavailable(
                    f"FLYWHEEL_REQUIRE_ISOLATION=1, but the sandbox cannot be isolated here "
                    f"({isolation_report()['note']}): run as root on Linux with bubblewrap, or unset it for development"
                )
            _warn_once()
        base = root or default_sandbox_root()
        base.mkdir(parents=True, exist_ok=True)
        # An opaque name: nothing in the path tells the agent which task (or answer) it is.
        self.workspace = (base / secrets.token_hex(16)).resolve()
        self.workspace.mkdir(mode=0o700)
        self._lease: jail.UidLease | None = None
        self._cgroup: jail.Cgroup | None = None
        self._closed = False
        try:
            if self.isolated:
                os.chmod(base, 0o711)  # The sandbox uid may traverse, not list.
                _sweep_once(base)
                self._lease = jail.UidLease(jail.UID_LOCKS)
                limits = self.limits
                jail.mount_workspace(self.workspace, self._lease.uid, limits.workspace_bytes, limits.max_inodes)
                self._cgroup = jail.Cgroup(f"flywheel-{self._lease.uid}", limits.total_memory_bytes,
                                           limits.max_processes)  # fmt: skip
            self._root_fd = os.open(self.workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            self._release()
            raise

    @property
    def uid(self) -> int:
        """The uid commands and file tools act as (the leased one when isolated)."""
        return self._lease.uid if self._lease else os.getuid()

    # -- commands ---------------------------------------------------------------------------------

    def run(self, command: str, timeout_s: float | None = None) -> CommandResult:
        """Run a shell command in the workspace; never raises for the command's own failures."""
        if self._closed:
            raise InfraError(f"sandbox {self.task_id} is already cleaned up")
        if "\x00" in command:
            raise SandboxViolation("the command contains a NUL byte")
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
        argv = (
            jail.bwrap_argv(self.workspace, self.uid, self.limits.tmp_bytes, command)
            if self.isolated
            else ["/bin/bash", "-c", command]
        )
        try:
            process = subprocess.Popen(
                argv,
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
        """In the child, before exec: join the cgroup and set rlimits (bwrap then drops to the uid)."""
        limits = self.limits
        if self._cgroup is not None:
            self._cgroup.attach(os.getpid())
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.isolated:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))

    def _kill_everything(self, process: subprocess.Popen[bytes]) -> None:
        """Kill the command's session; isolated, its PID namespace dies with it (plus cgroup and uid sweeps)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        if self._cgroup is not None:
            self._cgroup.kill()
        if self._lease is not None:
            jail.kill_uid_until_gone(self._lease.uid)

    # -- files ------------------------------------------------------------------------------------

    def _relative(self, path: str) -> str:
        if self._closed:
            raise InfraError(f"sandbox {self.task_id} is already cleaned up")
        return files.relative_to_workspace(str(self.workspace), path)

    def read_file(self, path: str) -> str:
        rel = self._relative(path)
        with files.as_fs_user(self._fs_uid):
            data = files.read_regular(self._root_fd, rel, self.limits.max_file_bytes)
        return data.decode(errors="replace")

    def write_file(self, path: str, content: str) -> None:
        rel = self._relative(path)
        data = content.encode(errors="replace")
        if len(data) > self.limits.max_file_bytes:
            raise SandboxViolation(f"file '{path}' would exceed {self.limits.max_file_bytes} bytes")
        with files.as_fs_user(self._fs_uid):
            files.write_regular(self._root_fd, rel, data)

    def list_files(self, path: str = ".") -> list[str]:
        rel = self._relative(path)
        try:
            with files.as_fs_user(self._fs_uid):
                return files.list_beneath(self._root_fd, rel)
        except NotADirectoryError as err:
            raise FileNotFoundError(f"no such directory: {path}") from err

    @property
    def _fs_uid(self) -> int | None:
        return self._lease.uid if self._lease else None

    def cleanup(self) -> None:
        """Kill leftovers and delete the workspace; safe to call twice."""
        if self._closed:
            return
        self._release()

    def _release(self) -> None:
        self._closed = True
        with contextlib.suppress(AttributeError, OSError):
            os.close(self._root_fd)
        if self._cgroup is not None:
            self._cgroup.remove()
        if self._lease is not None:
            jail.kill_uid_until_gone(self._lease.uid)
            jail.unmount_workspace(self.workspace)
            self._lease.release()
        if self.workspace.exists():  # Not a mount (unisolated): `rm` walks without recursion limits.
            subprocess.run(["chmod", "-R", "u+rwx", str(self.workspace)], capture_output=True, check=False)
            subprocess.run(["rm", "-rf", "--one-file-system", str(self.workspace)], capture_output=True, check=False)


_SWEPT: set[Path] = set()
_SWEEP_LOCK = threading.Lock()


def _sweep_once(base: Path) -> None:
    """Once per process and root: unmount workspaces a killed process left mounted (they hold RAM)."""
    with _SWEEP_LOCK:
        if base in _SWEPT:
            return
        _SWEPT.add(base)
        swept = jail.sweep_stale_workspaces(base, jail.UID_LOCKS)
    if swept:
        logger.warning("unmounted %d workspaces that killed sandboxes left under %s", swept, base)


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
