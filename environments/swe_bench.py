"""SWEBenchEnv: fix an injected bug in a small generated repo; hidden tests decide.

Also runs real SWE-bench-format instances: `--env.instances_path FILE.jsonl`, one JSON object per
line with `instance_id`, `repo_path` (a local git checkout), `base_commit`, `problem_statement`,
`test_patch`, `patch` (the oracle) and `FAIL_TO_PASS` / `PASS_TO_PASS` (pytest node ids). The
`eval_size` instances whose ids hash lowest are held out for evaluation and never trained on.

    python environments/swe_bench.py evaluate --env.eval_size 10 --env.tokenizer_name MODEL_DIR \
        --env.data_dir_to_save_evals out/swe --openai.base_url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field

from flywheel.environments.agent.policies import call, final
from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.hermes_base_env import HermesAgentEnvConfig
from flywheel.environments.task_env import TaskEnv
from flywheel.environments.tasks import swe_tasks as tasks
from flywheel.environments.tool_context import ToolContext
from flywheel.environments.verify.calls import checks_from, run_checks
from flywheel.environments.verify.hidden_tests import fresh_verify_dir, run_pytest, write_verifier_file


class SWEBenchEnvConfig(HermesAgentEnvConfig):
    """Generated bug-fix tasks, or real SWE-bench-format instances from a JSONL file."""

    max_agent_turns: int = 12
    instances_path: str | None = Field(
        default=None, description="SWE-bench-format JSONL (replaces generated tasks; `eval_size` of them held out)."
    )


class SWEBenchEnv(TaskEnv):
    name = "swe_bench"
    env_config_cls = SWEBenchEnvConfig
    make_task = tasks.make_task
    categories = tasks.CATEGORIES

    async def setup(self) -> None:
        if not self.config.instances_path:
            await super().setup()
            return
        instances = load_instances(Path(self.config.instances_path))
        train, self.eval_items = split_instances(instances, self.config.eval_size)
        for item in self.eval_items:
            self.remember_item(item)
        self.stream = _ListStream(train)
        self.index = self.config.first_item

    async def verify(self, item: dict[str, Any], result: AgentResult, ctx: ToolContext) -> bool:
        """Every hidden check holds: generated tasks call the package's functions in a child process
        (`flywheel.environments.verify.calls`); a real instance's named tests must be reported passed in pytest's junit
        report (never the exit code), beside a canary test that must fail. Its sandbox commands (up to two
        minutes each) run off the event loop, so the other rollouts go on meanwhile."""
        return await asyncio.to_thread(verify_hidden_checks, item, ctx)


def verify_hidden_checks(item: dict[str, Any], ctx: ToolContext) -> bool:
    """`SWEBenchEnv.verify`'s work, in the calling thread."""
    answer = item["answer"]
    verify_dir = fresh_verify_dir(ctx)
    if verify_dir is None:
        return False
    if "test_files" in answer:  # A real instance: the hidden tests over the agent's, run the named ones.
        if not restore_test_files(ctx, answer["test_files"]):
            return False
        node_ids = answer["FAIL_TO_PASS"] + answer["PASS_TO_PASS"]
        targets = " ".join(shlex.quote(n) for n in node_ids)
        hidden = [path for path, content in answer["test_files"].items() if content is not None and _is_test(path)]
        outcomes = run_pytest(ctx, targets, verify_dir, timeout=120, canary=True, canary_in=hidden)
        return outcomes.all_passed(expected=len(set(node_ids)))
    return run_checks(ctx, answer["imports"], checks_from(answer["checks"]), verify_dir, ".", timeout=120)


def _is_test(path: str) -> bool:
    name = Path(path).name
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


class _ListStream:
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def item(self, index: int) -> dict[str, Any]:
        if not self.items:
            raise ValueError("no training instances: all of instances_path is held out; lower --env.eval_size")
        return self.items[index % len(self.items)]


def split_instances(items: list[dict[str, Any]], eval_size: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training, held-out) items: the `eval_size` ids of lowest sha256 are held out, all their copies with them.

    Evaluating on instances the policy trained on would overstate it; hashing ids (not taking the
    first lines) keeps the split independent of the file's order.
    """
    ids = sorted({item["item_id"] for item in items}, key=lambda i: hashlib.sha256(i.encode()).hexdigest())
    held = set(ids[:eval_size])
    return [i for i in items if i["item_id"] not in held], [i for i in items if i["item_id"] in held]


def load_instances(path: Path) -> list[dict[str, Any]]:
    """SWE-bench-format JSONL -> task items whose files are the repo at `base_commit`."""
    items = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            repo = Path(raw["repo_path"])
            archive = _git(repo, "ls-tree", "-r", "--name-only", raw["base_commit"]).split()
            files = {name: _git(repo, "show", f"{raw['base_commit']}:{name}") for name in archive}
            fail_to_pass = _as_list(raw["FAIL_TO_PASS"])
            pass_to_pass = _as_list(raw.get("PASS_TO_PASS", []))
            test_files = hidden_test_files(files, raw["test_patch"], fail_to_pass + pass_to_pass)
        except (KeyError, json.JSONDecodeError, OSError) as err:
            raise ValueError(f"{path}:{number}: not a usable SWE-bench instance ({err})") from err
        items.append(
            {
                "item_id": raw["instance_id"],
                "env": "swe_bench",
                "category": "swe_bench_instance",
                "difficulty": raw.get("difficulty", "hard"),
                "prompt": f"{raw['problem_statement']}\n\nFix the issue in this repository.",
                "files": files,
                "setup_commands": ["git init -q && git add -A && git -c user.name=a -c user.email=a@b commit -qm base"],
                "answer": {
                    "test_files": test_files,
                    "FAIL_TO_PASS": fail_to_pass,
                    "PASS_TO_PASS": pass_to_pass,
                },
                "oracle": [
                    call("write_file", path=".oracle.patch", content=raw["patch"]),
                    call("terminal", command="git apply .oracle.patch && rm .oracle.patch"),
                    final("Applied the fix."),
                ],
            }
        )
    if not items:
        raise ValueError(f"{path}: no instances")
    return items


def hidden_test_files(files: dict[str, str], test_patch: str, node_ids: list[str]) -> dict[str, str | None]:
    """Every test file the verdict reads, as the hidden tests have it: each file `test_patch` touches,
    patched here from the base (None: the patch deletes it), and each named test's file at the base.
    The verifier writes them over the agent's tree (`restore_test_files`), so an edit the agent made
    to a test (say, module code outside the patch's hunks that stubs pytest) never runs."""
    with tempfile.TemporaryDirectory(prefix="swe-tests-") as tmp:
        root = Path(tmp)
        patch = root / "test.patch"
        patch.write_text(test_patch)
        numstat = _git(root, "apply", "--numstat", "-z", str(patch)).split("\0")
        # "added\tdeleted\tpath" a file; a rename is "added\tdeleted\t", then its old and new path.
        touched = {field.split("\t", 2)[-1] for field in numstat} - {""}
        tree = root / "tree"
        tree.mkdir()
        _git(tree, "init", "-q")  # A repository of its own: `git apply` never looks above it.
        for path in touched & files.keys():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_text(files[path])
        _git(tree, "apply", str(patch))
        patched = {path: (tree / path).read_text() if (tree / path).is_file() else None for path in touched}
    named = {node.split("::", 1)[0] for node in node_ids}
    return {path: files[path] for path in sorted(named & files.keys())} | patched


def restore_test_files(ctx: ToolContext, test_files: dict[str, str | None]) -> bool:
    """Write the hidden test files over the agent's tree and delete those the tests do not have;
    False when the agent's tree refuses (a link, a read-only folder): the task is not done."""
    for path, content in test_files.items():
        if content is None:
            ctx.terminal(f"rm -rf -- {shlex.quote(path)}")
        elif not write_verifier_file(ctx, path, content):
            return False
    return True


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise OSError(f"git {args[0]} failed: {done.stderr.strip()}")
    return done.stdout


def _as_list(value: Any) -> list[str]:
    return json.loads(value) if isinstance(value, str) else list(value)


if __name__ == "__main__":
    SWEBenchEnv.cli()
