"""CPU per rollout by phase, for `benchmarks/rollout_throughput.py --profile` (the library never imports it).

Measured, not sampled: every phase's CPU is `time.thread_time()` of the thread that did the work.

- Functions the env runs synchronously, on the event loop or in a worker thread (sandbox set-up
  and tear-down, tools, the verifier, tokenisation), are wrapped: a wrapper charges the CPU its
  thread spent inside it to its phase, and no other phase.
- Everything else a rollout does runs in asyncio callbacks (the agent loop, atroposlib's server
  manager and retries, the HTTP client). Each callback runs in the context
  of the task that scheduled it; a context variable names the task's phase, and a hook around
  `asyncio.events.Handle._run` charges the callback's CPU to it (minus what wrappers inside took).
- `rest` is the process's CPU (`time.process_time()`) minus every phase: asyncio's own scheduling
  (`select`, the ready queue), thread-pool hand-offs, and whatever ran in no phase.

The hook costs a few microseconds per callback, so a profiled run is slower than the timed ones;
the benchmark profiles in a separate run.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

PHASES = {
    "setup": "sandbox set-up: uid lease, tmpfs, cgroup",
    "files": "sandbox set-up: task files",
    "agent": "agent loop + atroposlib server manager + HTTP client",
    "tool": "tool execution",
    "verifier": "verifier (verify + compute_reward)",
    "teardown": "sandbox tear-down",
    "tokenise": "tokenisation (tokenize_conversation)",
    "group": "group assembly (collect_trajectories)",
    "process": "process loop + writing groups",
}
_PHASE: contextvars.ContextVar[str | None] = contextvars.ContextVar("rollout_phase", default=None)


class PhaseProfiler:
    """Patch an env's rollout path for one run and report CPU ms per rollout by phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.rollouts = 0
        self.process_seconds = 0.0
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- charging -----------------------------------------------------------------------------------

    def _switch(self, phase: str | None) -> str | None:
        """Charge this thread's CPU since the last switch to its current phase; make `phase` current."""
        now = time.thread_time()
        state = self._local
        current = getattr(state, "phase", None)
        if current is not None:
            with self._lock:
                self.seconds[current] += now - state.mark
        state.phase, state.mark = phase, now
        return current

    def _timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outer = self._switch(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self._switch(outer)

        return wrapper

    def _timed_async(self, phase: str, fn: Callable[..., Any], count: bool = False) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            if count:
                self.rollouts += 1
            token = _PHASE.set(phase)  # Later callbacks of this task (after an await) are `phase`'s.
            outer = self._switch(phase)
            try:
                return await fn(*args, **kwargs)
            finally:
                self._switch(outer)
                _PHASE.reset(token)

        return wrapper

    def _handle_hook(self, original: Callable[[asyncio.Handle], None]) -> Callable[[asyncio.Handle], None]:
        profiler = self

        def _run(handle: asyncio.Handle) -> None:
            phase = handle._context.get(_PHASE)  # type: ignore[attr-defined]
            if phase is None:
                return original(handle)
            outer = profiler._switch(phase)
            try:
                return original(handle)
            finally:
                profiler._switch(outer)

        return _run

    # -- the run ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def patched(self, env: Any) -> Iterator[None]:
        """Inside: `env`'s rollouts are profiled (run `env.process_manager()` in `_PHASE` "process")."""
        from flywheel.environments import tool_context
        from flywheel.environments.agent import tools
        from flywheel.environments.sandbox import workspace

        cls, context = type(env), tool_context.ToolContext
        wrap = {
            (context, "__init__"): self._timed("setup", context.__init__),
            (workspace, "write_workspace"): self._timed("files", workspace.write_workspace),
            (context, "cleanup"): self._timed("teardown", context.cleanup),
            (tools.Tool, "__call__"): self._timed("tool", tools.Tool.__call__),
            (cls, "tokenize_conversation"): self._timed("tokenise", cls.tokenize_conversation),
            (cls, "score_rollout"): self._timed_async("verifier", cls.score_rollout),
            (cls, "run_agent"): self._timed_async("agent", cls.run_agent, count=True),
            (cls, "collect_trajectories"): self._timed_async("group", cls.collect_trajectories),
            (asyncio.events.Handle, "_run"): self._handle_hook(asyncio.events.Handle._run),
        }
        patches = [mock.patch.object(owner, name, wrapper) for (owner, name), wrapper in wrap.items()]
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            started = time.process_time()
            try:
                yield
            finally:
                self.process_seconds = time.process_time() - started

    def run(self, env: Any) -> None:
        """`env.process_manager()` under the profiler."""

        async def main() -> None:
            _PHASE.set("process")
            await env.process_manager()

        with self.patched(env):
            asyncio.run(main())

    def table(self, server_cpu_s: float | None = None, requests: int | None = None) -> str:
        """A markdown table of CPU ms per rollout by phase (plus the inference server's, if given)."""
        n = max(1, self.rollouts)
        rest = self.process_seconds - sum(self.seconds.values())
        rows = [(PHASES[key], seconds) for key, seconds in self.seconds.items()]
        rows += [("rest: asyncio scheduling, thread hand-offs, outside any phase", rest)]
        lines = ["| phase | CPU ms / rollout | share |", "|---|---:|---:|"]
        for label, seconds in rows:
            lines.append(f"| {label} | {seconds * 1000 / n:.2f} | {seconds / self.process_seconds:.0%} |")
        lines.append(f"| **total (this process)** | **{self.process_seconds * 1000 / n:.2f}** | 100% |")
        if server_cpu_s is not None and requests:
            lines.append(f"| inference server process, per request | {server_cpu_s * 1000 / requests:.2f} | |")
        return "\n".join(lines)
