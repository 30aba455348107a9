"""Generate scored rollouts with an env in `process` mode (programmatically) and store them.

The actor is the env's oracle (teacher data for a first round) or an OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from data import ArtifactStore, Manifest
from environments.registry import env_class
from environments.servers import server_configs


def generate_rollouts(
    store: ArtifactStore,
    env_name: str,
    *,
    groups: int,
    group_size: int,
    tokenizer: str,
    teacher: str = "oracle",
    base_url: str | None = None,
    model_name: str | None = None,
    api_key_env: str | None = None,
    task_mix: dict[str, float] | None = None,
    seed: int = 0,
    name: str = "rollouts",
    parents: list[str] | None = None,
    **env_config: Any,
) -> Manifest:
    """Run `groups` groups of `group_size` rollouts and store the JSONL (+ stats) as a `rollouts` artifact."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, f"{env_name}.jsonl")
        servers = server_configs(base_url, model_name or "teacher", api_key_env) if base_url else None
        env = env_class(env_name)(
            server_configs=servers,
            tokenizer_name=tokenizer,
            teacher=teacher,
            group_size=group_size,
            total_steps=groups,
            task_mix=task_mix,
            seed=seed,
            data_path_to_save_groups=str(out),
            **env_config,
        )
        env.process_mode = True
        env.n_groups_to_process = groups
        asyncio.run(env.process_manager())
        stats = json.loads(out.with_suffix(".stats.json").read_text())
        files = {out.name: out, "stats.json": out.with_suffix(".stats.json")}
        params = {
            "env": env_name,
            "groups": groups,
            "group_size": group_size,
            "teacher": teacher,
            "seed": seed,
            "task_mix": task_mix,
            "model": model_name,
        }
        return store.put("rollouts", name, files, parents=parents or [], params=params, metrics=stats)
