"""Slow, real model: SmolLM2-135M on the shipped suite with the hf backend (CPU)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore
from flywheel.evaluation.lm_eval_runner import LMEvalConfig, run_lm_eval


@pytest.mark.slow
def test_smollm2_on_the_shipped_suite(model_store: ArtifactStore, smollm2_model: Path) -> None:
    store, model_dir = model_store, smollm2_model
    started = time.perf_counter()
    manifest = run_lm_eval(LMEvalConfig(suite_size=4, batch_size=4), store, model_dir, store.resolve("model/smollm2"))
    results = store.read_json(manifest.id, "results.json")["results"]
    print(
        f"SmolLM2 suite in {time.perf_counter() - started:.0f} s: "
        + ", ".join(f"{t}={v['acc,none']:.2f}" for t, v in sorted(results.items()))
    )
    assert set(results) == {"flywheel_tool_call", "flywheel_tool_select", "flywheel_reasoning"}
    assert all(0.0 <= values["acc,none"] <= 1.0 for values in results.values())
    assert all(len(store.read_bytes(manifest.id, f"samples/{t}.jsonl").decode().splitlines()) == 4 for t in results)
