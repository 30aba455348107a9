"""Imports go one way between our packages, and only flows/ imports Prefect (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"flows", "training", "evaluation", "inference", "environments", "data"}
ALLOWED = {
    "flows": OURS,
    "training": {"training", "environments", "data", "inference"},
    "evaluation": {"evaluation", "environments", "data", "inference"},
    "environments": {"environments", "data"},
    "inference": {"inference"},
    "data": {"data"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_run_one_way(package: str) -> None:
    wrong = {}
    for path in (ROOT / package).rglob("*.py"):
        names = _imports(path)
        bad = sorted((names & OURS) - ALLOWED[package])
        if package != "flows" and "prefect" in names:
            bad.append("prefect")
        if bad:
            wrong[str(path.relative_to(ROOT))] = bad
    assert wrong == {}
