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
import copy
import gc
import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from flywheel.data.costs import return_free_heap
from flywheel.environments.agent.messages import messages_with_dict_arguments
from flywheel.environments.hermes_base_env import HermesAgentBaseEnv


@dataclass
class _Request:
    """One reply to generate on vLLM; `new` is filled by whichever thread serves its batch."""

    prompt_ids: list[int]
    temperature: float
    max_new: int
    new: list[int] | None = None
    error: BaseException | None = None


# In-process generation uses transformers' continuous batching (the engine `transformers serve` runs):
# tokens per forward pass as the CPU server is configured (benchmarks/serve_throughput.py), and 64-token
# cache pages so that shared prefixes (an env's tool schemas, the earlier turns of a conversation) are
# read from the cache rather than recomputed. The pool is 4 % of available RAM (~0.75 GB on 24 GB): a
# GRPO step has few rollouts in flight (8 on the default profile, ~2k tokens each: ~0.75 GB of
# SmolLM2's fp32 keys and values), where the server holds an evaluation's 40; the pool's pages are resident
# beside the optimizer's state (at 15 %, screening round 3's tasks added 2.6 GB, and step 2's
# generation took GRPO to its peak).
PAGED_BATCH_TOKENS = 1024
PAGED_MEMORY_SHARE = 0.04
PAGE_TOKENS = 64


class PolicyServer:
    """The policy under training as atroposlib's `chat_completion` surface.

    In-process it generates with transformers' continuous batching on the current weights: no
    padding, memory bounded by the tokens of one forward pass and a fixed cache pool, and a turn
    re-reads its conversation's earlier turns from the paged cache. With `vllm` (TRL's engine on
    CUDA, which gets the trainer's weights before each step's rollouts) concurrent requests are
    generated together: the thread that gets the engine next serves every request waiting.
    Use it as a context manager (or `close()` it): closing stops the generation thread and puts
    the model back in the mode it was in.
    """

    def __init__(
        self, model: Callable[[], Any], tokenizer: Any, top_k: int, max_new_tokens: int, vllm: Any = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens
        self.vllm = vllm
        self._model_lock = threading.Lock()  # One vLLM generate at a time.
        self._queue_lock = threading.Lock()
        self._queue: list[_Request] = []
        self._managers: dict[float, Any] = {}  # Temperature -> continuous-batching manager.
        self._was_training: bool | None = None
        self._autocast_forward: Any = None  # Accelerate's bf16 wrapper of `forward`, lifted while generating.
        self._stops: set[int] = set()  # End-of-reply token ids, found when the first manager starts.

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

    def __enter__(self) -> PolicyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the generation threads and restore the model's train/eval mode."""
        managers, self._managers = list(self._managers.values()), {}
        for manager in managers:
            manager.stop(block=True)
            manager.destroy()
        if managers:  # Their paged KV caches are garbage now: hand the pages back before training allocates.
            managers.clear()
            del manager
            gc.collect()
            return_free_heap()
        if self._was_training is not None:
            self.model().train(self._was_training)
            self._was_training = None
        if self._autocast_forward is not None:
            self.model().forward, self._autocast_forward = self._autocast_forward, None

    async def chat_completion(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        prompt = self.tokenizer.apply_chat_template(
            messages_with_dict_arguments(messages), tools=kwargs.get("tools") or None,
            tokenize=False, add_generation_prompt=True,
        )  # fmt: skip
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        max_new = min(int(kwargs.get("max_tokens") or self.max_new_tokens), self.max_new_tokens)
        temperature = float(kwargs.get("temperature", 1.0))
        if self.vllm is not None:
            new = await asyncio.to_thread(self._generate_on_vllm, _Request(prompt_ids, temperature, max_new))
        else:
            new = await self._generate_paged(prompt_ids, temperature, max_new)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        message = SimpleNamespace(role="assistant", content=text, tool_calls=None)
        usage = SimpleNamespace(prompt_tokens=len(prompt_ids), completion_tokens=len(new))
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")], usage=usage)

    async def _generate_paged(self, prompt_ids: list[int], temperature: float, max_new: int) -> list[int]:
        """One reply from the continuous-batching manager, ending at its first end-of-sequence token."""
        manager = self._manager(temperature)
        finished: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def deliver(output: Any) -> None:
            if output.is_finished() and not finished.done():
                finished.set_result(output)

        request_id = uuid.uuid4().hex
        manager.register_result_handler(request_id, deliver)  # Before the request: its result cannot come first.
        if manager.add_request(prompt_ids, request_id=request_id, max_new_tokens=max_new) is None:
            raise RuntimeError("the policy's generation loop refused the request (stopped)")
        try:
            output = await finished
        except asyncio.CancelledError:
            manager.cancel_request(request_id)  # A cancelled rollout's reply is not generated on.
            raise
        if output.error is not None:
            raise RuntimeError(f"policy generation failed: {output.error}")
        return _up_to_first(list(output.generated_tokens)[:max_new], self._stops)

    def _manager(self, temperature: float) -> Any:
        """The continuous-batching manager sampling at `temperature`, started on first use."""
        if temperature in self._managers:
            return self._managers[temperature]
        import torch
        from transformers import ContinuousBatchingConfig

        from flywheel.inference.varlen_sdpa import use_varlen_sdpa

        model = self.model()
        if self._was_training is None:
            self._was_training = model.training
        if self._autocast_forward is None and "_original_forward" in model.__dict__:
            # Under mixed precision, accelerate wraps `forward` in bf16 autocast, which would write bf16 keys
            # into the fp32 paged cache: generation runs in fp32, as the model server does.
            self._autocast_forward, model.forward = model.forward, model._original_forward
        self._stops = self._stops or _eos_ids(model, self.tokenizer)
        use_varlen_sdpa()  # Each rollout of a step attends over its own cached turns, not every rollout's.
        config = copy.deepcopy(model.generation_config)
        config.update(max_new_tokens=self.max_new_tokens, eos_token_id=sorted(self._stops))
        if temperature > 0:
            config.update(do_sample=True, temperature=temperature, top_k=self.top_k or None)
        else:
            config.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        paging = ContinuousBatchingConfig(
            page_size=PAGE_TOKENS, max_batch_tokens=PAGED_BATCH_TOKENS, max_memory_percent=PAGED_MEMORY_SHARE
        )
        # The last training step's activations sit freed, and fragmented, in the allocator (tcmalloc keeps
        # them): the pool's large tensors would be mapped beside them, so hand them back first.
        return_free_heap()
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=paging)
        with torch.inference_mode():  # The generation thread runs in the mode it was started in.
            manager.start()
        self._managers[temperature] = manager
        return manager

    def _generate_on_vllm(self, request: _Request) -> list[int]:
        with self._queue_lock:
            self._queue.append(request)
        with self._model_lock:
            if request.new is None and request.error is None:  # Not served yet: serve every request waiting.
                with self._queue_lock:
                    waiting, self._queue = self._queue, []
                self._serve_on_vllm(waiting)
        if request.error is not None:
            raise request.error
        return request.new or []

    def _serve_on_vllm(self, requests: list[_Request]) -> None:
        """Generate every request, one batch per temperature."""
        for temperature in sorted({r.temperature for r in requests}):
            batch = [r for r in requests if r.temperature == temperature]
            try:
                outputs = [list(ids) for ids in self.vllm.generate([r.prompt_ids for r in batch], None, 1)[1]]
            except BaseException as error:  # Every request of the batch fails with it, none silently empty.
                for request in batch:
                    request.error = error
                continue
            for request, new in zip(batch, outputs, strict=True):
                request.new = new[: request.max_new]


def _up_to_first(tokens: list[int], stops: set[int]) -> list[int]:
    """The reply up to and including its first end-of-sequence token."""
    end = next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))
    return tokens[:end]


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every token id that ends a reply: the generation config's (one or a list) and the tokenizer's."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [configured])
    return {i for i in ids | {tokenizer.eos_token_id} if i is not None}


@dataclass
class Task:
    """One training prompt: the env that runs it and its item."""

    env: HermesAgentBaseEnv
    item: dict[str, Any]


def prompt_key(prompt: list[dict[str, Any]]) -> str:
    """How a dataset prompt finds its task again (TRL passes rollout_func the prompts only)."""
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


Outcome = tuple[Any, float | None]  # An agent result and its reward (None: an infra failure).


def agent_rollout_func(
    tasks: dict[str, Task],
    temperature: float,
    max_completion_length: int,
    screened: dict[str, list[Outcome]] | None = None,
) -> Any:
    """TRL `rollout_func(prompts, trainer)`: one env-loop rollout per prompt (see module docstring).

    `screened` holds rollouts already made with the initial weights (task screening): the first
    generation uses them instead of rolling those tasks again, once each.
    """

    def rollout(prompts: list[list[dict[str, Any]]], trainer: Any) -> dict[str, list[Any]]:
        batch = [tasks[prompt_key(prompt)] for prompt in prompts]
        reused = [_pop_screened(screened, prompt, trainer) for prompt in prompts]
        to_roll = [task for task, done in zip(batch, reused, strict=True) if done is None]
        with PolicyServer.of_trainer(trainer, max_completion_length) as server:
            fresh = iter(asyncio.run(run_rollouts(to_roll, server, temperature)) if to_roll else [])
        outcomes = [r if r is not None else next(fresh) for r in reused]
        stops = set(getattr(trainer, "eos_token_ids", None) or [trainer.processing_class.eos_token_id])
        out: dict[str, Any] = {k: [] for k in ("prompt_ids", "completion_ids", "env_mask")}
        out |= {"env_reward": [], "task_completed": [], "turns_used": []}
        for task, (result, reward) in zip(batch, outcomes, strict=True):
            schemas, _ = task.env._resolve_tools_for_group()
            messages = result.messages if result.messages else task.env.build_messages(task.item, schemas)
            tokens, masks = task.env.tokenize_conversation(messages, schemas)
            start = next((i for i, m in enumerate(masks) if m != -100), len(tokens))
            completion = tokens[start:][:max_completion_length] or [trainer.processing_class.eos_token_id]
            mask = [int(m != -100) for m in masks[start:][:max_completion_length]] or [0]
            completion, mask = _end_at_last_eos(completion, mask, stops)
            out["prompt_ids"].append(tokens[:start])
            out["completion_ids"].append(completion)
            out["env_mask"].append(mask)
            out["env_reward"].append(reward)
            out["task_completed"].append(result.task_completed)
            out["turns_used"].append(result.turns_used)
        out["logprobs"] = None  # Recomputed by the trainer from the policy.
        return out

    return rollout


def _pop_screened(
    screened: dict[str, list[Outcome]] | None, prompt: list[dict[str, Any]], trainer: Any
) -> Outcome | None:
    """A screening rollout of this prompt's task, while the weights are still the ones it was made with."""
    if not screened or trainer.state.global_step != 0:
        return None
    pending = screened.get(prompt_key(prompt))
    return pending.pop() if pending else None


def _end_at_last_eos(completion: list[int], mask: list[int], stops: set[int]) -> tuple[list[int], list[int]]:
    """Drop what the chat template writes after the conversation's last end-of-turn (a newline in ChatML):
    the policy never samples it, and TRL's `clipped_ratio` then counts only conversations that
    `max_completion_length` cut."""
    last = max((i for i, token in enumerate(completion) if token in stops), default=None)
    if last is None:
        return completion, mask
    return completion[: last + 1], mask[: last + 1]


async def run_rollouts(batch: list[Task], server: PolicyServer, temperature: float) -> list[Outcome]:
    """Every rollout of the batch, concurrently (the server batches their generation)."""

    async def one(task: Task) -> Outcome:
        task.env.server = server
        return await task.env.run_agent(task.item, temperature)

    return await asyncio.gather(*(one(task) for task in batch))
