"""Train-eval parity: one policy, the same held-out tasks, greedy — GRPO's step-0 rollouts and the agentic
evaluation score every item alike (same loop, prompts, tools, parser, turn and token caps, verifier, reward).

The policy is scripted (the tiny random model cannot solve a task): it plays file_stats' oracle but
answers wrong when the true count is even, so outcomes differ across items. In GRPO it is
the trained model's `generate`; in evaluation a server behind the OpenAI API renders the same chat
template. Only the serving differs, which is what parity must not depend on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from flywheel.data import ArtifactStore
from flywheel.environments.agent.messages import messages_with_dict_arguments
from flywheel.environments.registry import env_class
from flywheel.evaluation.agentic import AgenticEvalConfig, run_agentic_eval
from flywheel.training.grpo import GRPORunConfig, grpo_args, policy_envs, task_prompt
from flywheel.training.rollouts import Task, agent_rollout_func, prompt_key
from flywheel.training.run_logs import RunDir
from tests.environments.conftest import chat_reply
from tests.training.test_grpo import _count_lines_like_the_oracle, _script_generation

TURNS, TURN_TOKENS, ITEMS = 4, 96, 6


def policy(conversation: str) -> str:
    """file_stats' oracle, except that it writes a wrong count when the true one is even."""
    reply = _count_lines_like_the_oracle(conversation)
    count = re.search(r'"content": "(\d+)"', reply)
    if count and int(count.group(1)) % 2 == 0:
        return reply.replace(f'"content": "{count.group(1)}"', f'"content": "{int(count.group(1)) + 1}"')
    return reply


def test_grpo_step0_rewards_equal_the_agentic_eval_item_by_item(
    model_store: ArtifactStore,
    tiny_model: Path,
    fake_openai,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model, padding_side="left")

    def serve(path: str, body: dict):  # type: ignore[no-untyped-def]
        text = tokenizer.apply_chat_template(messages_with_dict_arguments(body["messages"]), tools=body.get("tools"),
                                             tokenize=False, add_generation_prompt=True)  # fmt: skip
        return chat_reply(policy(text))

    cfg = AgenticEvalConfig(envs=["file_stats"], eval_size=ITEMS, base_url=fake_openai(serve), model_name="fake",
                            tokenizer=str(tiny_model), max_agent_turns=TURNS, max_token_length=TURN_TOKENS)  # fmt: skip
    evaluated = run_agentic_eval(cfg, model_store)
    samples = [json.loads(line) for line in
               model_store.read_bytes(evaluated.id, "samples/file_stats.jsonl").decode().splitlines()]  # fmt: skip
    by_eval = {s["item_id"]: (s["reward"], s["task_completed"]) for s in samples}

    run_cfg = GRPORunConfig(
        envs=["file_stats"], batch_size=2, num_rollouts_per_task=2, device="cpu", max_agent_turns=TURNS,
        max_token_length=TURN_TOKENS, max_completion_length=1024,
    )  # fmt: skip
    (env,) = policy_envs(run_cfg, [env_class("file_stats")(tokenizer_name=str(tiny_model), eval_size=ITEMS)],
                         tiny_model, tokenizer)  # fmt: skip
    tasks = {prompt_key(task_prompt(env, item)): Task(env, item) for item in env.eval_items}
    prompts = [task_prompt(env, item) for item in env.eval_items]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    _script_generation(model, tokenizer, policy)

    run = RunDir(tmp_path, "parity")
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                          args=grpo_args(run_cfg, str(run.checkpoints)), processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))  # fmt: skip
    out = agent_rollout_func(tasks, 0.0, run_cfg.max_completion_length)(prompts, trainer)
    by_grpo = {item["item_id"]: (reward, done) for item, reward, done in
               zip(env.eval_items, out["env_reward"], out["task_completed"], strict=True)}  # fmt: skip

    assert len(by_eval) == ITEMS and set(by_grpo) == set(by_eval)
    assert {done for _, done in by_eval.values()} == {True, False}  # Some items solved, some not: not a tie.
    assert by_grpo == by_eval
