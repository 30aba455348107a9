"""The flows users run: `flywheel` (N rounds of every stage) and `eval` (evaluate one model).

A round: generate (as the last mining's curriculum says) -> curate -> SFT -> RL (GRPO on the
curriculum's learnable slices) -> evaluate + lm_eval -> gate -> mine (the champion's weaknesses ->
the next curriculum) -> report. Round 0 judges and mines the starting model. Every stage goes
through `run_stage`, so `dispatch="deployments"` sends it to its work pool and a re-run skips
what already finished.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from prefect import flow, get_run_logger

from flywheel.data import ArtifactStore, StoreError, lineage
from flywheel.evaluation.curriculum import grpo_mix, plan_generation
from flywheel.evaluation.gate import recorded_evals, shares_items
from flywheel.evaluation.lm_eval_runner import model_ref_of
from flywheel.evaluation.weakness import stored_curriculum
from flywheel.flows import work
from flywheel.flows.console import stage_finished, stage_started
from flywheel.flows.dispatch import Dispatch, result_storage, run_stage
from flywheel.flows.round_config import RoundConfig, load_round_config
from flywheel.flows.stages import STAGES, evaluate, lm_eval
from flywheel.flows.work import round_name
from flywheel.training.config import ConfigError
from flywheel.training.models import base_model

logger = logging.getLogger(__name__)


@flow(name="flywheel", flow_run_name="flywheel-{profile}")
def flywheel(
    rounds: int = 1,
    profile: str = "default",
    store_url: str | None = None,
    dispatch: Dispatch = "local",
    config: RoundConfig | None = None,
    first_round: int | None = None,
) -> str:
    """Run `rounds` flywheel rounds; returns the last report's artifact id.

    Rounds continue after the last one with a report in the store (`first_round` overrides). A
    round's inputs come from the artifacts of the round before it (its gate decision and mined
    curriculum), so running a round again, after a crash or on purpose, meets the same cache keys
    and skips every stage that already finished. `config` (a whole round config, as
    `flywheel round --config` resolves it) replaces the shipped profile named `profile`.
    """
    log = get_run_logger()
    p = config or load_round_config(profile)
    p.check_one_machine()
    store = ArtifactStore(store_url)
    cached_stage = run_stage.with_options(result_storage=result_storage(store))
    common = {"store_url": store.root_url, "config": p}  # Absolute: cache keys must not depend on the cwd.

    def stage(name: str, /, **fields: Any) -> str:
        started = time.time()
        stage_started(name, fields["round_no"])
        artifact = cached_stage(name, STAGES[name].params(**common, **fields), dispatch)
        stage_finished(store, name, fields["round_no"], artifact, started)
        return artifact

    first = first_round or completed_rounds(store) + 1
    report_id = ""
    for n in range(first, first + rounds):
        report_id, decision = run_round(store, n, p, stage)
        verdict = "promoted" if decision["promote"] else "kept out"
        log.info("round %d: candidate %s (%s)", n, verdict, decision["reason"])
    return report_id


StageCall = Callable[..., str]
"""`stage(name, /, **fields) -> artifact id`: runs stage `name` with its params built from `fields`."""


def plain_stage(store: ArtifactStore, p: RoundConfig) -> StageCall:
    """Stages as their plain library calls, no Prefect and no cache (the benchmarks' rounds)."""

    def stage(name: str, /, **fields: Any) -> str:
        return STAGES[name].work(STAGES[name].params(store_url=store.root_url, config=p, **fields)).id

    return stage


def run_round(store: ArtifactStore, n: int, p: RoundConfig, stage: StageCall) -> tuple[str, dict[str, Any]]:
    """Round n's stages in order (round 0's first: judge and mine the starting model); the report's id
    and the gate's decision. The one round body: the flow passes cached Prefect stages, the overhead
    benchmark the plain library calls."""

    def judge(round_no: int, model: str, who: str = "") -> list[str]:
        """The agentic held-out evaluation and the lm-eval benchmarks of `model` (`who`: `-champion`
        for the champion judged again beside the round's candidate)."""
        agentic = stage("evaluate", round_no=round_no, model=model, name=round_name(f"agentic{who}", round_no))
        return [agentic, stage("lm_eval", round_no=round_no, model=model, name=round_name(f"lm-eval{who}", round_no))]

    gate_r0 = f"gate/{round_name('gate', 0)}"
    if n == 1 and store.try_resolve(gate_r0) is None:  # Judge the starting model, so the gate has a bar.
        start = store.try_resolve("champion", f"model/{p.model}") or base_model(p.model, store).id
        stage("gate", round_no=0, evals=judge(0, start), candidate=start)
    if n == 1 and store.try_resolve(f"weaknesses/{round_name('weaknesses', 0)}") is None:  # Round 1's curriculum.
        stage("mine", round_no=0, evals=store.read_json(gate_r0, "decision.json")["candidate_evals"])
    start = round_inputs(store, n, p)
    plan, rl_mix = plan_round(start.curriculum, p, start.planned_with) if start.curriculum else (None, None)
    rollouts = stage("generate", round_no=n, tokenizer_model=start.base, plan=plan)
    dataset = stage("curate", round_no=n, rollouts=rollouts, carried=start.carried)
    steps = sft_steps(plan, p, carried_groups(store, start.carried))
    sft_ckpt = stage("sft", round_no=n, base=start.base, dataset=dataset, steps=steps)
    rl_ckpt = stage("rl", round_no=n, policy=sft_ckpt, task_mix=rl_mix)
    evals = judge(n, rl_ckpt)
    champion_evals = start.base_evals
    if not shares_items(store, evals, champion_evals):
        logger.info("round %d: the champion's evals share no item with the candidate's: judging it again", n)
        champion_evals = judge(n, start.base, "-champion")
    decision_id = stage(
        "gate", round_no=n, evals=evals, candidate=rl_ckpt, champion=start.base, champion_evals=champion_evals
    )
    decision = store.read_json(decision_id, "decision.json")
    # The next curriculum follows the model the next round starts from (and what the champion's own rollouts showed);
    # a kept-out candidate's evals say which slices the rollouts the next round carries have taught.
    mined = evals if decision["promote"] else champion_evals
    carried_evals = evals if carries(decision) else []
    stage("mine", round_no=n, evals=mined, previous=start.weaknesses, rollouts=rollouts, carried_evals=carried_evals)
    return stage("report", round_no=n, refs=round_refs(store, n)), decision


def plan_round(
    curriculum: dict[str, Any], p: RoundConfig, planned_with: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """A mined curriculum's generation plan and GRPO task mix: the ones mining stored, when it planned with
    what this round's config says (`planned_with`: its recorded spec); else planned with this round's
    budget and thresholds (the config changed between rounds; on a copy: planning annotates the slices)."""
    spec = work.curriculum_spec(p)
    if spec is not None and planned_with == json.loads(spec.model_dump_json()) and "generate" in curriculum:
        return curriculum["generate"], curriculum["rl"]
    slices = copy.deepcopy(curriculum["slices"])
    plan = plan_generation(slices, p.generate.groups, p.curriculum, p.max_agent_turns)
    return plan, grpo_mix(slices, p.curriculum)


def sft_steps(plan: dict[str, Any] | None, p: RoundConfig, carried: int = 0) -> int | None:
    """SFT steps for a plan larger than `generate.groups` (mastered slices' replay comes on top) or with
    `carried` groups of kept-out rounds: `sft.total_steps` scaled by the groups generated, so each row is
    seen as often as in a round of `groups` (the taught slices' script is learnt in ~2 epochs, garbled in
    under 1). No plan (a uniform curriculum): `groups` of its own. None: the config's."""
    own = p.generate.groups if plan is None else planned_groups(plan)
    generated, groups = own + carried, p.generate.groups
    return math.ceil(p.sft.total_steps * generated / groups) if generated > groups else None


def carries(decision: dict[str, Any]) -> bool:
    """Whether the next round carries a kept-out round's rollouts: its candidate was better, not surely so
    (no guard regressed). One kept out for a regression taught something harmful: nothing of it is kept."""
    regressed = any(guard.get("regressed") for guard in decision.get("guards", {}).values())
    return not decision["promote"] and decision.get("primary_delta", 0) > 0 and not regressed


def carried_groups(store: ArtifactStore, carried: list[str]) -> int:
    """The groups the carried rollouts artifacts wrote."""
    return sum(int(store.manifest(ref).metrics.get("groups_written", 0)) for ref in carried)


def planned_groups(plan: dict[str, Any] | None) -> int:
    """Every group a generation plan asks for, over its envs and sources."""
    return sum(part["groups"] for parts in (plan or {}).values() for part in parts.values())


def completed_rounds(store: ArtifactStore) -> int:
    """The last round with a report in the store (0: none)."""
    n = 0
    while store.try_resolve(f"report/{round_name('report', n + 1)}"):
        n += 1
    return n


def round_refs(store: ArtifactStore, n: int) -> list[str]:
    """What round n's report is built from (the flow and `flywheel report N` alike): the round's
    rollouts, SFT set, checkpoints, the candidate's evals, the mined weaknesses and the gate decision."""
    gate_id = store.try_resolve(f"gate/{round_name('gate', n)}")
    if gate_id is None:
        raise StoreError(f"round {n} has no gate decision in {store.url}: did it finish its gate stage?")
    decision = store.read_json(gate_id, "decision.json")
    kinds = (("rollouts", "rollouts"), ("dataset", "sft"), ("checkpoint", "sft"), ("weaknesses", "weaknesses"))
    made = tuple(f"{kind}/{round_name(what, n)}" for kind, what in kinds)
    found = {ref: store.try_resolve(ref) for ref in made}
    inputs = [found[ref] for ref in made[:3] if found[ref]]
    mined = [found[made[3]]] if found[made[3]] else []
    return [*inputs, decision["candidate"], *decision["candidate_evals"], *mined, gate_id]


class RoundInputs(NamedTuple):
    """What round n starts from, all read from round n-1's artifacts (so a re-run reads the same)."""

    base: str  # The champion after round n-1.
    base_evals: list[str]  # Its evals, as mined in round n-1: the bar the candidate must clear.
    weaknesses: str | None  # Round n-1's weaknesses artifact.
    curriculum: dict[str, Any] | None  # Its curriculum.json (None: none, or the round's is uniform).
    planned_with: dict[str, Any] | None  # The curriculum spec mining planned that curriculum with.
    carried: list[str]  # Rollouts of the kept-out rounds since the champion's, curated again in round n.


def round_inputs(store: ArtifactStore, n: int, p: RoundConfig) -> RoundInputs:
    """Round n's inputs from round n-1's gate decision and weaknesses artifact. A round n-1 kept out for
    want of confidence (`carries`) passes on the rollouts its SFT set was curated from (its own and those
    it carried): its candidate's learning goes into round n's SFT set instead of being generated again."""
    if n == 1:
        gate_id = store.resolve(f"gate/{round_name('gate', 0)}")
        weaknesses, made = store.try_resolve(f"weaknesses/{round_name('weaknesses', 0)}"), {}
    else:
        report = store.try_resolve(f"report/{round_name('report', n - 1)}")
        if report is None:
            raise ConfigError(f"cannot start round {n}: {store.url} has no report of round {n - 1}")
        made = {store.manifest(parent).kind: parent for parent in store.manifest(report).parents}
        gate_id, weaknesses = made["gate"], made.get("weaknesses")
    decision = store.read_json(gate_id, "decision.json")
    carried = []
    if carries(decision) and "dataset" in made:
        carried = [ref for ref in store.manifest(made["dataset"]).parents if store.manifest(ref).kind == "rollouts"]
    base = decision["candidate"] if decision["promote"] else decision["champion_before"]
    models = {m.id for m in lineage(store, base).walk() if m.kind == "model"}
    if store.try_resolve(f"model/{p.model}") not in models:
        raise ConfigError(
            f"the champion in {store.url} does not descend from model/{p.model}: "
            "use a separate --store for each base model"
        )
    mined = store.manifest(weaknesses) if weaknesses else None
    if mined is not None:
        candidate = set(mined.params.get("carried_evals", []))  # A kept-out candidate's, not the champion's.
        base_evals = [ref for ref in mined.parents if store.manifest(ref).kind == "eval" and ref not in candidate]
    else:  # A store from before rounds were mined: the evals the gate recorded.
        base_evals = decision["candidate_evals"] if decision["promote"] else recorded_evals(store, base)
    curriculum = stored_curriculum(store, mined.id) if mined is not None and p.curriculum.mode == "mined" else None
    planned_with = mined.params.get("curriculum") if mined is not None else None
    return RoundInputs(base, base_evals, weaknesses, curriculum, planned_with, carried)


@flow(name="eval", flow_run_name="eval-{model}")
def eval_only(
    model: str = "champion",
    store_url: str | None = None,
    profile: str = "default",
    config: RoundConfig | None = None,
) -> list[str]:
    """Agentic evaluation and lm-eval benchmarks of one model (a store ref such as `champion`, a built-in
    name or a local dir); returns both eval artifact ids."""
    p = config or load_round_config(profile)
    store = ArtifactStore(store_url)
    ref = model_ref_of(store, model) or model
    params = {"store_url": store_url, "round_no": 0, "config": p, "model": ref}
    return [
        evaluate(work.EvaluateParams(**params, name=f"eval-{model}")),
        lm_eval(work.LMEvalParams(**params, name=f"lm-eval-{model}")),
    ]
