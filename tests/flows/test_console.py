"""The round's console on a terminal: a live status for the running stage that leaves the process's
stdout and stderr alone (they go to the round's log file), and a line a finished stage."""

from __future__ import annotations

import io
import logging
import sys

from rich.console import Console

from flywheel.flows.console import _ProgressHandler


def _record(message: str, start: bool = False) -> logging.LogRecord:
    record = logging.LogRecord("flywheel.progress", logging.INFO, __file__, 0, message, None, None)
    if start:
        record.stage_event = "start"
    return record


def test_the_live_status_leaves_stdout_and_stderr_alone() -> None:
    console = Console(file=io.StringIO(), force_terminal=True)
    handler = _ProgressHandler(console)
    streams = sys.stdout, sys.stderr
    handler.emit(_record("sft r1 ...", start=True))
    assert (sys.stdout, sys.stderr) == streams  # Rich's `status` would swap them for proxies to the terminal.
    handler.emit(_record("sft       r1     15.3 s   2.02 GB  loss 10.80 -> 10.58 in 4 steps"))
    assert (sys.stdout, sys.stderr) == streams
    shown = console.file.getvalue()
    assert "sft r1 ..." in shown and shown.rstrip().endswith("loss 10.80 -> 10.58 in 4 steps")


def test_a_pipe_gets_finished_stages_only() -> None:
    console = Console(file=io.StringIO())
    handler = _ProgressHandler(console)
    handler.emit(_record("rl r1 ...", start=True))
    handler.emit(_record("rl        r1      8.5 s   4.14 GB  reward 0.00 -> 0.50 in 2 steps"))
    assert console.file.getvalue() == "rl        r1      8.5 s   4.14 GB  reward 0.00 -> 0.50 in 2 steps\n"
