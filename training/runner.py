"""`AtroposRunner`: the documented training program (README, AtroposRunner), on this project's trainers.

    from flywheel.environments.tool_use_chain import ToolUseChainEnv
    from flywheel.training import AtroposRunner

    env = ToolUseChainEnv(num_tasks=100, difficulty="medium", max_steps=20)
    runner = AtroposRunner(env=env, policy_model="smollm2", algorithm="grpo", batch_size=8,
                           learning_rate=1e-5, kl_beta=0.05, num_rollouts_per_task=4, total_steps=10)
    runner.run()

`env` may be an env instance (its own config is used: tasks, difficulty, turns), an env class,
a registered name / `module:Class` / file path, or a list of those. The env is given the
policy's tokenizer. A run writes `logs/run-<date>-<time>-<name>/` with `metrics.jsonl` (loss /
reward / kl), `rollouts/` (sampled rollouts every `rollouts_every` steps) and `checkpoints/`, and
puts the checkpoint in the artifact store with lineage. Every other keyword is a field of the
algorithm's config (`GRPORunConfig`, `DPORunConfig`); an unknown one is an error.
"""

from __future__ import annotations

from typing import Any

from flywheel.data import ArtifactStore, Manifest
from flywheel.environments.adapter import StepEnvAdapter
from flywheel.environments.base import BaseEnvironment
from flywheel.environments.hermes_base_env import HermesAgentBaseEnv
from flywheel.training.config import ConfigError
from flywheel.training.registry import algorithm as algorithm_entry
from flywheel.training.registry import run_training


class AtroposRunner:
    """Train `policy_model` on `env` with `algorithm` (grpo | dpo; ppo names the alternatives)."""

    def __init__(
        self,
        env: Any,
        policy_model: str,
        ref_model: str | None = None,
        algorithm: str = "grpo",
        batch_size: int = 4,
        learning_rate: float = 1e-5,
        kl_beta: float = 0.04,
        num_rollouts_per_task: int = 4,
        total_steps: int = 10,
        store: ArtifactStore | str | None = None,
        **config: Any,
    ) -> None:
        given = list(env) if isinstance(env, list | tuple) else [env]
        names = [_env_spec(e) for e in given]
        self.envs: list[Any] = [
            _agent_env(e) if isinstance(e, BaseEnvironment) else n for e, n in zip(given, names, strict=True)
        ]
        self.env_instances = [e for e in self.envs if not isinstance(e, str)]
        built_in = [e for e in self.env_instances if not isinstance(e, StepEnvAdapter)]
        if built_in and "num_tasks" not in config:  # `Env(num_tasks=100)` (its total_steps): train on those tasks.
            config["num_tasks"] = built_in[0].config.total_steps
        if ref_model == policy_model:
            ref_model = None  # GRPO's reference is the initial policy: the same model, said twice.
        config_class = algorithm_entry(algorithm).config_class()
        try:
            self.config = config_class(
                envs=names,
                policy_model=policy_model,
                ref_model=ref_model,
                batch_size=batch_size,
                learning_rate=learning_rate,
                kl_beta=kl_beta,
                num_rollouts_per_task=num_rollouts_per_task,
                total_steps=total_steps,
                **config,
            )
        except ValueError as err:  # pydantic's ValidationError: unknown fields and bad values, all listed.
            raise ConfigError(f"AtroposRunner: {err}") from err
        self.store = store if isinstance(store, ArtifactStore) else ArtifactStore(store)

    def run(self) -> Manifest:
        """Train; returns the checkpoint's manifest (the run folder is stored beside it)."""
        return run_training(self.config, self.store, envs=self.envs)


def _agent_env(env: BaseEnvironment) -> Any:
    """An env instance as an agent env: built-in envs are one; a user's step env is adapted."""
    return env if isinstance(env, HermesAgentBaseEnv) else StepEnvAdapter.around(env)


def _env_spec(env: Any) -> str:
    """The registry spec of an env given as an instance, a class or a spec string."""
    if isinstance(env, str):
        return env
    cls = env if isinstance(env, type) else type(env)
    if not (isinstance(cls, type) and issubclass(cls, BaseEnvironment)):
        raise ConfigError(f"AtroposRunner: env must be an environment, its class or its name, not {env!r:.80}")
    from flywheel.environments.registry import ENVIRONMENTS

    target = getattr(cls, "environment_cls", cls)  # An adapted step env: name the user's class.
    for name, location in ENVIRONMENTS.items():
        if location == f"{target.__module__}:{target.__qualname__}":
            return name
    return f"{target.__module__}:{target.__qualname__}"
