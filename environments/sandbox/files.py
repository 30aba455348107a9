"""File access beneath a workspace that no symlink, rename race or special file can redirect.

Every path is opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV |
RESOLVE_NO_MAGICLINKS)` relative to a descriptor of the workspace, so the kernel itself refuses
anything that would leave it, at the moment of opening (a check-then-open by name can be raced).
Only regular files are read or written, opened non-blocking (a FIFO can never hang the caller).
On the isolated backend the caller does its I/O with the sandbox uid as its filesystem uid
(`as_fs_user`), so the agent's own permission bits apply and new files belong to the agent.
Walks are iterative: no folder depth makes them recurse.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterator

from flywheel.environments.errors import SandboxViolation

_SYS_OPENAT2 = 437  # The same number on x86_64 and aarch64.
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_XDEV | _RESOLVE_NO_MAGICLINKS
_LIST_LIMIT = 500

_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_beneath(root_fd: int, relpath: str, flags: int, mode: int = 0o644) -> int:
    """`openat2` of `relpath` under `root_fd`; a path that would leave it is a `SandboxViolation`."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, _RESOLVE)
    fd = _libc.syscall(_SYS_OPENAT2, root_fd, relpath.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        return fd
    code = ctypes.get_errno()
    if code in (errno.EXDEV, errno.ELOOP):
        raise SandboxViolation(f"path '{relpath}' leaves the workspace or goes through a symlink")
    raise OSError(code, f"{os.strerror(code)}: {relpath}")


@contextlib.contextmanager
def as_fs_user(uid: int | None) -> Iterator[None]:
    """Do this thread's file I/O as `uid` (Linux fsuid/fsgid are per thread); no-op for None."""
    if uid is None:
        yield
        return
    old_gid = _libc.setfsgid(uid)
    old_uid = _libc.setfsuid(uid)
    try:
        yield
    finally:
        _libc.setfsuid(old_uid)
        _libc.setfsgid(old_gid)


def relative_to_workspace(workspace: str, path: str) -> str:
    """`path` as the agent wrote it (relative, or absolute under the workspace) -> a relative path."""
    if "\x00" in path:
        raise SandboxViolation("path contains a NUL byte")
    if os.path.isabs(path):
        normal = os.path.normpath(path)
        if normal != workspace and not normal.startswith(workspace + os.sep):
            raise SandboxViolation(f"path '{path}' is outside the workspace")
        path = os.path.relpath(normal, workspace)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise SandboxViolation(f"path '{path}' is outside the workspace")
    return "/".join(parts) or "."


def read_regular(root_fd: int, relpath: str, limit: int) -> bytes:
    """The first `limit` bytes of a regular file beneath `root_fd`."""
    fd = open_beneath(root_fd, relpath, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileNotFoundError(f"not a regular file: {relpath}")
        chunks, size = [], 0
        while size < limit:
            chunk = os.read(fd, min(1 << 20, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_regular(root_fd: int, relpath: str, data: bytes) -> None:
    """Create or replace the content of a regular file beneath `root_fd`, making parent folders."""
    *folders, name = relpath.split("/")
    if name in (".", ""):
        raise IsADirectoryError(f"not a file path: {relpath}")
    parent = os.dup(root_fd)
    try:
        for folder in folders:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o755, dir_fd=parent)
            child = open_beneath(parent, folder, os.O_PATH | os.O_DIRECTORY)
            os.close(parent)
            parent = child
        fd = open_beneath(parent, name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    finally:
        os.close(parent)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SandboxViolation(f"'{relpath}' is not a regular file")
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def list_beneath(root_fd: int, relpath: str, skip: tuple[str, ...] = (".git",)) -> list[str]:
    """Workspace-relative files and folders (`a/`) under `relpath`, sorted, capped; iterative, no links followed."""
    start = open_beneath(root_fd, relpath, os.O_RDONLY | os.O_DIRECTORY)
    os.close(start)
    out: list[str] = []
    pending = [relpath]
    while pending and len(out) < _LIST_LIMIT:
        folder = pending.pop()
        try:
            fd = open_beneath(root_fd, folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue  # Unreadable or too deep for one path: list what can be listed.
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.name in skip:
                        continue
                    rel = f"{'' if folder == '.' else folder + '/'}{entry.name}"
                    is_dir = entry.is_dir(follow_symlinks=False)
                    out.append(rel + "/" if is_dir else rel)
                    if is_dir:
                        pending.append(rel)
        finally:
            os.close(fd)
    listing = sorted(out)[:_LIST_LIMIT]
    if len(out) >= _LIST_LIMIT:
        listing.append("[listing truncated]")
    return listing
