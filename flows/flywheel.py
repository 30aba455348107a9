"""The flows users run: `flywheel` (N rounds of every stage) and `eval` (evaluate one model).

A round: generate (task mix from the last mining) -> curate -> SFT -> RL -> evaluate -> gate ->
mine -> report. Every stage goes through `run_stage`, so `dispatch="deployments"` sends it to its
work pool and a re-run skips what already finished.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from data import ArtifactStore, lineage
from evaluation.gate import recorded_evals, shares_items
from evaluation.lm_eval_runner import model_ref_of
from flows import work
from flows.dispatch import Dispatch, result_storage, run_stage
from flows.profiles import PROFILES, ProfileName, RoundProfile
from flows.stages import evaluate
from training.config import ConfigError
from training.models import base_model


@flow(name="flywheel", flow_run_name="flywheel-{profile}")
def flywheel(
    rounds: int = 1,
    profile: ProfileName = "default",
    store_url: str | None = None,
    dispatch: Dispatch = "local",
    sizes: RoundProfile | None = None,
    first_round: int | None = None,
) -> str:
    """Run `rounds` flywheel rounds; returns the last report's artifact id.

    Rounds continue after the last one with a report in the store (`first_round` overrides). A
    round's inputs come from the artifacts of the round before it (its gate decision and mined
    task mix), so running a round again, after a crash or on purpose, meets the same cache keys
    and skips every stage that already finished. `sizes` replaces the named profile's sizes.
    """
    log = get_run_logger()
    p = sizes or PROFILES[profile]
    store = ArtifactStore(store_url)
    cached_stage = run_stage.with_options(result_storage=result_storage(store))
    common = {"store_url": store.root_url, "profile": p}  # Absolute: cache keys must not depend on the cwd.

    def stage(stage_name: str, params: type[work.StageParams], /, **fields: Any) -> str:
        return cached_stage(stage_name, params(**common, **fields), dispatch)

    first = first_round or completed_rounds(store) + 1
    report_id = ""
    for n in range(first, first + rounds):
        if n == 1 and store.try_resolve("gate/gate-r0") is None:  # Judge the starting model, so the gate has a bar.
            start = store.try_resolve("champion", f"model/{p.model}") or base_model(p.model, store).id
            base_eval = stage("evaluate", work.EvaluateParams, round_no=0, model=start, name="agentic-base")
            stage("gate", work.GateParams, round_no=0, evals=[base_eval], candidate=start)
        base, mix = round_inputs(store, n, p)
        rollouts = stage("generate", work.GenerateParams, round_no=n, tokenizer_model=base, task_mix=mix)
        dataset = stage("curate", work.CurateParams, round_no=n, rollouts=rollouts)
        sft_ckpt = stage("sft", work.SFTParams, round_no=n, base=base, dataset=dataset)
        rl_ckpt = stage("rl", work.RLParams, round_no=n, policy=sft_ckpt)
        evals = [stage("evaluate", work.EvaluateParams, round_no=n, model=rl_ckpt, name=f"agentic-r{n}")]
        champion, rejudged = store.try_resolve("champion"), None
        if champion and not shares_items(store, evals, recorded_evals(store, champion)):
            log.info("round %d: the champion's evals share no item with the candidate's: judging it again", n)
            name = f"agentic-champion-r{n}"
            rejudged = [stage("evaluate", work.EvaluateParams, round_no=n, model=champion, name=name)]
        decision = stage("gate", work.GateParams, round_no=n, evals=evals, candidate=rl_ckpt, champion_evals=rejudged)
        weaknesses = stage("mine", work.MineParams, round_no=n, evals=evals)
        report_id = stage("report", work.ReportParams, round_no=n, refs=[*evals, weaknesses, decision])
        result = store.read_json(decision, "decision.json")
        log.info("round %d: candidate %s (%s)", n, "promoted" if result["promote"] else "kept out", result["reason"])
    return report_id


def completed_rounds(store: ArtifactStore) -> int:
    """The last round with a report in the store (0: none)."""
    n = 0
    while store.try_resolve(f"report/round-{n + 1}"):
        n += 1
    return n


def round_inputs(store: ArtifactStore, n: int, p: RoundProfile) -> tuple[str, dict[str, float] | None]:
    """Round n's base model (the champion after round n-1) and task mix (mined in round n-1)."""
    if n == 1:
        gate_id, mix = store.resolve("gate/gate-r0"), None
    else:
        report = store.try_resolve(f"report/round-{n - 1}")
        if report is None:
            raise ConfigError(f"cannot start round {n}: {store.url} has no report of round {n - 1}")
        parents = {store.manifest(parent).kind: parent for parent in store.manifest(report).parents}
        gate_id = parents["gate"]
        mix = store.read_json(parents["weaknesses"], "task_mix.json").get(p.env)
    decision = store.read_json(gate_id, "decision.json")
    base = decision["candidate"] if decision["promote"] else decision["champion_before"]
    models = {m.id for m in lineage(store, base).walk() if m.kind == "model"}
    if store.try_resolve(f"model/{p.model}") not in models:
        raise ConfigError(
            f"the champion in {store.url} does not descend from model/{p.model}: "
            "use a separate --store for each base model"
        )
    return base, mix


@flow(name="eval", flow_run_name="eval-{model}")
def eval_only(
    model: str = "champion",
    store_url: str | None = None,
    profile: ProfileName = "default",
    sizes: RoundProfile | None = None,
) -> str:
    """Agentic evaluation of one model (a store ref such as `champion`, a built-in name or a local dir)."""
    p = sizes or PROFILES[profile]
    store = ArtifactStore(store_url)
    ref = model_ref_of(store, model) or model
    return evaluate(work.EvaluateParams(store_url=store_url, round_no=0, profile=p, model=ref, name=f"eval-{model}"))
