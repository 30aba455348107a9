"""Imports go one way between our packages, always as `flywheel.<package>`, and only flows/ imports
Prefect (docs/architecture.md)."""

from __future__ import annotations

import ast
import tomllib
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


def _package(module: str) -> str:
    """The package a module name imports: ours as `flywheel.<package>` -> `<package>`, others' top level."""
    parts = module.split(".")
    return parts[1] if parts[0] == "flywheel" and len(parts) > 1 else parts[0]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_run_one_way(package: str) -> None:
    wrong = {}
    for path in (ROOT / package).rglob("*.py"):
        names = {_package(name) for name in _imports(path)}
        bad = sorted((names & OURS) - ALLOWED[package])
        if package != "flows" and "prefect" in names:
            bad.append("prefect")
        if bad:
            wrong[str(path.relative_to(ROOT))] = bad
    assert wrong == {}


def test_our_packages_are_imported_by_their_namespace() -> None:
    """`import data` would find a user's `data/` before ours (or ours before theirs): never by the bare name."""
    folders = [*OURS, "tests", "benchmarks", "scripts"]
    bare = {
        str(path.relative_to(ROOT)): sorted(name for name in _imports(path) if name.split(".")[0] in OURS)
        for folder in folders
        for path in (ROOT / folder).rglob("*.py")
    }
    assert {path: names for path, names in bare.items() if names} == {}


def _module_level_imports(path: Path, lazy: bool = False) -> set[str]:
    """Our modules `path` imports when it is imported: top-level statements (`lazy`: the imports its
    functions make when called too); never those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    names: set[str] = set()
    for node in ast.walk(tree) if lazy else tree.body:
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("flywheel.")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("flywheel", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def test_environments_import_no_circle() -> None:
    """Not even through an import a function makes when called (a `BaseEnvironment` does not know
    the adapter that runs it as an agent env)."""
    modules = {_module_name(p): p for p in (ROOT / "environments").rglob("*.py")}
    graph = {
        name: {m for m in _module_level_imports(path, lazy=True) if m in modules} - {name}
        for name, path in modules.items()
    }
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        assert name not in stack, " -> ".join([*stack[stack.index(name) :], name])
        if name not in done:
            for target in sorted(graph[name]):
                visit(target, [*stack, name])
            done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_the_sandbox_imports_nothing_of_the_agent_loop() -> None:
    """The security boundary is importable and testable alone: errors, the verifiers' ToolContext, itself."""
    allowed = {"flywheel.environments.errors", "flywheel.environments.tool_context"}
    for path in (ROOT / "environments" / "sandbox").rglob("*.py"):
        for name in _module_level_imports(path):
            assert name.startswith(("flywheel.environments.sandbox", *allowed)), (path.name, name)


def test_every_package_folder_is_installed_under_the_namespace() -> None:
    """pyproject.toml lists the packages by hand (a folder maps to `flywheel.<folder>`): none left out."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(path) for package in OURS for path in (ROOT / package).rglob("__init__.py")}
    assert listed == found | {"flywheel"}
