"""Stage work without Prefect: teachers for generation, and the inputs a round starts from."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from flywheel.data import ArtifactStore
from flywheel.flows import work
from flywheel.flows.flywheel import round_inputs
from flywheel.flows.round_config import GenerateSection, load_round_config, profile
from flywheel.training.config import ConfigError


def test_the_served_policy_can_be_the_teacher(model_store: ArtifactStore, tiny_model, model_cache, monkeypatch) -> None:
    monkeypatch.setenv("FLYWHEEL_CACHE", str(model_cache))
    config = load_round_config("tiny", overrides=["generate.teacher=policy", "generate.groups=2"])
    base = model_store.resolve("model/tiny")
    manifest = work.generate(work.GenerateParams(store_url=model_store.url, config=config, tokenizer_model=base))
    assert manifest.params["teacher"] == ["server"] and manifest.params["model"]  # The served tiny model acted.
    lines = model_store.read_bytes(manifest.id, "tool_use_chain-teacher.jsonl").decode().splitlines()
    assert len(lines) == 2 and all(len(json.loads(line)["scores"]) == 2 for line in lines)


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
