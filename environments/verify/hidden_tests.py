"""Run hidden tests in the sandbox and read per-test outcomes, never the exit code.

A process that imports the agent's code can end however it likes (`atexit.register(os._exit, 0)`
turns any failure into exit 0), so verifiers judge pytest's junit XML instead: every expected
test must be reported, and every one must have passed. Each verification gets a folder of its own
with an unguessable name (the agent cannot have planted files in it or made it unwritable); the
report is written by a command that runs after the agent's processes are dead (each sandbox
command lives in its own PID namespace) and is read back through the sandbox's file access.
Inside the test process the agent's code can still patch pytest itself, so where a task's checks
are calls of the agent's functions, `flywheel.environments.verify.calls` judges them instead; pytest is left for the
agent's own tests (which must also fail on a mutant) and real SWE-bench instances (which run
beside a canary test that must fail).
"""

from __future__ import annotations

import errno
import logging
import secrets
import shlex
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass

from flywheel.environments.errors import SandboxViolation
from flywheel.environments.tool_context import ToolContext

logger = logging.getLogger(__name__)

# Why writing the verifier's own files can fail when the agent made it so: its workspace is read-only,
# full, or holds something else under the path. Any other error is the sandbox's (an infra failure).
_AGENT_MADE = {errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EEXIST, errno.ENOTDIR, errno.EISDIR}


@dataclass
class JunitOutcomes:
    """Per-test results from a junit report: name -> passed."""

    results: dict[str, bool]

    def all_passed(self, expected: int | None = None) -> bool:
        """True when at least one test (exactly `expected`, if given) ran and every one passed."""
        if not self.results or (expected is not None and len(self.results) != expected):
            return False
        return all(self.results.values())


def fresh_verify_dir(ctx: ToolContext) -> str | None:
    """A new folder for this verification holding our own pytest.ini (its path in the workspace);
    None when the agent left the workspace so that it cannot be written."""
    path = f".verify-{secrets.token_hex(8)}"
    return path if write_verifier_file(ctx, f"{path}/pytest.ini", "[pytest]\n") else None


def write_verifier_file(ctx: ToolContext, path: str, content: str) -> bool:
    """Write one of the verifier's own files; False when the agent's workspace refuses it (read-only,
    full, a link or folder in the way): the task is not done. An agent must not turn its failure
    into an infra failure, which would drop the rollout from the score; other errors still are one."""
    try:
        ctx.write_file(path, content)
    except (SandboxViolation, OSError) as err:
        if isinstance(err, OSError) and err.errno not in _AGENT_MADE:
            raise
        logger.info("%s: verifier file %s refused (%s): not completed", ctx.task_id, path, err)
        return False
    return True


def run_pytest(
    ctx: ToolContext,
    targets: str,
    verify_dir: str,
    cwd: str = ".",
    timeout: float = 120,
    canary: bool = False,
    canary_in: Sequence[str] = (),
) -> JunitOutcomes:
    """Run pytest on `targets` (shell words, relative to `cwd`) and parse its junit report.

    Our own ini file (in `verify_dir`, from `fresh_verify_dir`) and rootdir, no conftest, no
    plugins, an isolated interpreter: nothing the agent wrote configures the run. `cwd` (a
    workspace folder) is the import root. With `canary`, a randomly named test that must fail runs
    beside the targets, in a file of its own and appended to each file of `canary_in` (the hidden
    test files, paths relative to `cwd`): reported passed (or not at all), the agent's code tampered
    with pytest (a package that stubs `runtest`, even only for the hidden tests' folder, makes the
    canary beside them pass too), and no outcome counts.
    """
    verify = shlex.quote(f"{ctx.workspace}/{verify_dir}")
    report = f"{verify_dir}/report-{secrets.token_hex(8)}/junit.xml"
    canary_name = f"test_{secrets.token_hex(8)}"
    if canary:
        planted = _plant_canaries(ctx, verify_dir, canary_name, [f"{cwd}/{path}" for path in canary_in])
        if planted is None:
            return JunitOutcomes({})
        targets += "".join(f" {shlex.quote(f'{path}::{canary_name}')}" for path in planted)
    command = (
        f"cd {shlex.quote(cwd)} && python -I -m pytest -q -p no:cacheprovider --noconftest -c {verify}/pytest.ini "
        f'--rootdir={verify} -o pythonpath="$PWD" --junitxml={shlex.quote(f"{ctx.workspace}/{report}")} {targets}'
    )
    ctx.terminal(command, timeout=timeout)
    try:
        outcomes = parse_junit(ctx.read_file(report))
    except (OSError, ValueError):
        return JunitOutcomes({})
    if canary:
        reported = [name for name in outcomes.results if name.endswith(f"::{canary_name}")]
        canaries_passed = [outcomes.results.pop(name) for name in reported]  # Canaries are not outcomes.
        if len(reported) != 1 + len(canary_in) or any(canaries_passed):
            logger.info("%s: a canary test passed or went missing: pytest was tampered with", ctx.task_id)
            return JunitOutcomes({})
    return outcomes


def _plant_canaries(ctx: ToolContext, verify_dir: str, name: str, files: list[str]) -> list[str] | None:
    """A failing test `name` in a file of its own and at the end of each of `files`; the paths to run it at
    (None when the agent's workspace refuses a write: the task is not done)."""
    body = f"\n\ndef {name}():\n    assert False\n"
    own = f"{verify_dir}/{name}.py"
    if not write_verifier_file(ctx, own, body.lstrip()):
        return None
    for path in files:
        try:
            text = ctx.read_file(path)
        except (SandboxViolation, OSError, ValueError):
            return None
        if not write_verifier_file(ctx, path, text + body):
            return None
    return [f"{ctx.workspace}/{own}", *(path.removeprefix("./") for path in files)]


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
