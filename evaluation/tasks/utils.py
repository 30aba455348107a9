"""Scoring functions of the shipped lm-eval suite (referenced from its YAML as `!function utils.*`)."""

from __future__ import annotations

import json
import re
from typing import Any

from environments.tool_call_parsers import get_parser


def process_tool_call(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """1.0 when the reply holds exactly the expected call: same tool, expected arguments present."""
    expected = json.loads(doc["target"])
    parsed = get_parser("hermes").parse(results[0] if results else "")
    if len(parsed.tool_calls) != 1 or parsed.errors:
        return {"acc": 0.0, "valid_call": 0.0}
    call = parsed.tool_calls[0]
    ok = call.name == expected["name"] and all(
        str(call.arguments.get(key, "")).strip() == str(value) for key, value in expected["arguments"].items()
    )
    return {"acc": float(ok), "valid_call": 1.0}


def process_number(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """1.0 when the first number in the reply equals the target."""
    match = re.search(r"-?\d+", results[0] if results else "")
    return {"acc": float(match is not None and int(match.group()) == int(doc["target"]))}
