"""Scoring functions of the shipped lm-eval suite (referenced from its YAML as `!function utils.*`)."""

from __future__ import annotations

import json
import re
from typing import Any

from flywheel.environments.tool_call_parsers import get_parser


def process_tool_call(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """`valid_call`: the reply is exactly one well-formed tool call. `acc`: it is the expected call.

    Strict, as held-out tool-calling benchmarks are: the same tool and the same argument names (none
    extra, none missing), each value equal in its JSON type ("1" is not 1; 1.0 is 1, both numbers).
    """
    expected = json.loads(doc["target"])
    parsed = get_parser("hermes").parse(results[0] if results else "")
    if len(parsed.tool_calls) != 1 or parsed.errors:
        return {"acc": 0.0, "valid_call": 0.0}
    call = parsed.tool_calls[0]
    ok = call.name == expected["name"] and same_json(call.arguments, expected["arguments"])
    return {"acc": float(ok), "valid_call": 1.0}


def same_json(got: Any, want: Any) -> bool:
    """Equal JSON values of the same JSON type, recursively; integers and floats are both numbers.

    >>> same_json({"n": 1.0, "ids": [2]}, {"n": 1, "ids": [2]}), same_json(1, "1"), same_json(True, 1)
    (True, False, False)
    """
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want
    if isinstance(want, int | float):
        return isinstance(got, int | float) and got == want
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same_json(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same_json, got, want))
    return type(got) is type(want) and got == want


def process_number(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """1.0 when the first number in the reply equals the target."""
    match = re.search(r"-?\d+", results[0] if results else "")
    return {"acc": float(match is not None and int(match.group()) == int(doc["target"]))}
