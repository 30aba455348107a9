"""`STAGES` is the one record of a stage: one name for the stage, its flow and its work function, and a
new row is enough for the round's stage calls, the cache, the plan and deployments to know it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import Field

from flywheel.data import ArtifactStore, Manifest
from flywheel.flows.dispatch import run_stage, stage_cache_key
from flywheel.flows.flywheel import plain_stage
from flywheel.flows.plan import round_plan
from flywheel.flows.round_config import profile
from flywheel.flows.stages import STAGES, Stage, stage_flow
from flywheel.flows.work import StageParams, round_name


def test_a_stage_its_flow_and_its_work_share_one_name() -> None:
    for name, stage in STAGES.items():
        assert stage.name == name == stage.flow.name == stage.flow.fn.__name__ == stage.work.__name__, name
        assert stage.deployment == f"{name}/stage"


def test_a_stage_process_its_round_config_and_the_plan_load_no_trainer_or_env_library() -> None:
    """Every deployed stage is a process that imports the stage flows and validates its round config first: the
    gate, the report and curation never need torch, transformers, TRL or atroposlib (19 s of imports on 2
    cores, 5 without), nor does `flywheel plan`."""
    heavy = ("torch", "transformers", "trl", "atroposlib", "lm_eval", "deepspeed")
    probe = "import sys, flywheel.flows.stages, flywheel.flows.plan, flywheel.training.registry as r; "
    probe += "from flywheel.flows.round_config import load_round_config; load_round_config('default'); "
    probe += "[r.algorithm(a).config_class() for a in ('sft', 'grpo')]; "
    probe += f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]"]


class ToyParams(StageParams):
    text: str = Field(description="What the toy stage stores.")


def toy(params: ToyParams) -> Manifest:
    """The toy stage's work: one artifact, named as every round artifact is."""
    return params.store().put("toy", round_name("toy", params.round_no), {"text.txt": params.text})


def test_a_new_stage_runs_through_the_record(tmp_path: Path, monkeypatch) -> None:
    toy_flow = stage_flow("toy")(lambda params: toy(params).id)
    monkeypatch.setitem(STAGES, "toy", Stage("toy", ToyParams, toy_flow, toy))
    store, config = ArtifactStore(tmp_path), profile("tiny")

    made = plain_stage(store, config)("toy", round_no=2, text="plain")  # The round body's stage call.
    assert made == store.resolve("toy/toy-r2")
    params = ToyParams(store_url=store.root_url, config=config, round_no=3, text="flow")
    assert run_stage.fn("toy", params, "local") == store.resolve("toy/toy-r3")  # The orchestrated call.
    assert store.read_bytes("toy/toy-r3", "text.txt") == b"flow"

    key = stage_cache_key(None, {"stage": "toy", "params": params})  # type: ignore[arg-type]
    assert key != stage_cache_key(None, {"stage": "toy", "params": params.model_copy(update={"text": "x"})})  # type: ignore[arg-type]
    assert round_plan(config, "tiny")["stages"]["toy"] == {"pool": "cpu", "device": "cpu", "gpus": 0}
    assert STAGES["toy"].deployment == "toy/stage"
