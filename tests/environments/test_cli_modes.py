"""The three Atropos CLI modes of every env against a real `transformers serve` of the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flywheel.inference import ModelServer, ServerConfig, free_port

ROOT = Path(__file__).resolve().parents[2]
ENV_FILES = ["tool_use_chain", "web_navigation", "swe_bench", "long_horizon"]
# The stratified sample: every env runs one mode and every mode two envs (each a subprocess of
# ~25 s); the full cross product runs under `-m sweep`.
SAMPLED = {"process": ["tool_use_chain", "swe_bench"], "evaluate": ["web_navigation", "long_horizon"]}


def sampled(mode: str) -> list:
    return [name if name in SAMPLED[mode] else pytest.param(name, marks=pytest.mark.sweep) for name in ENV_FILES]


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Path) -> Iterator[ModelServer]:
    with ModelServer(ServerConfig(model=str(tiny_model))) as server:
        yield server


def _flags(server_url: str, model_name: str, tokenizer: Path, **env: object) -> list[str]:
    flags = [
        "--env.tokenizer_name", str(tokenizer), "--env.use_wandb", "false", "--env.max_token_length", "48",
        "--openai.base_url", server_url, "--openai.model_name", model_name, "--openai.server_type", "openai",
        "--openai.health_check", "false", "--openai.api_key", "local",
    ]  # fmt: skip
    for key, value in env.items():
        flags += [f"--env.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def _run(env_file: str, mode: str, flags: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(ROOT / "environments" / f"{env_file}.py"), mode, *flags]
    environ = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ, cwd=ROOT)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("env_file", sampled("process"))
def test_process_writes_scored_groups(
    env_file: str, tiny_server: ModelServer, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "groups.jsonl"
    flags = _flags(tiny_server.base_url, tiny_server.model_name, tiny_model, total_steps=2, group_size=2,
                   max_agent_turns=2, data_path_to_save_groups=out)  # fmt: skip
    result = _run(env_file, "process", flags)
    assert result.returncode == 0, result.stderr[-3000:]
    groups = _lines(out)
    assert len(groups) == 2
    for group in groups:
        assert len(group["tokens"]) == len(group["masks"]) == len(group["scores"]) == len(group["messages"]) == 2
        for tokens, masks in zip(group["tokens"], group["masks"], strict=True):
            assert len(tokens) == len(masks) and any(m != -100 for m in masks)
        assert all(0.0 <= s <= 1.0 for s in group["scores"])
        assert group["messages"][0][-1]["role"] in ("assistant", "tool")
        assert group["meta"]["env"] == env_file and group["meta"]["infra_failures"] == 0
    stats = json.loads(out.with_suffix(".stats.json").read_text())
    assert stats["groups_written"] == 2 and stats["infra_failures"] == 0


@pytest.mark.parametrize("env_file", sampled("evaluate"))
def test_evaluate_writes_metrics_and_samples(
    env_file: str, tiny_server: ModelServer, tiny_model: Path, tmp_path: Path
) -> None:
    flags = _flags(tiny_server.base_url, tiny_server.model_name, tiny_model, eval_size=2, max_agent_turns=2,
                   data_dir_to_save_evals=tmp_path)  # fmt: skip
    result = _run(env_file, "evaluate", flags)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())["results"]["all"]
    assert metrics["eval/n"] == 2 and 0.0 <= metrics["eval/success_rate"] <= 1.0
    samples = _lines(tmp_path / "samples.jsonl")
    assert len(samples) == 2 and all(s["messages"][-1]["role"] in ("assistant", "tool") for s in samples)
    assert all(s["category"] and s["difficulty"] for s in samples)


def test_process_resumes_after_a_kill(tiny_server: ModelServer, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "groups.jsonl"
    base = {"group_size": 1, "max_agent_turns": 1, "data_path_to_save_groups": out}
    server = (tiny_server.base_url, tiny_server.model_name, tiny_model)
    first = _run("tool_use_chain", "process", _flags(*server, total_steps=2, **base))
    assert first.returncode == 0, first.stderr[-2000:]
    kept = out.read_text().splitlines()[0]
    out.write_text(kept + "\n" + '{"tokens": [[1, 2')  # Killed halfway through writing group 2.
    second = _run("tool_use_chain", "process", _flags(*server, total_steps=3, **base))
    assert second.returncode == 0, second.stderr[-2000:]
    lines = out.read_text().splitlines()
    assert lines[0] == kept and len(lines) == 3
    ids = [json.loads(line)["meta"]["item_id"] for line in lines]
    assert sorted(ids) == [f"tool_use_chain-0-{i}" for i in range(3)]
    assert json.loads(out.with_suffix(".stats.json").read_text())["groups_skipped_as_done"] == 1


def test_inference_failure_is_an_infra_failure_not_a_zero(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "groups.jsonl"
    dead = f"http://127.0.0.1:{free_port()}/v1"
    flags = _flags(dead, "nobody", tiny_model, total_steps=2, group_size=2, max_agent_turns=2,
                   data_path_to_save_groups=out)  # fmt: skip
    result = _run("tool_use_chain", "process", flags)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not out.exists() or out.read_text() == ""  # Nothing scored 0 was written.
    stats = json.loads(out.with_suffix(".stats.json").read_text())
    assert stats["groups_written"] == 0 and stats["infra_failures"] == stats["rollouts"] == 4


def test_serve_registers_with_run_api(tiny_server: ModelServer, tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    api = subprocess.Popen(
        [str(Path(sys.executable).parent / "run-api"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    env_proc = None
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(f"{url}/status", timeout=2).status_code == 200)
        registration = {"wandb_group": "g", "wandb_project": "p", "batch_size": 2, "max_token_len": 4096,
                        "checkpoint_dir": str(tmp_path), "save_checkpoint_interval": 10, "starting_step": 0,
                        "num_steps": 5}  # fmt: skip
        assert httpx.post(f"{url}/register", json=registration, timeout=5).status_code == 200
        httpx.get(f"{url}/batch", timeout=5)  # The trainer starts polling: envs may register now.
        flags = _flags(
            tiny_server.base_url, tiny_server.model_name, tiny_model, group_size=2, max_agent_turns=1,
            rollout_server_url=url, ensure_scores_are_not_same=False, wandb_name="tool_use_chain",
            total_steps=5,
        )  # fmt: skip
        script = str(ROOT / "environments/tool_use_chain.py")
        env_proc = subprocess.Popen(
            [sys.executable, script, "serve", *flags, "--slurm", "false"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True,
            env={**os.environ, "WANDB_MODE": "disabled"},
        )  # fmt: skip
        _wait(lambda: len(httpx.get(f"{url}/latest_example", timeout=2).json().get("tokens") or []) > 0, 240)
        example = httpx.get(f"{url}/latest_example", timeout=2).json()
        assert len(example["tokens"]) == len(example["masks"]) == 2
    finally:
        for proc in (env_proc, api):
            if proc is not None:
                os.killpg(proc.pid, 9)
                proc.wait()


def _wait(predicate, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError("condition not met in time")
