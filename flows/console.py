"""What a round prints: one line a finished stage, a live status on a terminal, every log in a file.

The round body reports each stage on the `flywheel.progress` logger (`stage_started`,
`stage_finished`); `round_console` routes it to the command's output and everything else — the
libraries', Prefect's and our own logs, Python warnings, progress bars, child processes' output —
into one log file per run. Only warnings and errors of our own packages reach stderr. `verbose`
keeps the full stream on stderr too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner

from flywheel.data import ArtifactStore, Manifest

PROGRESS = "flywheel.progress"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
progress_log = logging.getLogger(PROGRESS)


def printable(text: object) -> str:
    """`text` with control characters written as escapes (`\\x1b`, as `repr` does): a name, path or
    message from a user or a store can never move the cursor, clear the screen or forge a line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in str(text))


def stage_started(stage: str, round_no: int) -> None:
    """Announce a stage (a terminal shows it as a live status; a pipe gets nothing)."""
    progress_log.info("%s r%d ...", stage, round_no, extra={"stage_event": "start"})


def stage_finished(store: ArtifactStore, stage: str, round_no: int, artifact: str, started: float) -> None:
    """One line for a finished stage: its wall time, peak memory and headline figure."""
    manifest = store.manifest(artifact)
    seconds = time.time() - started
    cached = datetime.fromisoformat(manifest.created).timestamp() < started  # The stage cache answered.
    peak = manifest.metrics.get("total_peak_rss_mb", manifest.metrics.get("peak_rss_mb"))
    parts = [f"{stage:<9} r{round_no}", "cached" if cached else f"{seconds:7.1f} s"]
    parts.append(f"{peak / 1024:5.2f} GB" if isinstance(peak, int | float) and not cached else "")
    progress_log.info("%s  %s", "  ".join(p for p in parts if p), headline(store, stage, manifest))


def headline(store: ArtifactStore, stage: str, manifest: Manifest) -> str:
    """The figure a person looks for in a stage's artifact."""
    m = manifest.metrics

    def num(key: str, spec: str = ".2f") -> str:
        value = m.get(key)
        return format(value, spec) if isinstance(value, int | float) else "-"

    if stage == "generate":
        infra = f", {m['infra_failures']} infra failures" if m.get("infra_failures") else ""
        return f"{num('groups_written', 'd')} groups, {num('rollouts', 'd')} rollouts{infra}"
    if stage == "curate":
        return f"{num('sft_examples', 'd')} SFT rows, {num('preference_pairs', 'd')} preference pairs"
    if stage in ("sft", "rl"):
        if manifest.kind != "checkpoint":
            return "not trained (nothing to train on)"
        what = "loss" if stage == "sft" else "reward"
        return f"{what} {num(f'first_{what}')} -> {num(f'final_{what}')} in {num('steps', 'd')} steps"
    if stage == "evaluate":
        return f"held-out success {num('success_rate', '.3f')} over {num('n', 'd')} items"
    if stage == "lm_eval":
        scores = [f"{key.split('/')[0]} {value:.2f}" for key, value in m.items() if key.endswith("/acc")]
        return ", ".join(scores) or "no scores"
    if stage == "gate":
        decision = store.read_json(manifest.id, "decision.json")
        return ("promoted" if decision["promote"] else "kept out") + f": {decision['reason']}"
    if stage == "mine":
        classes = ("unsolved", "learnable", "mastered", "locked")
        return ", ".join(f"{num(f'slices_{c}', 'd')} {c}" for c in classes) if "slices_unsolved" in m else "mined"
    return f"{manifest.kind}/{manifest.name}"


class _ProgressHandler(logging.Handler):
    """Progress records to the console: finished stages as lines, a started one as a live status."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.INFO)
        self.console = console
        # A spinner that leaves sys.stdout / sys.stderr alone (Rich's `status` would send them to the terminal).
        self.status = (
            Live(Spinner("dots"), console=console, transient=True, redirect_stdout=False, redirect_stderr=False)
            if console.is_terminal
            else None
        )

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if getattr(record, "stage_event", None) == "start":
            if self.status is not None:
                self.status.update(Spinner("dots", text=message))
                self.status.start()
            return
        if self.status is not None:
            self.status.stop()
        self.console.print(printable(message), markup=False, highlight=False, soft_wrap=True)


class _OurWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and record.name.startswith("flywheel.")


def stderr_handler(stream: TextIO | None = None) -> logging.Handler:
    """Logs on stderr (or `stream`): Rich's columns on a terminal; piped, one plain line a record, never wrapped."""
    errors = Console(file=stream or sys.stderr)
    if errors.is_terminal:
        from rich.logging import RichHandler

        return RichHandler(console=errors, show_path=False)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    return handler


def quiet_libraries() -> None:
    """No progress bars from the libraries that read these when they draw one (they would fill the log)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


@contextlib.contextmanager
def round_console(console: Console, log_file: Path, verbose: bool = False) -> Iterator[None]:
    """Route a round's output (after Prefect's import, which configures logging its own way): progress
    to `console`, everything else to `log_file` — every log record, and whatever the libraries or the
    processes they start write to stdout and stderr — and our warnings to stderr. `verbose`: the full
    stream stays on stderr, and the file gets the log records too."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_file, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(_FORMAT))
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, progress_log.handlers[:], console.file)
    with contextlib.ExitStack() as stack:
        errors = sys.stderr
        if not verbose:
            console.file, errors = stack.enter_context(_streams_into(log_file))
        stderr = stderr_handler(errors)
        if not verbose:
            stderr.addFilter(_OurWarnings())
        root.handlers[:] = [file_handler, stderr]
        root.setLevel(logging.DEBUG if verbose else logging.INFO)
        progress = _ProgressHandler(console)
        progress_log.handlers[:] = [progress]
        _route_library_loggers()
        logging.captureWarnings(True)
        try:
            yield
        finally:
            if progress.status is not None:
                progress.status.stop()
            logging.captureWarnings(False)
            root.handlers[:], root.level, progress_log.handlers[:], console.file = saved
            file_handler.close()


@contextlib.contextmanager
def _streams_into(log_file: Path) -> Iterator[tuple[TextIO, TextIO]]:
    """File descriptors 1 and 2 into `log_file` (so child processes write there too); yields the
    command's own stdout and stderr, which still reach the terminal or pipe."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    target = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    out = open(saved[0], "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115 (closed below)
    err = open(saved[1], "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield out, err
    finally:
        for stream in (sys.stdout, sys.stderr, out, err):
            stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        out.close()
        err.close()
        for fd in (*saved, target):
            os.close(fd)


def _route_library_loggers() -> None:
    """Loggers that write to their own stream send their records to the root handlers instead."""
    with contextlib.suppress(ImportError):
        import transformers

        transformers.utils.logging.disable_default_handler()
        transformers.utils.logging.enable_propagation()
    for name in ("DeepSpeed", "lm-eval", "lm_eval"):
        named = logging.getLogger(name)
        named.handlers.clear()
        named.propagate = True


def log_file_for(cache: Path, stamp: Any = None) -> Path:
    """Where a round's full log goes: `<cache>/logs/round-<time>.log`."""
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    return cache / "logs" / f"round-{stamp}.log"
