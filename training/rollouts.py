"""GRPO rollouts through each env's own agent loop: train on the loop the model is judged by.

TRL's `rollout_func` hook hands us the batch's prompts; every prompt is one rollout of its task,
run by the env's `run_agent` (the same `HermesAgentLoop`, tools, sandbox, parser and verifier
as `process` mode and evaluation) with `PolicyServer` standing in for the inference server: it
generates with the policy being trained (in-process on CPU, TRL's vLLM engine on CUDA), each
reply capped by the env's per-turn `max_token_length` and the run's `max_completion_length`.
The conversation is tokenised with the env's own `tokenize_conversation`; its first assistant
token starts the completion, and `env_mask` keeps only the model's tokens in the loss (tool
results and user turns are context). The env's reward goes to the reward function as
`env_reward`; an infra failure scores `None` (TRL drops it from the group's statistics), not 0.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from environments.hermes_base_env import HermesAgentBaseEnv
from environments.messages import messages_with_dict_arguments


class PolicyServer:
    """The policy under training as atroposlib's `chat_completion` surface.

    It generates in-process with `model()` (the current weights), or with TRL's vLLM engine when
    `vllm` is given (TRL pushes the trainer's weights into it before each step's rollouts).
    """

    def __init__(
        self, model: Callable[[], Any], tokenizer: Any, top_k: int, max_new_tokens: int, vllm: Any = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens
        self.vllm = vllm
        self._lock = threading.Lock()  # One generate at a time: they share the model.

    @classmethod
    def of_trainer(cls, trainer: Any, max_new_tokens: int) -> PolicyServer:
        """The policy a TRL trainer is training (its vLLM engine when the trainer uses one)."""
        return cls(
            lambda: trainer.accelerator.unwrap_model(trainer.model),
            trainer.processing_class,
            trainer.args.top_k,
            max_new_tokens,
            vllm=trainer.vllm_generation if getattr(trainer, "use_vllm", False) else None,
        )

    async def chat_completion(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        return await asyncio.to_thread(self._generate, messages, kwargs)

    def _generate(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> Any:
        prompt = self.tokenizer.apply_chat_template(
            messages_with_dict_arguments(messages), tools=kwargs.get("tools") or None,
            tokenize=False, add_generation_prompt=True,
        )  # fmt: skip
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        max_new = min(int(kwargs.get("max_tokens") or self.max_new_tokens), self.max_new_tokens)
        with self._lock:
            if self.vllm is not None:
                new = list(self.vllm.generate([prompt_ids], None, 1)[1][0])[:max_new]
            else:
                new = self._generate_in_process(prompt_ids, float(kwargs.get("temperature", 1.0)), max_new)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        message = SimpleNamespace(role="assistant", content=text, tool_calls=None)
        usage = SimpleNamespace(prompt_tokens=len(prompt_ids), completion_tokens=len(new))
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")], usage=usage)

    def _generate_in_process(self, prompt_ids: list[int], temperature: float, max_new: int) -> list[int]:
        import torch

        model = self.model()
        inputs = torch.tensor([prompt_ids], device=model.device)
        with torch.no_grad():
            output = model.generate(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_k=self.top_k or None,
                max_new_tokens=max_new,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        return output[0, inputs.shape[1] :].tolist()


@dataclass
class Task:
    """One training prompt: the env that runs it and its item."""

    env: HermesAgentBaseEnv
    item: dict[str, Any]


def prompt_key(prompt: list[dict[str, Any]]) -> str:
    """How a dataset prompt finds its task again (TRL passes rollout_func the prompts only)."""
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def agent_rollout_func(tasks: dict[str, Task], temperature: float, max_completion_length: int) -> Any:
    """TRL `rollout_func(prompts, trainer)`: one env-loop rollout per prompt (see module docstring)."""

    def rollout(prompts: list[list[dict[str, Any]]], trainer: Any) -> dict[str, list[Any]]:
        server = PolicyServer.of_trainer(trainer, max_completion_length)
        batch = [tasks[prompt_key(prompt)] for prompt in prompts]
        outcomes = asyncio.run(_run_all(batch, server, temperature))
        out: dict[str, Any] = {k: [] for k in ("prompt_ids", "completion_ids", "env_mask")}
        out |= {"env_reward": [], "task_completed": [], "turns_used": []}
        for task, (result, reward) in zip(batch, outcomes, strict=True):
            schemas, _ = task.env._resolve_tools_for_group()
            messages = result.messages if result.messages else task.env.build_messages(task.item, schemas)
            tokens, masks = task.env.tokenize_conversation(messages, schemas)
            start = next((i for i, m in enumerate(masks) if m != -100), len(tokens))
            completion = tokens[start:][:max_completion_length] or [trainer.processing_class.eos_token_id]
            mask = [int(m != -100) for m in masks[start:][:max_completion_length]] or [0]
            out["prompt_ids"].append(tokens[:start])
            out["completion_ids"].append(completion)
            out["env_mask"].append(mask)
            out["env_reward"].append(reward)
            out["task_completed"].append(result.task_completed)
            out["turns_used"].append(result.turns_used)
        out["logprobs"] = None  # Recomputed by the trainer from the policy.
        return out

    return rollout


async def _run_all(batch: list[Task], server: PolicyServer, temperature: float) -> list[tuple[Any, float | None]]:
    """Every rollout of the batch, concurrently (generation itself takes turns on the model)."""

    async def one(task: Task) -> tuple[Any, float | None]:
        task.env.server = server
        return await task.env.run_agent(task.item, temperature)

    return await asyncio.gather(*(one(task) for task in batch))
