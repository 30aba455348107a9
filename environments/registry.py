"""Environment names -> `"module:Class"`, so naming an env does not import it (lm-eval's pattern).

An env is named in one of three ways: a registered name (`ENVIRONMENTS`), `"module:Class"`, or
a file path (`"path/to/my_env.py"`, or `"path/to/my_env.py:MyEnv"` when it defines several).
A step-contract `BaseEnvironment` that is not already an agent env is wrapped in `StepEnvAdapter`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from flywheel.environments.task_stream import DIFFICULTIES, TaskStream

ENVIRONMENTS = {
    "tool_use_chain": "flywheel.environments.tool_use_chain:ToolUseChainEnv",
    "web_navigation": "flywheel.environments.web_navigation:WebNavigationEnv",
    "swe_bench": "flywheel.environments.swe_bench:SWEBenchEnv",
    "long_horizon": "flywheel.environments.long_horizon:LongHorizonEnv",
    "file_stats": "flywheel.environments.custom.file_stats_env:FileStatsEnv",
    "function_calling": "flywheel.environments.function_calling:FunctionCallingEnv",
}

TASK_FAMILIES = ("tool_use_chain", "web_navigation", "swe_bench", "long_horizon", "function_calling")


def is_env_spec(spec: str) -> bool:
    """Whether `spec` names an env in one of the accepted forms (without importing it)."""
    return spec in ENVIRONMENTS or ":" in spec or spec.endswith(".py")


def env_class(spec: str) -> Any:
    """The agent-env class `spec` names; an unknown name lists the known ones."""
    from flywheel.environments.adapter import adapter_class
    from flywheel.environments.base import BaseEnvironment
    from flywheel.environments.hermes_base_env import HermesAgentBaseEnv

    if not is_env_spec(spec):
        raise ValueError(
            f"unknown environment '{spec}'; known: {', '.join(ENVIRONMENTS)} (or module:Class, or a .py file)"
        )
    target = ENVIRONMENTS.get(spec, spec)
    location, _, class_name = target.rpartition(":") if ":" in target else (target, "", "")
    module = _load_module(location)
    if class_name:
        if not hasattr(module, class_name):
            raise ValueError(f"environment '{spec}': {location} defines no {class_name}")
        cls = getattr(module, class_name)
    else:
        found = [
            c for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, BaseEnvironment) and c.__module__ == module.__name__
        ]  # fmt: skip
        if len(found) != 1:
            names = ", ".join(c.__name__ for c in found) or "none"
            raise ValueError(f"environment '{spec}': expected one BaseEnvironment in the file, found {names}; "
                             "name it as path.py:Class")  # fmt: skip
        cls = found[0]
    if not (isinstance(cls, type) and issubclass(cls, BaseEnvironment)):
        raise ValueError(f"environment '{spec}': {cls!r} is not a BaseEnvironment")
    return cls if issubclass(cls, HermesAgentBaseEnv) else adapter_class(cls)


def env_name(spec: str) -> str:
    """A short name for `spec` in file names, metrics and samples: a registered name (or any plain
    label) as it is, a module:Class or a file by its class's `name` (else the class name), never a path."""
    if spec in ENVIRONMENTS or not is_env_spec(spec):  # A registered name, or a plain label: as it is.
        return spec
    cls = env_class(spec)
    return getattr(cls, "name", None) or cls.__name__


def task_categories(spec: str) -> tuple[str, ...] | None:
    """The task categories of an env with a task family (None: an env without categories)."""
    categories = getattr(env_class(spec), "categories", None)
    return tuple(categories) if categories else None


@functools.cache  # Mining and the round body both plan; a task family is deterministic.
def teacher_turns(spec: str, slice_name: str, samples: int = 4) -> int | None:
    """Model calls the env's oracle takes on a `category/difficulty` slice (the most over the first
    `samples` training tasks): the turns a student needs to imitate it. None: no task family or oracle."""
    cls = env_class(spec)
    make_task, categories = getattr(cls, "make_task", None), getattr(cls, "categories", None)
    if make_task is None or not categories or "/" not in slice_name:
        return None
    mix = {f"{c}/{d}": 0.0 for c in categories for d in DIFFICULTIES} | {slice_name: 1.0}
    items = TaskStream(spec, make_task, tuple(categories), seed=0, mix=mix).items(samples)
    turns = [len(item["oracle"]) for item in items if item.get("oracle")]
    return max(turns) if turns else None


def categories_of(cls: type, wanted: list[str] | None) -> list[str] | None:
    """The categories of `wanted` that the env class `cls` has (None: all; an env without categories: None).
    A list shared by several envs names each one's own; an env with none of them is an error."""
    known = getattr(cls, "categories", None)
    if wanted is None or not known:
        return None
    mine = [c for c in known if c in wanted]
    if not mine:
        raise ValueError(f"env {cls.__name__} has none of the categories {wanted}; its own: {', '.join(known)}")
    return mine


def _load_module(location: str) -> Any:
    """A module by dotted name, or by file path (imported under a name derived from the path)."""
    if not location.endswith(".py"):
        try:
            try:
                return importlib.import_module(location)
            except ModuleNotFoundError as err:  # The seeds' `environments.X` where no checkout is on sys.path.
                if err.name != "environments" or not location.startswith("environments."):
                    raise
                return importlib.import_module(f"flywheel.{location}")
        except ImportError as err:
            raise ValueError(f"cannot import environment module '{location}': {err}") from err
    path = Path(location).resolve()
    if not path.is_file():
        raise ValueError(f"environment file not found: {location}")
    name = f"flywheel_user_env_{path.stem}_{abs(hash(str(path))):x}"
    if str(path.parent) not in sys.path:  # Its own modules beside it import; last, so they shadow nothing.
        sys.path.append(str(path.parent))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
