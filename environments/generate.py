"""Generate scored rollouts with envs in `process` mode (programmatically) and store them.

A generation is a list of parts, each one env run by one actor - the env's oracle (teacher data)
or an OpenAI-compatible server (an endpoint teacher, or the policy itself) - over a slice mix;
all parts land in one `rollouts` artifact, each part's groups as Parquet shards (`data/columnar.py`).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from flywheel.data import ArtifactStore, Manifest
from flywheel.data.columnar import format_params, rollouts_to_shards
from flywheel.environments.agent.servers import server_configs
from flywheel.environments.registry import env_class, env_name


class GenerationPart(BaseModel):
    """One env, one actor, how many groups, and the slice weights of its task stream."""

    env: str = Field(description="Env name (registered, module:Class or file).")
    groups: int = Field(ge=1, description="Groups to generate.")
    teacher: Literal["oracle", "server"] = Field(default="oracle", description="The env's oracle, or `base_url`.")
    base_url: str | None = Field(default=None, description="OpenAI-compatible base URL (teacher=server).")
    model_name: str | None = Field(default=None, description="Model name at `base_url`.")
    api_key_env: str | None = Field(default=None, description="Environment variable holding its API key.")
    task_mix: dict[str, float] | None = Field(default=None, description="'category/difficulty' -> weight.")
    label: str = Field(default="", description="Names the part's shards: `<env>[-<label>]-NNNNN.parquet`.")
    seed: int | None = Field(default=None, description="Seed of its task stream (None: the generation's).")
    env_config: dict[str, Any] = Field(default_factory=dict, description="More env config (slice filters, caps).")

    @property
    def split(self) -> str:
        """The part's name in the artifact: `<env>[-<label>]`."""
        name = env_name(self.env)
        return f"{name}-{self.label}" if self.label else name


def generate_rollouts(
    store: ArtifactStore,
    parts: list[GenerationPart],
    *,
    group_size: int,
    tokenizer: str,
    seed: int = 0,
    name: str = "rollouts",
    parents: list[str] | None = None,
) -> Manifest:
    """Run every part's groups of `group_size` rollouts; store their shards (+ stats) as one `rollouts` artifact."""
    if not parts:
        raise ValueError("nothing to generate: no generation part has groups")
    with tempfile.TemporaryDirectory() as tmp:
        files: dict[str, Any] = {}
        per_part = {}
        for part in parts:
            out = Path(tmp, f"{part.split}.jsonl")
            part_seed = seed if part.seed is None else part.seed
            per_part[part.split] = run_part(part, out, group_size=group_size, tokenizer=tokenizer, seed=part_seed)
            files |= {shard.name: shard for shard in rollouts_to_shards(out, Path(tmp, "shards"))}
        stats = {
            key: sum(s[key] for s in per_part.values()) for key in ("groups_written", "groups_failed", "rollouts")
        } | {"infra_failures": sum(s["infra_failures"] for s in per_part.values())}
        files["stats.json"] = json.dumps({"total": stats, "parts": per_part}, indent=2)
        params = format_params("rollouts") | {
            "parts": [p.model_dump(exclude={"api_key_env"}) for p in parts],
            "group_size": group_size,
            "seed": seed,
            "teacher": sorted({p.teacher for p in parts}),
            "model": sorted({p.model_name for p in parts if p.model_name}),
        }
        return store.put("rollouts", name, files, parents=parents or [], params=params, metrics=stats)


def run_part(part: GenerationPart, out: Path, *, group_size: int, tokenizer: str, seed: int) -> dict[str, Any]:
    """One part in `process` mode into `out` (JSONL); its stats."""
    servers = server_configs(part.base_url, part.model_name or "teacher", part.api_key_env) if part.base_url else None
    env = env_class(part.env)(
        server_configs=servers,
        tokenizer_name=tokenizer,
        teacher=part.teacher,
        group_size=group_size,
        total_steps=part.groups,
        task_mix=part.task_mix,
        seed=seed,
        data_path_to_save_groups=str(out),
        **part.env_config,
    )
    env.process_mode = True
    env.n_groups_to_process = part.groups
    asyncio.run(env.process_manager())
    return json.loads(out.with_suffix(".stats.json").read_text())
