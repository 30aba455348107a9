"""Each stage's library calls, with no Prefect: what the stage flows run, and what the overhead
benchmark runs as its plain-script baseline (so the two measure the same work).

Cost accounting is part of a stage's work, however it runs: generate, SFT, RL, evaluate and lm_eval
run under `track_costs()` (peak memory in their artifacts' metrics). Curate, gate, mine and report
do not: their artifacts are a pure function of their inputs, so their content ids, and every cache
and resume key downstream, stay reproducible."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from flywheel.data import ArtifactStore, Manifest
from flywheel.data.columnar import ShardMap
from flywheel.data.costs import counting_process, track_costs
from flywheel.data.curation import curate_to_store
from flywheel.environments.generate import GenerationPart, generate_rollouts
from flywheel.evaluation.agentic import Progress, run_agentic_eval
from flywheel.evaluation.curriculum import largest_remainder
from flywheel.evaluation.gate import gate as run_gate
from flywheel.evaluation.lm_eval_runner import LMEvalConfig, model_ref_of, run_lm_eval
from flywheel.evaluation.report import build_report
from flywheel.evaluation.weakness import CurriculumSpec, mine_to_store
from flywheel.flows.round_config import RoundConfig
from flywheel.inference import ModelServer, ServerConfig
from flywheel.inference.server import gpu_python
from flywheel.training.config import TrainConfig
from flywheel.training.device import DeviceSettings
from flywheel.training.grpo_config import GRPORunConfig
from flywheel.training.launch import launch, run_logged
from flywheel.training.models import resolve_model
from flywheel.training.registry import run_training
from flywheel.training.sft_config import SFTRunConfig

logger = logging.getLogger(__name__)
SEED_OFFSETS = {"teacher": 0, "policy": 500_000}  # Training streams; held-out items use eval_seed 1,000,000.


class StageParams(BaseModel):
    """What every stage gets: where the store is, which round, how big."""

    store_url: str | None = Field(default=None, description="Artifact store (default: $FLYWHEEL_STORE or ./.flywheel).")
    round_no: int = Field(default=1, ge=0, description="Round number (run names, artifact names).")
    config: RoundConfig = Field(default_factory=RoundConfig, description="The round's config.")

    def store(self) -> ArtifactStore:
        return ArtifactStore(self.store_url)


class GenerateParams(StageParams):
    tokenizer_model: str = Field(description="Model ref whose tokenizer scores the rollouts (and that acts as policy).")
    plan: dict[str, dict[str, Any]] | None = Field(
        default=None, description="The curriculum's generation plan: env -> teacher/policy -> groups and slice mix."
    )


class CurateParams(StageParams):
    rollouts: str = Field(description="Rollouts artifact id.")
    carried: list[str] = Field(
        default_factory=list,
        description="Rollouts of the rounds the gate kept out since the champion's: curated with this round's, "
        "so what their candidates learned is not lost.",
    )


class SFTParams(StageParams):
    base: str = Field(description="Model artifact id to fine-tune.")
    dataset: str = Field(description="SFT dataset artifact id.")
    steps: int | None = Field(
        default=None, ge=1, description="SFT steps (None: `sft.total_steps`; a round scales them to its plan)."
    )


class RLParams(StageParams):
    policy: str = Field(description="Checkpoint artifact id to start GRPO from.")
    task_mix: dict[str, dict[str, float]] | None = Field(
        default=None, description="The curriculum's GRPO task weights: env -> 'category/difficulty' -> p(1-p)."
    )


class EvaluateParams(StageParams):
    model: str = Field(description="Model or checkpoint ref to evaluate.")
    name: str = Field(description="Name of the eval artifact.")


class LMEvalParams(EvaluateParams):
    """The same fields as an agentic evaluation: one model, one eval artifact name."""


class GateParams(StageParams):
    evals: list[str] = Field(description="Eval artifact ids of the candidate.")
    candidate: str = Field(description="Candidate model artifact id.")
    champion: str | None = Field(default=None, description="The model to beat (None: the `champion` ref now).")
    champion_evals: list[str] | None = Field(
        default=None, description="That model's evals on the candidate's items (None: those recorded at its promotion)."
    )


class MineParams(StageParams):
    evals: list[str] = Field(description="Eval artifact ids of the champion (after this round's gate) to mine.")
    previous: str | None = Field(default=None, description="The last round's weaknesses artifact id.")
    rollouts: str | None = Field(
        default=None, description="This round's rollouts artifact id: the champion's own rollouts count as evidence."
    )
    carried_evals: list[str] = Field(
        default_factory=list,
        description="The evals of this round's candidate when the gate kept it out: the unsolved slices it "
        "solved are carried (the next round curates its rollouts again), not taught anew.",
    )


class ReportParams(StageParams):
    refs: list[str] = Field(description="Eval, weaknesses and gate artifact ids.")


@track_costs()
def generate(params: GenerateParams, map_shards: ShardMap | None = None) -> Manifest:
    """Rollouts in `process` mode as the curriculum's plan says: the teacher on unsolved slices, the
    round's base model, served, on learnable and (replayed) mastered ones; no plan: the teacher on all."""
    p, store = params.config, params.store()
    model_dir = resolve_model(params.tokenizer_model, store)
    plan = uniform_plan(p) if params.plan is None else params.plan
    with contextlib.ExitStack() as stack:
        served: dict[str, Any] = {}

        def actor(source: str) -> dict[str, Any]:
            """How a part's actor is reached: the oracle, the endpoint teacher, or the served base model."""
            who = p.generate.teacher if source == "teacher" else "policy"
            if who == "oracle":
                return {"teacher": "oracle"}
            if who == "endpoint":
                assert p.generate.endpoint is not None  # GenerateSection's validator.
                return {"teacher": "server", **p.generate.endpoint.model_dump()}
            if not served:  # The round's own model: the turns and reply caps it is judged with.
                server = stack.enter_context(ModelServer(server_config(p, str(model_dir))))
                stack.enter_context(counting_process(server.pid))
                served.update(teacher="server", base_url=server.base_url, model_name=server.model_name)
            return served

        parts = []
        for env, sources in sorted(plan.items()):
            for source, part in sorted(sources.items()):
                if part["groups"]:
                    parts.append(
                        GenerationPart(
                            env=env, groups=part["groups"], task_mix=part.get("mix"), label=source,
                            seed=params.round_no + SEED_OFFSETS[source],  # Distinct item ids per part.
                            env_config=_env_slice(p, env) | _turn_caps(p, source), **actor(source),
                        )
                    )  # fmt: skip
        name = round_name("rollouts", params.round_no)
        return generate_rollouts(
            store, parts, group_size=p.generate.group_size, tokenizer=str(model_dir), seed=params.round_no, name=name,
            shard_groups=p.data.shard_groups if p.data.runner == "dask" else None,
            map_shards=map_shards,
        )  # fmt: skip


def uniform_plan(p: RoundConfig) -> dict[str, dict[str, Any]]:
    """No curriculum: the teacher on every slice of every env, the groups split evenly over the envs."""
    shares = largest_remainder([1.0] * len(p.envs), p.generate.groups)
    return {env: {"teacher": {"groups": n, "mix": None}} for env, n in zip(p.envs, shares, strict=True) if n}


def _env_slice(p: RoundConfig, env: str) -> dict[str, Any]:
    """The round's task slice of `env`: its difficulty and categories."""
    return {"difficulty": p.difficulty, "categories": p.env_categories(env)}


def _turn_caps(p: RoundConfig, source: str) -> dict[str, Any]:
    """A served model generates with the turns and reply caps it is judged with (the oracle needs none)."""
    if source == "teacher" and p.generate.teacher == "oracle":
        return {}
    return {"max_token_length": p.max_token_length, "max_agent_turns": p.max_agent_turns}


def curate(params: CurateParams, map_shards: ShardMap | None = None) -> Manifest:
    """Rollouts -> SFT set (returned) and preference pairs, with their data cards; `map_shards` screens
    the rollouts' shards (the stage flow's Dask map under `data.runner: dask`)."""
    n = params.round_no
    names = round_name("sft", n), round_name("pairs", n)
    return curate_to_store(params.store(), [params.rollouts, *params.carried], *names, map_shards=map_shards)[0]


def sft_config(params: SFTParams) -> SFTRunConfig:
    """The SFT stage's run config (pure: `flywheel plan` shows it)."""
    return params.config.sft_run_config(
        policy_model=params.base,
        dataset=params.dataset,
        total_steps=params.steps,
        output_name=round_name("sft", params.round_no),
    )


def rl_config(params: RLParams) -> GRPORunConfig:
    """The RL stage's GRPO config (pure, like `sft_config`)."""
    return params.config.rl_run_config(
        policy_model=params.policy, task_mix=params.task_mix, output_name=round_name("rl", params.round_no)
    )


def server_config(p: RoundConfig, model_dir: str, planned: bool = False) -> ServerConfig:
    """How a stage serves a model: `vllm serve` across the stage's GPUs on CUDA, `transformers serve` on CPU
    (`planned`: for `flywheel plan`, whose model directory does not exist yet)."""
    settings = DeviceSettings.for_device(p.device)
    fields: dict[str, Any] = {"model": model_dir}
    if settings.server_backend == "vllm":
        fields |= {"backend": "vllm", "dtype": settings.dtype, "data_parallel_size": max(1, p.gpus)}
    return ServerConfig.model_validate(fields, context={"planned": planned})


@track_costs()
def sft(params: SFTParams, callbacks: list[Any] | None = None) -> Manifest:
    """Supervised fine-tuning (TRL SFTTrainer) on the curated set; an empty set (every rollout of the
    round failed) or one whose conversations all exceed `sft_max_length` trains nothing and passes
    the base on to GRPO, with a warning."""
    from flywheel.training.sft import NoExampleFits  # The trainer's module: transformers and TRL.

    store = params.store()
    if store.manifest(params.dataset).metrics.get("sft_examples", 1) == 0:
        logger.warning("round %d: the curated SFT set is empty: no SFT, GRPO starts from the base", params.round_no)
        return store.manifest(params.base)
    try:
        return _train(sft_config(params), params, callbacks)
    except NoExampleFits as err:
        logger.warning("round %d: %s (sft_max_length): no SFT, GRPO starts from the base", params.round_no, err)
        return store.manifest(params.base)


@track_costs()
def rl(params: RLParams, callbacks: list[Any] | None = None) -> Manifest:
    """GRPO in the round's environment, KL to the SFT checkpoint; atropos mode's env workers in a run of
    `rl.env_workers_deployment` when it is set."""
    from flywheel.flows.env_workers import DeployedWorkers  # Atropos mode's machinery: the trainer's imports.

    cfg = rl_config(params)
    if cfg.env_workers_deployment:
        return _train(cfg, params, callbacks, env_workers=DeployedWorkers(cfg, params.store().url))
    return _train(cfg, params, callbacks)


def launched(cfg: TrainConfig, config: RoundConfig) -> bool:
    """Whether a training stage runs as an `accelerate launch` child: on several GPUs, and wherever GRPO
    generates with vLLM, which lives in the GPU runtime (requirements/gpu.txt), not in Prefect's environment."""
    several = config.training_gpus(cfg) > 1 or (config.nodes > 1 and not config.trains_alone(cfg))
    return several or (isinstance(cfg, GRPORunConfig) and cfg.vllm())


def _train(cfg: TrainConfig, params: StageParams, callbacks: list[Any] | None, **extra: Any) -> Manifest:
    """Train here, or launched with accelerate (steps then show in the run log)."""
    if launched(cfg, params.config):
        return launch(cfg, params.store(), params.config.training_gpus(cfg), env_workers=extra.get("env_workers"))
    return run_training(cfg, params.store(), callbacks=callbacks, **extra)


@track_costs()
def evaluate(params: EvaluateParams, progress: Progress | None = None) -> Manifest:
    """Serve the model and run the agentic evaluation on the env's held-out tasks; `progress(env, done, total)`."""
    p, store = params.config, params.store()
    model_dir = resolve_model(params.model, store)
    with ModelServer(server_config(p, str(model_dir))) as server, counting_process(server.pid):
        cfg = p.eval_config(
            base_url=server.base_url, model_name=server.model_name or "", tokenizer=str(model_dir), name=params.name
        )
        return run_agentic_eval(cfg, store, model_ref_of(store, params.model), progress=progress)


@track_costs()
def lm_eval(params: LMEvalParams) -> Manifest:
    """The round's lm-eval tasks on the model: `hf` in this process on CPU, `vllm` on CUDA in the GPU runtime
    (vLLM is not in Prefect's environment)."""
    store = params.store()
    model_dir = resolve_model(params.model, store)
    cfg, ref = lm_eval_config(params), model_ref_of(store, params.model)
    if cfg.backend == "vllm":
        return lm_eval_in_gpu_runtime(cfg, store, model_dir, ref)
    return run_lm_eval(cfg, store, model_dir, ref)


def lm_eval_in_gpu_runtime(cfg: LMEvalConfig, store: ArtifactStore, model_dir: Path, model_ref: str | None) -> Manifest:
    """`run_lm_eval` as a child of the GPU runtime's Python (`FLYWHEEL_GPU_PYTHON`), its output in this log."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "lm_eval.json")
        config.write_text(cfg.model_dump_json())
        arguments = [str(config), store.url, str(model_dir), *([model_ref] if model_ref else [])]
        run_logged([gpu_python(), "-m", "flywheel.evaluation.lm_eval_runner", *arguments])
    return store.manifest(f"eval/{cfg.name}")


def lm_eval_config(params: LMEvalParams) -> LMEvalConfig:
    """The lm-eval stage's config (pure: `flywheel plan` shows it). One GPU: the suites are small, and
    tensor parallelism over 8 would not divide most small models' attention heads."""
    p = params.config
    cuda = DeviceSettings.for_device(p.device).server_backend == "vllm"
    return p.lm_eval_config(backend="vllm" if cuda else "hf", name=params.name)


def gate(params: GateParams) -> Manifest:
    """Promote the candidate to `champion` only when it wins (paired bootstrap + guards)."""
    return run_gate(
        params.store(),
        params.evals,
        params.candidate,
        name=round_name("gate", params.round_no),
        champion_evals=params.champion_evals,
        champion=params.champion,
        config=params.config.gate,
    )


def mine(params: MineParams) -> Manifest:
    """Failure slices with confidence intervals -> the next round's curriculum."""
    return mine_to_store(
        params.store(),
        params.evals,
        name=round_name("weaknesses", params.round_no),
        curriculum=curriculum_spec(params.config),
        previous=params.previous,
        rollouts=params.rollouts,
        carried_evals=params.carried_evals,
    )


def curriculum_spec(p: RoundConfig) -> CurriculumSpec | None:
    """What mining plans the next round with: the round's slices, budget, thresholds and turn budget
    (None: a uniform curriculum plans nothing)."""
    if p.curriculum.mode != "mined":
        return None
    return CurriculumSpec(
        families=p.families(),
        difficulty=p.difficulty,
        groups=p.generate.groups,
        config=p.curriculum,
        max_turns=p.max_agent_turns,
    )


def report(params: ReportParams) -> Manifest:
    """The round's HTML report."""
    store = params.store()
    rounds = round_history(store, params.round_no)
    return build_report(store, params.refs, round_name("report", params.round_no), rounds)


def round_history(store: ArtifactStore, last: int) -> dict[int, dict[str, Any]]:
    """Rounds 0..`last` that passed their gate: the candidate's evals and what mining made of its round."""
    history = {}
    for n in range(last + 1):
        gate_id = store.try_resolve(f"gate/{round_name('gate', n)}")
        if gate_id is not None:
            evals = store.read_json(gate_id, "decision.json")["candidate_evals"]
            history[n] = {"evals": evals, "weaknesses": store.try_resolve(f"weaknesses/{round_name('weaknesses', n)}")}
    return history


def round_name(what: str, round_no: int) -> str:
    """The name of round `round_no`'s artifact `what` (`sft-r1`: `dataset/sft-r1`, `checkpoint/sft-r1`):
    the one spelling of every round artifact."""
    return f"{what}-r{round_no}"
