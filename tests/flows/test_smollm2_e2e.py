"""End to end with the real model: GGUF -> HF checkpoint in the store -> `transformers serve` -> chat."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from tests.flows.test_cli import run


@pytest.mark.slow
def test_smollm2_is_converted_stored_served_and_answers(tmp_path: Path) -> None:
    store, cache = tmp_path / "store", tmp_path / "cache"
    env = {"FLYWHEEL_STORE": str(store), "FLYWHEEL_CACHE": str(cache)}

    prepared = run("model", "prepare", "smollm2", env=env)
    assert prepared.returncode == 0, prepared.stderr
    manifest = ArtifactStore(store).manifest("model/smollm2")
    assert manifest.metrics["num_parameters"] == pytest.approx(134.5e6, rel=0.01)
    assert manifest.params["gguf_sha256"] and "model.safetensors" in manifest.files

    answer = run("chat", "smollm2", "What is the capital of France?", "--max-tokens", "16", env=env)
    assert answer.returncode == 0, answer.stderr
    reply = answer.stdout.split("assistant:", 1)[1]
    assert "Paris" in reply
