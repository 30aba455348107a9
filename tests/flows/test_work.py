"""Stage work without Prefect: teachers for generation, the inputs a round starts from, lm-eval on CUDA."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings
from pydantic import ValidationError

from flywheel.data import ArtifactStore
from flywheel.data.columnar import read_rows
from flywheel.evaluation.lm_eval_runner import LMEvalConfig
from flywheel.flows import work
from flywheel.flows.flywheel import round_inputs
from flywheel.flows.round_config import GenerateSection, load_round_config, profile
from flywheel.flows.shards import shard_map
from flywheel.training.config import ConfigError
from flywheel.training.models import resolve_model
from tests.flows.conftest import task_runs


def test_the_served_policy_can_be_the_teacher(model_store: ArtifactStore, tiny_model, model_cache, monkeypatch) -> None:
    monkeypatch.setenv("FLYWHEEL_CACHE", str(model_cache))
    config = load_round_config("tiny", overrides=["generate.teacher=policy", "generate.groups=2"])
    base = model_store.resolve("model/tiny")
    manifest = work.generate(work.GenerateParams(store_url=model_store.url, config=config, tokenizer_model=base))
    assert manifest.params["teacher"] == ["server"] and manifest.params["model"]  # The served tiny model acted.
    groups = list(read_rows(model_store, manifest.id, "rollouts", "tool_use_chain-teacher"))
    assert len(groups) == 2 and all(len(group["scores"]) == 2 for group in groups)
    assert manifest.params["format"]["rows"] == "rollouts" and "tool_use_chain-teacher-00000.parquet" in manifest.files


def test_generation_and_curation_sharded_on_dask_make_the_same_sft_set(
    tmp_path: Path, tiny_model, model_cache, prefect_server: dict[str, str], monkeypatch
) -> None:
    """`data.runner: dask`: each part cut into shards of 2 groups, generated and screened as Prefect
    tasks on a local Dask cluster of 2 processes, merged by the store: the SFT set a stage in one
    process makes, row for row. A store of its own: the session's holds other tests' held-out sets,
    which the contamination check would screen these tasks against."""
    monkeypatch.setenv("FLYWHEEL_CACHE", str(model_cache))
    for key, value in prefect_server.items():  # The cluster's worker processes report to the same server.
        monkeypatch.setenv(key, value)
    model_store = ArtifactStore(tmp_path / "store")
    resolve_model("tiny", model_store, model_cache)
    base = model_store.resolve("model/tiny")
    made = {}
    for runner in ("process", "dask"):
        overrides = ["envs=[tool_use_chain,function_calling]", "generate.groups=6", f"data.runner={runner}"]
        config = load_round_config("tiny", overrides=[*overrides, "data.shard_groups=2"])
        common = {"store_url": model_store.url, "config": config, "round_no": 7}
        with temporary_settings(updates={PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
            rollouts = work.generate(
                work.GenerateParams(**common, tokenizer_model=base), shard_map(config.data, "generate")
            )
            curated = work.curate(work.CurateParams(**common, rollouts=rollouts.id), shard_map(config.data, "curate"))
            made[runner] = (rollouts, curated)
    (whole, sft), (sharded, sharded_sft) = made["process"], made["dask"]
    assert len(sharded.params["shards"]) == 4 and "shards" not in whole.params  # 3 groups an env: 2 + 1.
    assert list(read_rows(model_store, sharded_sft.id, "sft")) == list(read_rows(model_store, sft.id, "sft"))
    assert sft.metrics["sft_examples"] >= 4
    names = {run["name"] for run in task_runs(prefect_server, name={"like_": "-shard-"})}
    assert {f"{stage}-shard-{n}" for stage in ("generate", "curate") for n in range(4)} <= names  # In the UI.


def test_an_endpoint_teacher_needs_a_url_and_a_model() -> None:
    with pytest.raises(ValidationError, match="endpoint needs endpoint.base_url and endpoint.model_name"):
        GenerateSection(teacher="endpoint")
    with pytest.raises(ValidationError, match="endpoint.model_name"):
        GenerateSection(teacher="endpoint", endpoint={"base_url": "http://127.0.0.1:9/v1"})


def test_a_round_refuses_a_champion_from_another_base_model(tmp_path) -> None:
    store = ArtifactStore(tmp_path)
    other = store.put("model", "other", {"config.json": "{}"})
    decision = {"promote": True, "candidate": other.id, "champion_before": None, "candidate_evals": []}
    store.put("gate", "gate-r0", {"decision.json": json.dumps(decision)}, parents=[other.id])
    with pytest.raises(ConfigError, match="does not descend from model/tiny"):
        round_inputs(store, 1, profile("tiny"))


def test_round_two_needs_round_one(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no report of round 1"):
        round_inputs(ArtifactStore(tmp_path), 2, profile("tiny"))


def test_an_empty_sft_set_passes_the_base_on(tmp_path) -> None:
    """Every rollout of the round failed: SFT trains nothing, GRPO starts from the base."""
    store = ArtifactStore(tmp_path)
    base = store.put("model", "tiny", {"config.json": "{}"})
    empty = store.put("dataset", "sft-r1", {"train.jsonl": ""}, metrics={"sft_examples": 0})
    params = work.SFTParams(store_url=str(tmp_path), config=profile("tiny"), base=base.id, dataset=empty.id)
    assert work.sft(params).id == base.id


def test_an_sft_set_where_no_conversation_fits_passes_the_base_on(model_store: ArtifactStore, tiny_model) -> None:
    """Every curated conversation is longer than the round's `sft.max_length`: the round goes on from the base."""
    from tests.training.test_sft import TOOLS, conversation

    rows = "".join(json.dumps(conversation(2, 3) | {"tools": TOOLS}) + "\n" for _ in range(2)).encode()
    data = model_store.put("dataset", "sft-r1", {"train.jsonl": rows}, metrics={"sft_examples": 2})
    config = load_round_config("tiny", overrides=["sft.max_length=64"])
    base = model_store.resolve("model/tiny")
    params = work.SFTParams(store_url=model_store.url, config=config, base=base, dataset=data.id)
    assert work.sft(params).id == base


def test_lm_eval_on_cuda_runs_in_the_gpu_runtime(
    model_store: ArtifactStore, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM is not in Prefect's environment: on CUDA the stage runs lm-eval as a child of `FLYWHEEL_GPU_PYTHON`
    (here an interpreter that notes it ran, then runs this one, with the hf backend: vLLM needs a GPU)."""
    params = work.LMEvalParams(store_url=model_store.url, config=profile("tiny").model_copy(update={"device": "cuda"}),
                               round_no=1, model="model/tiny", name="lm-eval-r1")  # fmt: skip
    routed: list[str] = []
    monkeypatch.setattr(work, "lm_eval_in_gpu_runtime", lambda cfg, *_: routed.append(cfg.backend))
    work.lm_eval(params)
    assert routed == ["vllm"]
    monkeypatch.undo()
    runtime = tmp_path / "gpu-python"
    runtime.write_text(f'#!/bin/sh\necho ran >> {tmp_path / "ran"}\nexec {sys.executable} "$@"\n')
    runtime.chmod(0o755)
    monkeypatch.setenv("FLYWHEEL_GPU_PYTHON", str(runtime))
    cfg = LMEvalConfig(limit=2, suite_size=4, tasks=["flywheel_tool_select"], name="lm-eval-child")
    manifest = work.lm_eval_in_gpu_runtime(cfg, model_store, tiny_model, model_store.resolve("model/tiny"))
    assert (tmp_path / "ran").read_text() == "ran\n" and manifest.name == "lm-eval-child"
    assert model_store.read_json(manifest.id, "results.json")["results"]["flywheel_tool_select"]["acc,none"] >= 0
    assert model_store.resolve("model/tiny") in manifest.parents
