"""The docs are a guide: a short README, a site that builds with no broken link, and no page that
describes the project's own making."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAKING = re.compile(r"not re-run here|a probe of mine|not changed yet|this session|next session", re.IGNORECASE)


def test_the_readme_is_a_short_guide() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for heading in ("## Two commands", "## Results", "## The CLI at a glance", "## Documentation"):
        assert heading in text
    assert text.count("make demo") >= 1 and "make test" in text


def test_no_page_describes_the_projects_making() -> None:
    found = [f"{page.relative_to(ROOT)}: {m.group(0)}" for page in PAGES for m in MAKING.finditer(page.read_text())]
    assert found == []


def test_the_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert targets and all((ROOT / target).exists() for target in targets), targets


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """Every page in the nav, every link and anchor resolved (mkdocs --strict fails on a warning)."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    command = [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "guide" / "configuring-rounds" / "index.html").exists()


def benchmark_gaps(root: Path) -> list[str]:
    """Benchmarks the docs leave out: each script needs a docstring (what it measures) and a section
    of docs/benchmarks.md that names it (how to run it, its latest figures)."""
    page = (root / "docs" / "benchmarks.md").read_text()
    sections = page.split("\n## ")[1:]
    gaps = []
    for script in sorted((root / "benchmarks").glob("*.py")):
        if not ast.get_docstring(ast.parse(script.read_text())):
            gaps.append(f"{script.name}: no docstring")
        if not any(f"benchmarks/{script.name}" in section for section in sections):
            gaps.append(f"{script.name}: no section of docs/benchmarks.md names it")
    return gaps


def test_every_benchmark_is_documented() -> None:
    assert benchmark_gaps(ROOT) == []


def test_a_new_benchmark_needs_its_docstring_and_section(tmp_path: Path) -> None:
    """docs/guide/extending.md's touch points for a benchmark, followed for a toy one."""
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "benchmarks.md"
    page.write_text((ROOT / "docs" / "benchmarks.md").read_text())
    toy = tmp_path / "benchmarks" / "toy.py"
    toy.write_text("print(1.0)\n")
    assert benchmark_gaps(tmp_path) == ["toy.py: no docstring", "toy.py: no section of docs/benchmarks.md names it"]
    toy.write_text('"""Toy: ours vs a baseline, side by side."""\nprint(1.0)\n')
    page.write_text(page.read_text() + "\n## Toy\n\n`benchmarks/toy.py` prints 1.0 (2026-12-06).\n")
    assert benchmark_gaps(tmp_path) == []
