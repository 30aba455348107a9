"""`ToolContext(task_id)`: the verifier's handle on the very sandbox the agent used.

Sandboxes live in a process-wide registry keyed by task id, so the agent loop's tools and the
reward function reach the same workspace without passing objects around (hermes-agent's model).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flywheel.environments.errors import AgentError
from flywheel.environments.sandbox.box import LocalSandbox, Sandbox

SandboxFactory = Callable[[str], Sandbox]

_lock = threading.Lock()
_sandboxes: dict[str, Sandbox] = {}
_states: dict[str, dict[str, Any]] = {}


def sandbox_for(task_id: str, factory: SandboxFactory | None = None) -> Sandbox:
    """The task's sandbox, created (by `factory`, default `LocalSandbox`) on first use."""
    with _lock:
        if task_id not in _sandboxes:
            _sandboxes[task_id] = (factory or LocalSandbox)(task_id)
            _states[task_id] = {}
        return _sandboxes[task_id]


def release(task_id: str) -> None:
    """Clean up and forget the task's sandbox and state (idempotent)."""
    with _lock:
        sandbox = _sandboxes.pop(task_id, None)
        _states.pop(task_id, None)
    if sandbox is not None:
        sandbox.cleanup()


def live_task_ids() -> list[str]:
    """Tasks whose sandboxes are still open (a leak check for tests)."""
    with _lock:
        return list(_sandboxes)


class ToolContext:
    """Terminal and file access to a task's sandbox, plus per-task tool state."""

    def __init__(self, task_id: str, factory: SandboxFactory | None = None) -> None:
        self.task_id = task_id
        self.sandbox = sandbox_for(task_id, factory)

    @property
    def workspace(self) -> Path:
        return self.sandbox.workspace

    @property
    def state(self) -> dict[str, Any]:
        """Mutable per-task state shared by the task's tools (e.g. the browser's current page)."""
        with _lock:
            return _states.setdefault(self.task_id, {})

    def terminal(self, command: str, timeout: float | None = None) -> dict[str, Any]:
        """Run a shell command in the workspace: `{"exit_code": int, "output": str}`."""
        return self.sandbox.run(command, timeout).as_dict()

    def read_file(self, path: str) -> str:
        return self.sandbox.read_file(path)

    def write_file(self, path: str, content: str) -> None:
        self.sandbox.write_file(path, content)

    def list_files(self, path: str = ".") -> list[str]:
        return self.sandbox.list_files(path)

    def file_exists(self, path: str) -> bool:
        try:
            self.sandbox.read_file(path)
        except (OSError, AgentError):
            return False
        return True

    def cleanup(self) -> None:
        release(self.task_id)
