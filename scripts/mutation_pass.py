"""Mutation pass (mutmut 3) over the promotion gate, the curriculum, the store's refs and manifests, and the
envs' verifiers: how many mutants the tests kill, per module.

.venv/bin/python scripts/mutation_pass.py                       # every module (hours on 2 cores: docs/testing.md)
.venv/bin/python scripts/mutation_pass.py --only data/refs.py   # one module (repeat --only for more)
.venv/bin/python scripts/mutation_pass.py --sample 30           # 30 mutants a module, drawn at random
.venv/bin/python scripts/mutation_pass.py --staging DIR --again # rerun what DIR's pass did not catch

mutmut names a module by its file's path below `src/`, while this repository's folders (`data/`,
`environments/`, ...) are imported as `flywheel.data`, `flywheel.environments`, ... (pyproject.toml's
`package-dir`). So the pass runs in staging folders with a real package layout, `src/flywheel/<package>`,
copied from the working tree together with `tests/`; the tests there import the mutated copy, never the
checkout. Env modules are mutated only in their verifiers (the functions listed in `TARGETS`), not in their
task generators. Each target names the test files that judge it, and the targets that share a list run in
one staging folder of their own: a mutant runs the tests of that list that call its function (fastest
first, stopping at the first failure), so a survivor of a small helper never waits for the long-horizon
sandbox tests. The staging folders are kept: their `mutants/` hold mutmut's results (`mutmut show NAME`
there prints a mutant), and `survivors.diff` beside them every mutant not killed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "environments", "evaluation", "flows", "inference", "training")
MUTMUT = Path(sys.executable).parent / "mutmut"
SAMPLE_SEED = 0  # `--sample` draws the same mutants from the same code.


@dataclass(frozen=True)
class Target:
    """A module to mutate (a path in the repository), the functions mutated in it (None: all of them;
    `Class.method` for a method) and the test files that judge it."""

    path: str
    functions: tuple[str, ...] | None
    tests: tuple[str, ...]

    @property
    def module(self) -> str:
        return "flywheel." + self.path.removesuffix(".py").replace("/", ".")

    def patterns(self) -> list[str]:
        """mutmut's mutant-name globs for this target (`x_f` a function, `xǁClassǁmethod` a method)."""
        if self.functions is None:
            return [f"{self.module}.*"]
        return [f"{self.module}.{_mangled(name)}__mutmut_*" for name in self.functions]

    def owns(self, mutant: str) -> bool:
        if self.functions is None:
            return mutant.startswith(f"{self.module}.")
        return any(mutant.startswith(f"{self.module}.{_mangled(name)}__mutmut_") for name in self.functions)


def _mangled(name: str) -> str:
    cls, _, method = name.rpartition(".")
    return f"xǁ{cls}ǁ{method}" if cls else f"x_{name}"


STORE_TESTS = ("tests/data/test_store.py", "tests/security/test_store_attacks.py")
GATE_TESTS = ("tests/evaluation/test_mining_and_gate.py", "tests/evaluation/test_infra_accounting.py")
CURRICULUM_TESTS = ("tests/evaluation/test_curriculum.py", "tests/evaluation/test_steering.py")
# The reward and parsing helpers: their own tests, the hostile outputs and the env contract tests (not the
# envs' end-to-end oracle and attack runs, which call them too but take minutes).
HELPER_TESTS = (
    "tests/environments/test_rewards_and_instances.py",
    "tests/environments/test_seed_004.py",
    "tests/environments/test_seed_contract.py",
    "tests/security/test_hostile_outputs.py",
)
# The verifiers proper: every env's oracle, cheats and attacks, the hidden checks and SWE-bench instances.
VERIFIER_TESTS = (
    "tests/environments/test_verifiers.py",
    "tests/environments/test_function_calling.py",
    "tests/security/test_function_calling_attacks.py",
    "tests/environments/test_verify_calls.py",
    "tests/environments/test_rewards_and_instances.py",
    "tests/security/test_hostile_outputs.py",
    "tests/security/test_verifier_attacks.py",
)
TARGETS = (  # Grouped by test list (one staging folder each), the long-running verifier group last.
    Target("evaluation/gate.py", None, GATE_TESTS),
    Target("evaluation/curriculum.py", None, CURRICULUM_TESTS),
    Target("data/refs.py", None, STORE_TESTS),
    Target("data/manifest.py", None, STORE_TESTS),
    Target("environments/verify/untrusted.py", None, HELPER_TESTS),
    Target("environments/verify/scoring.py", None, HELPER_TESTS),
    Target("environments/verify/rewards.py", None, HELPER_TESTS),
    Target("environments/verify/calls.py", None, VERIFIER_TESTS),
    Target("environments/verify/hidden_tests.py", None, VERIFIER_TESTS),
    Target("environments/tasks/tool_use_chain_tasks.py", ("verify", "_verify_one", "_table_rows"), VERIFIER_TESTS),
    Target("environments/tasks/web_tasks.py", ("verify",), VERIFIER_TESTS),
    Target("environments/task_env.py", ("TaskEnv.compute_reward",), VERIFIER_TESTS),  # The task envs' reward.
    Target("environments/tasks/long_horizon_tasks.py", ("pyproject_ok", "readme_ok"), VERIFIER_TESTS),
    Target(
        "environments/long_horizon.py",
        (
            "LongHorizonEnv.verify",
            "LongHorizonEnv.compute_reward",
            "milestone_score",
            "_tests_pin_the_function",
            "mutant_source",
            "_read",
        ),
        VERIFIER_TESTS,
    ),
    Target(
        "environments/swe_bench.py",
        ("SWEBenchEnv.verify", "verify_hidden_checks", "_is_test", "hidden_test_files", "restore_test_files"),
        VERIFIER_TESTS,
    ),
    # The generated SWE task is its own ground truth: its hidden checks and the imports they run under.
    Target("environments/tasks/swe_tasks.py", ("make_task",), VERIFIER_TESTS),
    Target(
        "environments/custom/file_stats_env.py", ("FileStatsEnv.verify", "FileStatsEnv.compute_reward"), VERIFIER_TESTS
    ),
    Target(
        "environments/tasks/function_calling_tasks.py",
        (
            "verify",
            "_agent_calls",
            "_arguments",
            "_unique_keys",
            "_check_numbers",
            "_final_text",
            "_same_object",
            "_same_value",
        ),
        VERIFIER_TESTS,
    ),
)
# Folders the tests import beside `flywheel` (the curriculum's tests run `benchmarks.curriculum_ablation`).
COPIED = ("tests", "benchmarks")
# Tests that need the checkout itself (its top-level `environments/` folder), not a copy of the package.
DESELECT = ("tests/environments/test_seed_contract.py::test_the_seeds_import_spelling_names_our_modules_in_a_checkout",)
# A conftest.py above `tests/` in the staging folder, imported once by mutmut's fork server (every mutant's
# process is a fork of it): it imports every module of flywheel and the benchmarks there, so that no mutant's
# process imports them again (a test importing `benchmarks.curriculum_ablation` lazily took 10 s a mutant),
# and it runs a mutant's covering tests fastest first, a test module's tests together (its module-scoped
# fixtures are set up once), so that a killed mutant's first failure comes early.
STAGING_CONFTEST = '''"""Preload what the tests import; run the fastest test modules first (mutmut-stats.json)."""

import contextlib
import importlib
import json
from pathlib import Path

import boto3  # noqa: F401  (The S3 fixture's libraries.)
import moto.server  # noqa: F401
import pytest
import s3fs  # noqa: F401

for root in (Path("src/flywheel"), Path("benchmarks")):
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts  # flywheel.data.refs, benchmarks.rl_gain
        with contextlib.suppress(Exception):
            importlib.import_module(".".join(parts).removesuffix(".__init__"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    stats = Path("mutmut-stats.json")
    if not stats.exists():
        return
    duration = json.loads(stats.read_text())["duration_by_test"]
    module: dict[str, float] = {}
    for item in items:
        name = item.nodeid.split("::")[0]
        module[name] = module.get(name, 0.0) + duration.get(item.nodeid, 0.0)
    items.sort(key=lambda item: (module[item.nodeid.split("::")[0]], duration.get(item.nodeid, 0.0)))
'''


def check_functions(targets: list[Target]) -> list[str]:
    """The listed functions no target module defines (renamed or removed since the list was written)."""
    missing = []
    for target in targets:
        defined = _definitions((ROOT / target.path).read_text())
        missing += [f"{target.path}: {name}" for name in target.functions or () if name not in defined]
    return missing


def _definitions(source: str) -> dict[str, str]:
    """A module's functions and methods (`Class.method`) by name, each with its source."""
    tree, found = ast.parse(source), {}
    for node in tree.body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
        for f in members:
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                found[prefix + f.name] = ast.get_source_segment(source, f) or ""
    return found


def mutated_code(root: Path, target: Target) -> str:
    """The code under `root` that the target's mutants change: its listed functions, or the whole module."""
    source = (root / target.path).read_text()
    if target.functions is None:
        return source
    definitions = _definitions(source)
    return "\n".join(definitions.get(name, "") for name in target.functions)


def stage(staging: Path, targets: list[Target]) -> None:
    """`staging/src/flywheel/...` and `staging/tests` from the working tree, and a pyproject.toml for mutmut."""
    copy_checkout(staging)
    (staging / "conftest.py").write_text(STAGING_CONFTEST)
    pytest_ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    tests = sorted({test for target in targets for test in target.tests})
    mutmut = {
        "source_paths": ["src"],
        "also_copy": ["conftest.py", *COPIED],
        "only_mutate": sorted({f"src/flywheel/{target.path}" for target in targets}),
        "pytest_add_cli_args_test_selection": tests,
        # One process: no xdist workers (mutmut runs the mutants one at a time, `--max-children 1`).
        "pytest_add_cli_args": [
            *("-p", "no:xdist", "-p", "no:cacheprovider"),
            *("-p", "no:unraisableexception"),  # Its gc.collect at every session's end costs seconds a mutant.
            *(f"--deselect={test}" for test in DESELECT),
        ],
        "timeout_multiplier": 10.0,
        # Each pytest session in a fresh fork of a server that only imported the tests: a session run after
        # another in one process finds the first one's cached S3 clients pointing at a stopped endpoint.
        "process_isolation": "forkserver",
    }
    pytest_ini["addopts"] = pytest_ini["addopts"].replace("--durations=30", "").strip()
    lines = ["[tool.mutmut]", *_toml_table(mutmut), "", "[tool.pytest.ini_options]", *_toml_table(pytest_ini)]
    (staging / "pyproject.toml").write_text("\n".join(lines) + "\n")


def copy_checkout(staging: Path) -> None:
    """The working tree's packages into `staging/src/flywheel` and its `COPIED` folders beside it, over what
    is there (file times kept: mutmut makes a file's mutants anew only when its source is newer)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    package = staging / "src" / "flywheel"
    package.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / "flywheel" / "__init__.py", package / "__init__.py")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, package / name, ignore=ignore, dirs_exist_ok=True)
    for folder in COPIED:
        shutil.copytree(ROOT / folder, staging / folder, ignore=ignore, dirs_exist_ok=True)


def _toml_table(table: dict[str, object]) -> list[str]:
    """`key = value` lines (strings, numbers and lists of strings: JSON spells them as TOML does)."""
    return [f"{key} = {json.dumps(value, ensure_ascii=False)}" for key, value in table.items()]


def mutmut(staging: Path, *args: str, check: bool = True) -> str:
    """Run mutmut in the staging folder; its output (stdout and stderr) as text."""
    done = subprocess.run(
        [str(MUTMUT), *args], cwd=staging, capture_output=True, text=True, env={**os.environ, "PYTHONUTF8": "1"}
    )
    if check and done.returncode:
        sys.exit(f"mutmut {' '.join(args[:1])} failed ({done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return done.stdout + done.stderr


def statuses(staging: Path) -> dict[str, str]:
    """Every mutant's status, from `mutmut results --all true` (`    name: status` lines)."""
    found = re.findall(r"^\s+(\S+): (.+)$", mutmut(staging, "results", "--all", "true"), flags=re.MULTILINE)
    return dict(found)


def report(targets: list[Target], found: dict[str, str]) -> tuple[str, list[str]]:
    """A markdown table per module (mutants run, of how many, killed, survived, timeout, no tests, caught %)
    and the mutants not caught."""
    rows = ["| module | mutants | killed | survived | timeout | no tests | other | caught % |", "|---" * 8 + "|"]
    survivors, total = [], Counter()
    for target in targets:
        every = [name for name in found if target.owns(name)]
        mine = {name: found[name] for name in every if found[name] != "not checked"}
        counts = Counter(mine.values()) + Counter(mutants=len(mine), generated=len(every))
        total += counts
        rows.append(_row(target.path, counts))
        survivors += sorted(name for name, status in mine.items() if status not in CAUGHT)
    return "\n".join([*rows, _row("**all**", total)]), survivors


# A timeout is caught as mutmut counts it: the tests ran 10 x longer than on the real code (they hung).
CAUGHT = ("killed", "timeout")


def _row(label: str, counts: Counter[str]) -> str:
    """One module's row (`counts`: mutants run and generated, and how many of each status)."""
    other = counts["mutants"] - sum(counts[s] for s in ("killed", "survived", "timeout", "no tests"))
    caught = sum(counts[s] for s in CAUGHT)
    cells = [label, _of(counts["mutants"], counts["generated"]), *(counts[s] for s in ("killed", "survived"))]
    cells += [counts["timeout"], counts["no tests"], other, _percent(caught, counts["mutants"])]
    return "| " + " | ".join(map(str, cells)) + " |"


def _of(run: int, generated: int) -> str:
    """`run` mutants, and of how many (when a sample ran)."""
    return str(run) if run == generated else f"{run} of {generated}"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}" if whole else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="PATH", help="a module of TARGETS (repeatable)")
    parser.add_argument("--staging", type=Path, help="an empty or missing folder (default: a new one in /tmp)")
    parser.add_argument("--max-children", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--sample", type=int, help="run only this many mutants of each module, drawn at random")
    parser.add_argument("--again", action="store_true", help="rerun what the pass in --staging did not catch")
    args = parser.parse_args()
    known = {target.path: target for target in TARGETS}
    unknown = sorted(set(args.only or ()) - set(known))
    if unknown:
        parser.error(f"not in TARGETS: {', '.join(unknown)}")
    targets = [known[path] for path in args.only] if args.only else list(TARGETS)
    if missing := check_functions(targets):
        parser.error(f"TARGETS lists functions that are not there: {', '.join(missing)}")
    if args.again and not args.staging:
        parser.error("--again needs the --staging folder of a finished pass")
    staging = args.staging or Path(tempfile.mkdtemp(prefix="flywheel-mutation-"))
    if not args.again and staging.exists() and any(staging.iterdir()):
        parser.error(f"{staging} is not empty")
    started = time.monotonic()
    found: dict[str, str] = {}
    home: dict[str, Path] = {}  # Each mutant's staging folder.
    for folder, group in rerun(staging) if args.again else fresh(staging, targets):
        print(f"{', '.join(t.path for t in group)}: {folder}", flush=True)
        done = run(folder, group, args.max_children, args.sample, again=args.again)
        found |= done
        home |= dict.fromkeys(done, folder)
        print(f"  done at {time.monotonic() - started:.0f} s", flush=True)
    targets = [target for target in targets if any(target.owns(name) for name in found)]
    table, survivors = report(targets, found)
    diffs = [mutmut(home[name], "show", name, check=False) for name in survivors]
    (staging / "survivors.diff").write_text("\n".join(diffs))
    print(f"\n{table}\n\nnot caught ({len(survivors)}), diffs in {staging / 'survivors.diff'}:")
    for name in survivors:
        print(f"  {name}: {found[name]}")
    print(f"\ntook {time.monotonic() - started:.0f} s")


def fresh(staging: Path, targets: list[Target]) -> Iterator[tuple[Path, list[Target]]]:
    """A staging folder per list of tests, with the targets that share it."""
    groups: dict[tuple[str, ...], list[Target]] = {}
    for target in targets:
        groups.setdefault(target.tests, []).append(target)
    for number, group in enumerate(groups.values(), start=1):
        folder = staging / f"group-{number}"
        stage(folder, group)
        yield folder, group


def rerun(staging: Path) -> Iterator[tuple[Path, list[Target]]]:
    """A finished pass's staging folders with the checkout's code and tests copied in again (mutmut makes the
    mutants of a changed file anew); refused where mutated code changed (the pass's mutants are not its)."""
    for folder in sorted(staging.glob("group-*")):
        found = statuses(folder)
        group = [target for target in TARGETS if any(target.owns(name) for name in found)]
        staged = folder / "src" / "flywheel"
        changed = [t.path for t in group if mutated_code(staged, t) != mutated_code(ROOT, t)]
        if changed:
            sys.exit(f"{folder}: mutated code in {', '.join(changed)} changed since the pass: run it afresh (--only)")
        copy_checkout(folder)
        yield folder, group


def run(
    staging: Path, targets: list[Target], max_children: int, sample: int | None = None, again: bool = False
) -> dict[str, str]:
    """Run mutmut in a staged folder on the targets' mutants (if `sample`, that many of each target's, drawn
    with a fixed seed; if `again`, those it ran and did not catch); every mutant's status ("not checked": not
    drawn)."""
    patterns = [pattern for target in targets for pattern in target.patterns()]
    if again:
        patterns = [name for name, status in statuses(staging).items() if status not in (*CAUGHT, "not checked")]
    elif sample:
        # A name no mutant has: mutmut generates the mutants and times the tests, then stops.
        mutmut(staging, "run", "--max-children", str(max_children), "flywheel.no-such-mutant", check=False)
        every = statuses(staging)
        draw = random.Random(SAMPLE_SEED)
        patterns = []
        for target in targets:
            mine = sorted(name for name in every if target.owns(name))
            patterns += draw.sample(mine, min(sample, len(mine)))
    # mutmut's exit status is not the verdict (it is 0 with survivors): the statuses below are.
    output = mutmut(staging, "run", "--max-children", str(max_children), *patterns, check=False) if patterns else ""
    log = staging / ("mutmut-again.log" if again else "mutmut-run.log")
    log.write_text(output)
    found = {name: status for name, status in statuses(staging).items() if any(t.owns(name) for t in targets)}
    if not found or all(status == "not checked" for status in found.values()):
        sys.exit(f"mutmut produced no results; its output is in {log}:\n{output[-4000:]}")
    return found


if __name__ == "__main__":
    main()
