"""Run hidden tests in the sandbox and read per-test outcomes, never the exit code.

A process that imports the agent's code can end however it likes (`atexit.register(os._exit, 0)`
turns any failure into exit 0), so verifiers judge pytest's junit XML instead: every expected
test must be reported, and every one must have passed. The report goes to a fresh folder with
an unguessable name, written by a command that runs after the agent's processes are dead (each
sandbox command lives in its own PID namespace), and is read back through the sandbox's file
access. An agent that knows this protocol could still forge a report from inside the test
process; a generic exit-code trick cannot.
"""

from __future__ import annotations

import secrets
import shlex
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from environments.tool_context import ToolContext


@dataclass
class JunitOutcomes:
    """Per-test results from a junit report: name -> passed."""

    results: dict[str, bool]

    def all_passed(self, expected: int | None = None) -> bool:
        """True when at least one test (exactly `expected`, if given) ran and every one passed."""
        if not self.results or (expected is not None and len(self.results) != expected):
            return False
        return all(self.results.values())


def fresh_verify_dir(ctx: ToolContext) -> None:
    """Replace whatever the agent left in `.verify/` with our own pytest.ini."""
    ctx.terminal("rm -rf .verify")
    ctx.write_file(".verify/pytest.ini", "[pytest]\n")


def run_pytest(ctx: ToolContext, targets: str, cwd: str = ".", timeout: float = 120) -> JunitOutcomes:
    """Run pytest on `targets` (shell words, relative to `cwd`) and parse its junit report.

    Our own ini file and rootdir, no conftest, no plugins, an isolated interpreter: nothing the
    agent wrote configures the run. `cwd` (a workspace folder) is the import root.
    """
    verify = f"{ctx.workspace}/.verify"
    report = f".verify/report-{secrets.token_hex(8)}/junit.xml"
    ctx.terminal(f"mkdir -p {report.rsplit('/', 1)[0]}")
    command = (
        f"cd {shlex.quote(cwd)} && python -I -m pytest -q -p no:cacheprovider --noconftest -c {verify}/pytest.ini "
        f"--rootdir={verify} -o pythonpath=$PWD --junitxml={ctx.workspace}/{report} {targets}"
    )
    ctx.terminal(command, timeout=timeout)
    try:
        return parse_junit(ctx.read_file(report))
    except (OSError, ValueError):
        return JunitOutcomes({})


def parse_junit(text: str) -> JunitOutcomes:
    """junit XML -> outcomes; a test passed when its `testcase` has no failure, error or skip."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        raise ValueError(f"not a junit report: {err}") from err
    results: dict[str, bool] = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = any(child.tag in ("failure", "error", "skipped") for child in case)
        results[name] = results.get(name, True) and not bad
    return JunitOutcomes(results)
