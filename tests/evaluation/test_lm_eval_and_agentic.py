"""lm-eval (hf backend and a real `transformers serve`), a user task folder via the CLI, and agentic
evaluation of the environments against a served model; everything lands in the store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore, lineage
from flywheel.environments.hermes_base_env import HermesAgentBaseEnv
from flywheel.evaluation.agentic import AgenticEvalConfig, run_agentic_eval
from flywheel.evaluation.lm_eval_runner import LMEvalConfig, model_args, run_lm_eval
from flywheel.evaluation.suite import suite_items
from flywheel.evaluation.tasks.utils import process_tool_call
from flywheel.inference import ModelServer, ServerConfig
from tests.flows.test_cli import run


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Path) -> Iterator[ModelServer]:
    with ModelServer(ServerConfig(model=str(tiny_model))) as server:
        yield server


def test_model_args_for_every_backend(tiny_model: Path) -> None:
    assert model_args(LMEvalConfig(), tiny_model)["pretrained"] == str(tiny_model)
    assert model_args(LMEvalConfig(backend="vllm", tensor_parallel_size=4), tiny_model)["tensor_parallel_size"] == 4
    chat = model_args(LMEvalConfig(backend="local-chat-completions", server_url="http://h:1/v1"), tiny_model)
    assert chat["base_url"] == "http://h:1/v1/chat/completions" and chat["tokenizer"] == str(tiny_model)
    with pytest.raises(ValueError, match="server_url"):
        model_args(LMEvalConfig(backend="local-completions"), tiny_model)


SEARCH = {
    "name": "search",
    "arguments": {"query": "red lamp", "department": "garden", "max_price": 40, "in_stock": True},
}


def _reply(*calls: dict[str, object]) -> str:
    return "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)


def _with(**arguments: object) -> dict[str, object]:
    return {"name": "search", "arguments": SEARCH["arguments"] | arguments}


@pytest.mark.parametrize(
    ("reply", "acc", "valid_call"),
    [
        (_reply(SEARCH), 1.0, 1.0),
        (_reply(_with(max_price=40.0)), 1.0, 1.0),  # 40.0 is 40: both JSON numbers.
        (_reply(_with(department="kitchen")), 0.0, 1.0),  # A wrong value.
        (_reply(_with(max_price="40")), 0.0, 1.0),  # The right value as a string.
        (_reply(_with(in_stock="true")), 0.0, 1.0),
        (_reply(_with(in_stock=1)), 0.0, 1.0),  # 1 is not true.
        (_reply(_with(sort="price_asc")), 0.0, 1.0),  # An extra argument.
        (_reply({"name": "search", "arguments": {"query": "red lamp"}}), 0.0, 1.0),  # Missing arguments.
        (_reply({"name": "open_url", "arguments": SEARCH["arguments"]}), 0.0, 1.0),  # Another tool.
        (_reply(SEARCH, SEARCH), 0.0, 0.0),  # Two calls.
        ('<tool_call>{"name": "search", "arguments": {"query": </tool_call>', 0.0, 0.0),  # Malformed.
        ("I would search for a red lamp.", 0.0, 0.0),  # No call.
    ],
)
def test_tool_call_scorer_is_strict(reply: str, acc: float, valid_call: float) -> None:
    doc = {"target": json.dumps(SEARCH)}
    assert process_tool_call(doc, [reply]) == {"acc": acc, "valid_call": valid_call}


def test_suite_tool_calls_are_typed_and_their_targets_score_1() -> None:
    items = suite_items(size=14)["flywheel_tool_call"]
    kinds = set()
    for item in items:
        target = json.loads(item["target"])
        assert process_tool_call(item, [_reply(target)])["acc"] == 1.0
        kinds |= {type(v) for v in target["arguments"].values()}
    assert kinds == {str, int, float, bool, list}
    assert {json.loads(i["target"])["name"] for i in items} >= {"read_file", "search", "submit_answer"}


def test_suite_on_hf_backend_lands_in_the_store(model_store: ArtifactStore, tiny_model: Path) -> None:
    # A local store: lm-eval artifacts in S3 are checked by the deployed round (tests/flows/test_deployments.py).
    store = model_store
    manifest = run_lm_eval(LMEvalConfig(limit=4, suite_size=6), store, tiny_model)
    results = store.read_json(manifest.id, "results.json")["results"]
    assert set(results) == {"flywheel_tool_call", "flywheel_tool_select", "flywheel_reasoning"}
    assert 0.0 <= results["flywheel_tool_select"]["acc,none"] <= 1.0
    samples = store.read_bytes(manifest.id, "samples/flywheel_tool_call.jsonl").decode().splitlines()
    first = json.loads(samples[0])
    assert len(samples) == 4 and first["category"].startswith("tool_call/") and first["difficulty"]
    assert [m.kind for m in lineage(store, manifest.id).walk()] == ["eval", "evalset"]


def test_suite_through_a_real_server_with_chat_completions(
    model_store: ArtifactStore, tiny_model: Path, tiny_server: ModelServer
) -> None:
    cfg = LMEvalConfig(
        backend="local-chat-completions",
        server_url=tiny_server.base_url,
        server_model=tiny_server.model_name,
        limit=3,
        suite_size=6,
        name="lm-eval-server",
    )
    manifest = run_lm_eval(cfg, model_store, tiny_model, model_store.resolve("model/tiny"))
    results = model_store.read_json(manifest.id, "results.json")["results"]
    assert set(results) == {"flywheel_tool_call", "flywheel_reasoning"}  # No log-likelihoods over chat.
    assert model_store.resolve("model/tiny") in manifest.parents


USER_TASK = """task: my_echo
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: '{{{{question}}}}'
doc_to_target: '{{{{answer}}}}'
generation_kwargs:
  until: ['<|im_end|>']
  max_gen_toks: 8
  do_sample: false
process_results: !function utils.score
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 2
"""
USER_UTILS = """def score(doc, results):
    return {"acc": float(doc["answer"] in results[0])}
"""


def test_user_task_folder_runs_via_the_cli(model_store: ArtifactStore, tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "my_tasks"
    folder.mkdir()
    data = folder / "echo.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say {w}.", "answer": w}) + "\n" for w in ("hi", "yo", "ok")))
    (folder / "my_echo.yaml").write_text(USER_TASK.format(data=data))
    (folder / "utils.py").write_text(USER_UTILS)
    result = run(
        "--store",
        model_store.url,
        "eval",
        "--model",
        "tiny",
        "--tasks",
        "my_echo",
        "--include-path",
        str(folder),
        "--limit",
        "3",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "my_echo" in result.stdout and "acc" in result.stdout
    evals = [m for m in model_store.list("eval") if m.params.get("tasks") == ["my_echo"]]
    assert evals and model_store.read_json(evals[-1].id, "results.json")["versions"]["my_echo"] == 2


def test_unknown_task_is_a_one_line_error(model_store: ArtifactStore, tiny_model: Path, tmp_path: Path) -> None:
    from tests.flows.test_cli import assert_one_line_error

    result = run(
        "--store",
        model_store.url,
        "eval",
        "--model",
        "tiny",
        "--tasks",
        "no_such_task",
        "--include-path",
        str(tmp_path),
    )
    assert_one_line_error(result, "unknown lm-eval task(s) ['no_such_task']")


def test_agentic_eval_of_the_envs_against_a_served_model(
    model_store: ArtifactStore, tiny_model: Path, tiny_server: ModelServer
) -> None:
    cfg = AgenticEvalConfig(
        envs=["tool_use_chain", "web_navigation"],
        eval_size=2,
        max_agent_turns=2,
        max_token_length=32,
        base_url=tiny_server.base_url,
        model_name=tiny_server.model_name,
        tokenizer=str(tiny_model),
    )
    manifest = run_agentic_eval(cfg, model_store, model_store.resolve("model/tiny"))
    results = model_store.read_json(manifest.id, "results.json")
    assert set(results["per_env"]) == {"tool_use_chain", "web_navigation"}
    assert results["overall"]["n"] == 4 and results["overall"]["success_rate"] == 0.0  # A random model fails.
    assert all(key.count("/") == 2 for key in results["per_slice"])
    sample = json.loads(model_store.read_bytes(manifest.id, "samples/web_navigation.jsonl").decode().splitlines()[0])
    assert sample["messages"][0]["role"] == "system" and "turns_used" in sample
    evalset = model_store.manifest("evalset/agentic")
    assert evalset.id in manifest.parents and "tool_use_chain.jsonl" in evalset.files


def test_oracle_ceiling_scores_everything(
    model_store: ArtifactStore, tiny_model: Path, tiny_server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = AgenticEvalConfig(
        envs=["tool_use_chain", "web_navigation"],
        eval_size=3,
        base_url=tiny_server.base_url,
        model_name=tiny_server.model_name,
        tokenizer=str(tiny_model),
        teacher="oracle",
        name="agentic-oracle",
    )
    in_flight: list[str] = []
    overlapping: set[str] = set()  # Envs seen with a rollout in flight while another env had one.
    run_agent = HermesAgentBaseEnv.run_agent

    async def tracked(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if set(in_flight) - {self.name}:
            overlapping.update([*in_flight, self.name])
        in_flight.append(self.name)
        try:
            return await run_agent(self, *args, **kwargs)
        finally:
            in_flight.remove(self.name)

    monkeypatch.setattr(HermesAgentBaseEnv, "run_agent", tracked)
    manifest = run_agentic_eval(cfg, model_store)
    assert manifest.metrics["success_rate"] == 1.0 and manifest.metrics["n"] == 6
    assert overlapping == {"tool_use_chain", "web_navigation"}  # The envs run at once (the server batches both).
