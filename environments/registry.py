"""Environment names -> `"module:Class"`, so naming an env does not import it (lm-eval's pattern)."""

from __future__ import annotations

import importlib
from typing import Any

ENVIRONMENTS = {
    "tool_use_chain": "environments.tool_use_chain:ToolUseChainEnv",
    "web_navigation": "environments.web_navigation:WebNavigationEnv",
    "swe_bench": "environments.swe_bench:SWEBenchEnv",
    "long_horizon": "environments.long_horizon:LongHorizonEnv",
    "file_stats": "environments.custom.file_stats_env:FileStatsEnv",
}

TASK_FAMILIES = ("tool_use_chain", "web_navigation", "swe_bench", "long_horizon")


def env_class(name: str) -> Any:
    """The environment class registered as `name`; an unknown name lists the known ones."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment '{name}'; known: {', '.join(ENVIRONMENTS)}")
    module, _, cls = ENVIRONMENTS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
