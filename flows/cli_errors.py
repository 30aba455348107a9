"""How the `flywheel` CLI words a failure: one line, and the exit code it ends with.

Typer vendors its own click, so click's exceptions are caught here through Typer's public base,
`typer.TyperException` (usage errors carry `exit_code` 2, the rest 1), never `import click`.
"""

from __future__ import annotations

from typing import Any

import typer


def one_line(text: str) -> str:
    """`text` with its lines joined by spaces (YAML and validation errors span several lines)."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def click_error_line(err: typer.TyperException) -> str:
    """Click's message for a bad command line, with the subcommands to choose from and where help is."""
    message = one_line(err.format_message())
    ctx: Any = getattr(err, "ctx", None)
    if ctx is None:
        return message
    if hasattr(ctx.command, "list_commands"):
        message += f" Commands: {', '.join(ctx.command.list_commands(ctx))}."
    return f"{message} (see `{ctx.command_path} --help`)"


def failure_line(err: Exception, expected: tuple[type[Exception], ...], verbose: bool = False) -> str:
    """An expected error's own message; any other error's type and message (and, unless `verbose`
    already logged it, how to see its traceback)."""
    message = one_line(str(err))
    if isinstance(err, expected):
        return message
    described = f"{type(err).__name__}: {message}" if message else type(err).__name__
    return described if verbose else f"{described} (-v shows the traceback)"
