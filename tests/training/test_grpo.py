"""GRPO with TRL on the tiny model: a toy reward improves; one step runs the env's tool loop."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from data import ArtifactStore
from training.config import ConfigError, RunnerConfig, load_config
from training.grpo import (
    RewardDistributionWarning,
    env_reward,
    grpo_args,
    load_env,
    task_dataset,
    tool_env_class,
)
from training.run_logs import MetricsCallback, NonFiniteGuard, RunDir

os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"


def test_config_validation_reports_every_problem(tmp_path: Path) -> None:
    path = tmp_path / "rl.yaml"
    path.write_text("kl_beta: 0.001\nbatch_size: 3\nnum_rollouts_per_task: 2\nenvs: [atari]\n")
    with pytest.raises(ConfigError) as err:
        load_config(RunnerConfig, path)
    message = str(err.value)
    assert "kl_beta=0.001 is below 0.01; raise it or set allow_low_kl=true" in message
    assert "batch_size=3 must be a multiple" in message and "unknown envs ['atari']" in message
    cfg = load_config(RunnerConfig, path, ["allow_low_kl=true", "batch_size=4", "envs=[swe_bench]"])
    assert cfg.kl_beta == 0.001 and cfg.envs == ["swe_bench"]
    with pytest.raises(ConfigError, match="unknown field"):
        load_config(RunnerConfig, None, ["learning_rat=1"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(RunnerConfig, None, ["oops"])


def test_grpo_improves_a_toy_reward(tiny_model: Path, tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    prompt = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "Say something."}]
    ids = torch.tensor([tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)])
    with torch.no_grad():  # The token the untrained model samples most often becomes the target.
        samples = model.generate(ids.repeat(16, 1), do_sample=True, top_k=10, max_new_tokens=16, pad_token_id=2)
    target = int(torch.mode(samples[:, ids.shape[1] :].flatten()).values)

    def toy_reward(completion_ids, **_):  # type: ignore[no-untyped-def]
        return [sum(t == target for t in c) / max(1, len(c)) for c in completion_ids]

    cfg = RunnerConfig(
        total_steps=10,
        batch_size=8,
        num_rollouts_per_task=8,
        learning_rate=1e-2,
        max_completion_length=16,
        kl_beta=0.01,
        warmup_ratio=0.0,
    )
    run = RunDir(tmp_path, "toy")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[toy_reward],
        args=grpo_args(cfg, str(run.checkpoints)),
        train_dataset=Dataset.from_list([{"prompt": prompt}] * 80),
        processing_class=tokenizer,
        callbacks=[MetricsCallback(run), NonFiniteGuard()],
    )
    trainer.train()
    rewards = [m["reward"] for m in run.read_metrics() if "reward" in m]
    assert len(rewards) == 10
    assert sum(rewards[-3:]) / 3 > 2 * sum(rewards[:3]) / 3, rewards
    assert any(m.get("kl", 0) > 0 for m in run.read_metrics())  # beta > 0: the KL term is live.


def _script_generation(model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Make `generate` call list_files first and answer once a tool response is in the context.

    The tiny random model cannot write a valid tool call; scripting only its sampling keeps the rest
    real (TRL's tool loop, our env's tools and verifier, log-probs from the model's forward pass).
    """
    call = '<tool_call>\n{"name": "list_files", "arguments": {"path": "."}}\n</tool_call><|im_end|>'
    call_ids = tokenizer.encode(call, add_special_tokens=False)
    done_ids = tokenizer.encode("Done.<|im_end|>", add_special_tokens=False)

    def generate(input_ids, attention_mask=None, **_):  # type: ignore[no-untyped-def]
        tails = [done_ids if "<tool_response>" in tokenizer.decode(row) else call_ids for row in input_ids]
        width = max(len(t) for t in tails)
        padded = [t + [tokenizer.pad_token_id] * (width - len(t)) for t in tails]
        return torch.cat([input_ids, torch.tensor(padded, dtype=input_ids.dtype)], dim=1)

    model.generate = generate


def test_one_grpo_step_runs_the_env_tool_loop(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    env = load_env("tool_use_chain", tokenizer_name=str(tiny_model), difficulty="easy")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    _script_generation(model, tokenizer)
    calls: list[str] = []

    class Spy(tool_env_class(env)):
        def list_files(self, path: str = ".") -> str:
            """List the files under a folder of the workspace, recursively.

            Args:
                path: Folder relative to the workspace.
            """
            calls.append(path)
            return super().list_files(path)

    cfg = RunnerConfig(
        total_steps=1,
        batch_size=2,
        num_rollouts_per_task=2,
        max_completion_length=96,
        max_tool_calls=2,
        temperature=0.7,
    )
    run = RunDir(tmp_path, "env")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[env_reward(run, every=1)],
        args=grpo_args(cfg, str(run.checkpoints)),
        train_dataset=task_dataset(env, 4),
        processing_class=tokenizer,
        environment_factory=lambda: Spy(env),
        callbacks=[MetricsCallback(run), RewardDistributionWarning()],
    )
    trainer.train()
    logged = next(m for m in run.read_metrics() if "reward" in m)
    assert calls == [".", "."] and logged["tools/call_frequency"] > 0
    assert logged["reward"] == 0.0  # Listing files alone does not solve the task: the verifier says so.
    samples = [json.loads(line) for line in next(run.rollouts.glob("*.jsonl")).read_text().splitlines()]
    assert len(samples) == 2
    roles = [m["role"] for m in samples[0]["completion"]]
    assert roles == ["assistant", "tool", "assistant"] and "src/" in samples[0]["completion"][1]["content"]


def test_run_grpo_stores_a_checkpoint_with_lineage(
    model_store: ArtifactStore, tiny_model: Path, tmp_path: Path
) -> None:
    from training.grpo import run_grpo

    cfg = RunnerConfig(
        total_steps=1,
        batch_size=2,
        num_rollouts_per_task=2,
        max_completion_length=24,
        num_tasks=2,
        logs_root=str(tmp_path),
        output_name="rl-test",
        difficulty="easy",
        max_tool_calls=1,
    )
    manifest = run_grpo(cfg, model_store)
    assert manifest.kind == "checkpoint" and manifest.metrics["steps"] == 1
    assert manifest.parents == [model_store.resolve("model/tiny")]
    assert manifest.params["kl_beta"] == 0.04
    run_dir = next(tmp_path.glob("run-*"))
    assert (run_dir / "metrics.jsonl").exists() and any((run_dir / "rollouts").iterdir())


def test_grpo_vllm_generation_server_command(tiny_model: Path) -> None:
    from inference import ServerConfig, build_command
    from training.grpo import GRPO_VLLM_SERVER_ARGS, GRPO_VLLM_SERVER_ENV

    config = ServerConfig(model=str(tiny_model), backend="vllm", tool_call_parser=None, tensor_parallel_size=2,
                          extra_args=GRPO_VLLM_SERVER_ARGS, env=GRPO_VLLM_SERVER_ENV)  # fmt: skip
    command = build_command(config, 8000)
    assert command[:2] == ["vllm", "serve"] and "--enable-auto-tool-choice" not in command
    assert command[-6:] == GRPO_VLLM_SERVER_ARGS and config.env == {"VLLM_SERVER_DEV_MODE": "1"}
    from training.grpo import grpo_kwargs

    args = grpo_kwargs(RunnerConfig(profile="h100", use_vllm=True, vllm_mode="server",
                                  vllm_server_base_url="http://127.0.0.1:8000"), "/tmp/x")  # fmt: skip
    assert args["use_vllm"] and args["vllm_mode"] == "server" and args["bf16"] and "use_cpu" not in args
    assert args["vllm_server_base_url"] == "http://127.0.0.1:8000" and args["beta"] == 0.04


def test_the_rollout_tools_are_the_envs_own_tools(tiny_model: Path) -> None:
    """GRPO's tool env offers what the agent loop offers: the web env's browser, not the shell."""
    from transformers.utils import get_json_schema

    env = load_env("web_navigation", tokenizer_name=str(tiny_model), difficulty="easy", categories=["lookup_price"])
    try:
        tools = tool_env_class(env)(env)
        assert {"open_url", "follow_link", "search", "submit_form"} <= set(dir(tools))
        assert not hasattr(tools, "terminal") and not hasattr(tools, "write_file")
        schema = get_json_schema(tools.open_url)["function"]  # What TRL shows the model.
        assert schema["name"] == "open_url" and schema["parameters"]["required"] == ["url"]
        assert "Absolute URL" in schema["parameters"]["properties"]["url"]["description"]
        tools.reset(task_index=0)
        item = env.stream.item(0)
        home = tools.open_url(url=env.format_prompt(item).split("home page is ")[1].split()[0])
        assert home.startswith("URL: http://127.0.0.1") and "search" in home
        found = tools.search(query=item["answer"]["ids"][0])
        assert "Error" not in found
        assert tools.follow_link(text="no such link").startswith("Error: follow_link")
        assert tools._verify([{"role": "assistant", "content": "no idea"}]) == 0.0
    finally:
        asyncio.run(env.close())
