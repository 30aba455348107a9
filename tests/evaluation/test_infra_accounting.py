"""Agentic evaluation leaves infra failures out of success rates, reports them per env, fails a run
above `max_infra_failure_rate`, and shows progress; the gate skips samples whose reward is None."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flywheel.data import ArtifactStore
from flywheel.environments.agent.policies import ScriptedPolicy
from flywheel.environments.tool_use_chain import ToolUseChainEnv
from flywheel.evaluation.agentic import AgenticEvalConfig, InfraFailureRateError, run_agentic_eval
from flywheel.evaluation.gate import paired_outcomes


class _Down:
    async def chat_completion(self, **kwargs: Any) -> Any:
        raise ConnectionError("connection refused")


@pytest.fixture
def one_task_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle plays every held-out task but the first, whose server is down."""
    first: list[str] = []

    def policy(self: ToolUseChainEnv, item: dict[str, Any]) -> Any:
        first.append(first[0] if first else item["item_id"])
        return _Down() if item["item_id"] == first[0] else ScriptedPolicy(item["oracle"])

    monkeypatch.setattr(ToolUseChainEnv, "oracle_policy", policy)


def _cfg(tiny_model: Path, **fields: Any) -> AgenticEvalConfig:
    return AgenticEvalConfig(
        envs=["tool_use_chain"], eval_size=4, base_url="http://127.0.0.1:9/v1", model_name="unused",
        tokenizer=str(tiny_model), teacher="oracle", **fields,
    )  # fmt: skip


def test_an_env_above_the_infra_threshold_fails_the_run_loudly(
    one_task_down: None, tiny_model: Path, tmp_path: Path
) -> None:
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(InfraFailureRateError) as raised:
        run_agentic_eval(_cfg(tiny_model), store)
    message = str(raised.value)
    assert "'tool_use_chain'" in message and "1 of 4 tasks" in message and "max_infra_failure_rate=5%" in message
    assert "connection refused" in message
    assert store.list("eval") == []  # No success rate to be misread.


def test_below_the_threshold_infra_failures_are_reported_per_env_and_left_out_of_rates(
    one_task_down: None, tiny_model: Path, tmp_path: Path
) -> None:
    store = ArtifactStore(tmp_path / "store")
    seen: list[tuple[str, int, int]] = []
    manifest = run_agentic_eval(_cfg(tiny_model, max_infra_failure_rate=0.3), store, progress=lambda *p: seen.append(p))
    assert seen == [("tool_use_chain", done, 4) for done in range(1, 5)]
    assert manifest.metrics["success_rate"] == 1.0 and manifest.metrics["tool_use_chain/infra_failures"] == 1
    results = store.read_json(manifest.id, "results.json")
    assert results["per_env"]["tool_use_chain"]["eval/infra_failure_rate"] == 0.25
    assert results["overall"]["n"] == 3 and results["overall"]["infra_failures"] == 1
    decided = paired_outcomes(store, manifest.id)  # The gate pairs only scored samples.
    assert len(decided["primary"]) == 3 and set(decided["primary"].values()) == {1.0}
    assert len(decided["env/tool_use_chain"]) == 3


def test_the_gate_skips_samples_whose_reward_is_none(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    samples = [
        {"env": "e", "item_id": "a", "reward": 1.0, "success": True},
        {"env": "e", "item_id": "b", "reward": None, "success": False, "infra_error": "timeout"},
    ]
    ref = store.put("eval", "agentic", {"samples/e.jsonl": "".join(json.dumps(s) + "\n" for s in samples)}).id
    assert paired_outcomes(store, ref) == {"primary": {"e:a": 1.0}, "env/e": {"e:a": 1.0}}
