"""GRPO through TRL's `use_vllm=True` colocate branch, on CPU: `tests/stand_ins/vllm` stands in for
vLLM's engine (the transformers model, vLLM's processed log-probs), everything else is real: TRL's
`VLLMGeneration` (weight sync, generation, log-prob extraction), its importance-sampling correction,
our `PolicyServer` batching the env loop's requests onto it, the env, its tools and verifier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.training.test_grpo import assert_trained_as_sampled

ROOT = Path(__file__).resolve().parents[2]
RUN = textwrap.dedent(
    """
    import asyncio, json, os, sys
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from pathlib import Path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer
    import vllm
    from flywheel.environments.registry import env_class
    from flywheel.training.grpo import GRPORunConfig, env_reward, grpo_args, task_dataset
    from flywheel.training.rollouts import agent_rollout_func
    from flywheel.training.run_logs import MetricsCallback, RunDir

    model_dir, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    env = env_class("file_stats")(tokenizer_name=model_dir)
    asyncio.run(env.setup())
    env.tokenizer = tokenizer
    cfg = GRPORunConfig(total_steps=steps, batch_size=2, num_rollouts_per_task=2, max_completion_length=200,
                        temperature=0.7, top_k=0, use_vllm=True, vllm_mode="colocate", warmup_ratio=0.0)
    run = RunDir(out, "vllm")
    dataset, tasks = task_dataset([env], 2 * steps)
    rollout = agent_rollout_func(tasks, cfg.temperature, cfg.max_completion_length)
    trained = []

    def recording(prompts, trainer):
        result = rollout(prompts, trainer)
        trained.append({k: result[k] for k in ("prompt_ids", "completion_ids", "env_mask", "logprobs", "retokenized")})
        return result

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=[env_reward(run, every=1)], args=grpo_args(cfg, str(run.checkpoints)), train_dataset=dataset,
        processing_class=tokenizer, rollout_func=recording, callbacks=[MetricsCallback(run)],
    )
    trainer.train()
    llm = trainer.vllm_generation.llm
    generated = [(g["prompt_ids"], g["token_ids"]) for g in vllm.GENERATED]
    result = {"trained": trained, "generated": generated, "loaded": llm.runner.loaded, "resets": llm.prefix_resets,
              "metrics": [m for m in run.read_metrics() if "reward" in m]}
    (out / "result.json").write_text(json.dumps(result))
    """
)


def colocated_grpo(tiny_model: Path, out: Path, steps: int, skew: float = 0.0) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "stand_ins")]),
        "VLLM_STAND_IN_SCRIPT": "tests.training.test_grpo:_count_lines_like_the_oracle",
        "VLLM_STAND_IN_SKEW": str(skew),
    }
    command = [sys.executable, "-c", RUN, str(tiny_model), str(out), str(steps)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def faithful(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return colocated_grpo(tiny_model, tmp_path_factory.mktemp("colocate"), steps=2)


def test_colocated_vllm_grpo_trains_on_what_vllm_sampled(faithful: dict) -> None:
    """Every rollout (three turns, two tool-result splices) trains on the engine's sampled ids, and the
    trainer's log-probs of them equal the engine's: the importance ratio is 1 up to float error."""
    assert len(faithful["metrics"]) == 2
    assert assert_trained_as_sampled(faithful["trained"], faithful["generated"]) == 4
    assert not any(flag for batch in faithful["trained"] for flag in batch["retokenized"])
    for step in faithful["metrics"]:
        assert step["sampling/sampling_logp_difference/max"] < 1e-4
        assert abs(step["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
    assert faithful["loaded"] > 0 and faithful["resets"] == 2  # The trainer's weights reached the engine each step.


def test_a_wrong_sampling_log_prob_moves_the_importance_ratio(tiny_model: Path, tmp_path: Path) -> None:
    """The engine reports every log-prob 0.5 too high: the correction sees it token by token, and TRL's
    default sequence-level mask drops every rollout (a ratio of exp(-0.5 x its tokens), far under 1/3)."""
    skewed = colocated_grpo(tiny_model, tmp_path, steps=1, skew=0.5)
    (step,) = skewed["metrics"]
    assert abs(step["sampling/sampling_logp_difference/mean"] - 0.5) < 1e-3
    assert step["sampling/importance_sampling_ratio/max"] < 1e-3


ATROPOS_RUN = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from pathlib import Path
    import vllm
    from flywheel.data import ArtifactStore
    from flywheel.training import atropos_mode
    from flywheel.training.grpo import GRPORunConfig, run_grpo

    trained, versions, make = [], [], atropos_mode.atropos_rollout_func

    def recording(*args, **kwargs):  # What the trainer took from run-api, as TRL gets it.
        rollout = make(*args, **kwargs)

        def record(prompts, trainer):
            out = rollout(prompts, trainer)
            trained.append({k: out[k] for k in ("prompt_ids", "completion_ids", "env_mask", "logprobs")})
            endpoint = trainer.vllm_generation.sync_weights.__self__  # TRL's load, made the endpoint's.
            versions.append([trainer.state.global_step, endpoint.version])
            return out

        return record

    atropos_mode.atropos_rollout_func = recording
    manifest = run_grpo(GRPORunConfig.model_validate_json(sys.argv[1]), ArtifactStore(sys.argv[2]))
    (engine,) = vllm.ENGINES
    result = {"trained": trained, "generated": vllm.GENERATED, "loaded": engine.runner.loaded,
              "resets": engine.prefix_resets, "metrics": manifest.metrics, "versions": versions}
    Path(sys.argv[3]).write_text(json.dumps(result))
    """
)


def test_atropos_mode_serves_the_trainers_vllm_engine_and_corrects_with_its_log_probs(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Atropos-mode GRPO with `use_vllm`: the policy endpoint serves TRL's colocated engine (the stand-in),
    an env worker's groups carry the engine's sampled ids and log-probs through run-api, and the trainer
    trains on exactly those ids with those log-probs in TRL's importance correction. TRL's per-step
    weight load reaches the engine and stamps the version; a step-1 group (sampled by the weights it
    trains) has log-probs that equal the trainer's."""
    from flywheel.training.grpo import GRPORunConfig

    cfg = GRPORunConfig(
        policy_model=str(tiny_model), total_steps=2, batch_size=2, gradient_accumulation_steps=2,
        num_rollouts_per_task=2, max_completion_length=160, num_tasks=4, logs_root=str(tmp_path / "logs"),
        output_name="rl-atropos-vllm", max_agent_turns=3, envs=["file_stats"], rl_mode="atropos", env_workers=1,
        max_async_level=1, drop_flat_groups=False, use_vllm=True, top_k=0, temperature=0.7, warmup_ratio=0.0,
    )  # fmt: skip
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "stand_ins")]),
        "VLLM_STAND_IN_SCRIPT": "tests.training.test_grpo:_count_lines_like_the_oracle",
    }
    out = tmp_path / "result.json"
    command = [sys.executable, "-c", ATROPOS_RUN, cfg.model_dump_json(), str(tmp_path / "store"), str(out)]
    done = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    fed = result["metrics"]["atropos"]
    assert result["metrics"]["steps"] == 2 and fed["groups_trained"] == 4 and fed["refused"].get("malformed", 0) == 0
    generated = [(g["prompt_ids"], g["token_ids"]) for g in result["generated"]]
    assert assert_trained_as_sampled(result["trained"], generated) == 8  # Every rollout: three turns, two splices.
    logprobs = {tuple(g["prompt_ids"]): g["logprobs"] for g in result["generated"]}
    for batch in result["trained"]:
        for prompt, completion, mask, trained in zip(
            batch["prompt_ids"], batch["completion_ids"], batch["env_mask"], batch["logprobs"], strict=True
        ):
            starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
            for start in starts:
                end = next((i for i in range(start, len(mask)) if not mask[i]), len(mask))
                assert trained[start:end] == logprobs[tuple(prompt + completion[:start])][: end - start]
    steps = [m for m in map(json.loads, next((tmp_path / "logs").glob("run-*/metrics.jsonl")).open()) if "reward" in m]
    assert steps[0]["sampling/sampling_logp_difference/max"] < 1e-4  # Version-0 groups, version-0 weights.
    assert all("sampling/importance_sampling_ratio/mean" in m for m in steps)
    assert result["loaded"] > 0 and result["resets"] == 2  # TRL's load before each step's generation,
    assert result["versions"] == [[0, 0], [1, 1]]  # which stamps the step's version on the endpoint.
