"""The stage cache misses when it must: a changed parameter, input artifact or source file gives a
new key (hits are tested through Prefect in test_round.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from flywheel.flows import dispatch
from flywheel.flows.dispatch import code_digest, stage_cache_key
from flywheel.flows.round_config import load_round_config, profile
from flywheel.flows.work import MineParams, SFTParams


def key(stage: str, params: object) -> str:
    return stage_cache_key(None, {"stage": stage, "params": params})  # type: ignore[arg-type]


def sft(**changes: object) -> SFTParams:
    fields = {"store_url": "/store", "round_no": 1, "config": profile("tiny"), "base": "a" * 64, "dataset": "b" * 64}
    return SFTParams(**(fields | changes))


def test_equal_inputs_give_equal_keys() -> None:
    assert key("sft", sft()) == key("sft", sft())


def test_a_changed_parameter_misses() -> None:
    faster = load_round_config("tiny", overrides=["sft.learning_rate=5e-4"])
    assert key("sft", sft(config=faster)) != key("sft", sft())
    assert key("sft", sft(round_no=2)) != key("sft", sft())
    lenient = load_round_config("tiny", overrides=["curriculum.low=0.2"])
    mine = {"store_url": "/store", "evals": ["e" * 64]}
    assert key("mine", MineParams(**mine, config=lenient)) != key("mine", MineParams(**mine, config=profile("tiny")))


def test_a_changed_input_artifact_misses() -> None:
    assert key("sft", sft(dataset="c" * 64)) != key("sft", sft())
    assert key("sft", sft(base="d" * 64)) != key("sft", sft())


def test_a_changed_source_file_misses(tmp_path: Path, monkeypatch) -> None:
    tree = tmp_path / "checkout"
    shutil.copytree(dispatch.ROOT / "flows", tree / "flows")
    before = code_digest(tree)
    monkeypatch.setattr(dispatch, "code_digest", lambda: before)
    first = key("sft", sft())
    with open(tree / "flows" / "work.py", "a") as source:
        source.write("\n# an edit\n")
    code_digest.cache_clear()
    after = code_digest(tree)
    monkeypatch.setattr(dispatch, "code_digest", lambda: after)
    assert after != before and key("sft", sft()) != first
