"""Reading what the agent wrote, bounded: a verifier judges hostile output instead of crashing on it.

A verifier that raises on the agent's files turns a failed task into an infra failure, which drops
the rollout (in training, its whole group) instead of scoring it 0. So verifiers read agent-written
data only through these readers: text is capped in size, JSON and TOML in nesting depth, and every
number must be finite and of a magnitude a task can mean. Anything outside raises `Unjudgeable`
(a `ValueError`), which the verifier turns into "not done".
"""

from __future__ import annotations

import json
import math
import tomllib
from typing import Any

MAX_CHARS = 1 << 20  # 1 Mi characters: far beyond any honest answer file of the built-in tasks.
MAX_DEPTH = 32
MAX_MAGNITUDE = 1e15
_MAX_DIGITS = 16


class Unjudgeable(ValueError):
    """Agent output a verifier will not parse: the task is not done, for this reason."""


def bounded_text(text: str, max_chars: int = MAX_CHARS) -> str:
    """`text` when it is at most `max_chars` long and holds no NUL (binary), else `Unjudgeable`."""
    if len(text) > max_chars:
        raise Unjudgeable(f"{len(text)} characters, more than {max_chars}")
    if "\x00" in text:
        raise Unjudgeable("binary data (a NUL character)")
    return text


def finite_number(value: Any) -> float:
    """`value` as a float when it is a real number (not a bool) that is finite and at most 1e15 in size."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Unjudgeable(f"not a number: {type(value).__name__}")
    if isinstance(value, int) and abs(value) > MAX_MAGNITUDE:  # Before float(): 10**400 would overflow.
        raise Unjudgeable("a number larger than 1e15")
    number = float(value)
    if not math.isfinite(number) or abs(number) > MAX_MAGNITUDE:
        raise Unjudgeable(f"a number that is not finite or larger than 1e15: {number}")
    return number


def load_json(text: str) -> Any:
    """JSON the agent wrote: bounded in size and nesting, integers of at most 16 digits, no NaN/Infinity."""
    _check_depth(bounded_text(text), "[{", "]}")
    return json.loads(text, parse_int=_bounded_int, parse_constant=_no_constant)


def load_toml(text: str) -> dict[str, Any]:
    """TOML the agent wrote: bounded in size and in nesting, inline and dotted."""
    _check_depth(bounded_text(text), "[{", "]}")
    if max((line.split("=")[0].count(".") for line in text.splitlines()), default=0) > MAX_DEPTH:
        raise Unjudgeable(f"keys dotted deeper than {MAX_DEPTH}")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise Unjudgeable(f"not TOML: {err}") from err


def _check_depth(text: str, openers: str, closers: str) -> None:
    """Nesting depth of brackets outside strings, checked before a recursive parser sees them."""
    depth, quote, escaped = 0, "", False
    for char in text:
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char in openers:
            depth += 1
            if depth > MAX_DEPTH:
                raise Unjudgeable(f"nested deeper than {MAX_DEPTH}")
        elif char in closers:
            depth -= 1


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > _MAX_DIGITS:
        raise Unjudgeable(f"an integer of {len(digits)} digits")
    return int(digits)


def _no_constant(name: str) -> Any:
    raise Unjudgeable(f"{name} is not a JSON number")
