"""The seeds' spelling `environments.<module>` for `flywheel.environments.<module>`.

In a checkout, with its root on sys.path (`python -c "from environments.my_env import MyEnv"` run
there, as seed 004 does), the folder imports as a top-level `environments`. Its `__init__` then
becomes `flywheel.environments` and this finder hands out the very same module objects for every
`environments.<module>`, so no class is loaded twice (a second `BaseEnvironment` would fail every
`issubclass`). Outside a checkout the name `environments` stays free for a user's own package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

SEED, CANONICAL = "environments", "flywheel.environments"


class SeedAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`environments.X` -> the module `flywheel.environments.X`, while `environments` is ours."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(f"{SEED}.") and sys.modules.get(SEED) is sys.modules.get(CANONICAL):
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(CANONICAL + spec.name[len(SEED) :])
        self._specs[spec.name] = module.__spec__  # The import machinery overwrites it next.
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._specs.pop(module.__name__.replace(CANONICAL, SEED, 1), module.__spec__)


def install() -> ModuleType:
    """Put the alias first on sys.meta_path (once) and return `flywheel.environments`."""
    if not any(isinstance(finder, SeedAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, SeedAlias())
    return importlib.import_module(CANONICAL)
