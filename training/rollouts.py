"""GRPO rollouts through each env's own agent loop: train on the loop the model is judged by.

TRL's `rollout_func` hook hands us the batch's prompts; every prompt is one rollout of its task,
run by the env's `run_agent` (the same `HermesAgentLoop`, tools, sandbox, parser and verifier
as `process` mode and evaluation) with `PolicyServer` standing in for the inference server: it
generates with the policy being trained (in-process on CPU, TRL's vLLM engine on CUDA), each
reply capped by the env's per-turn `max_token_length` and the run's `max_completion_length`.

GRPO trains on the tokens the policy sampled, never a re-tokenisation of the decoded conversation
(re-tokenising changes ids at turn boundaries and inside tool calls: the KL and the importance
ratio then compare other tokens). Each rollout keeps a `Trajectory`: its first prompt, each turn's
sampled ids with their log-probs, and between turns only the template's tokens for what the env
added (tool results, the next generation prompt), cut from a rendering of the conversation the
way TRL's own tool loop does; the next turn is generated from exactly those ids. `env_mask`
keeps only sampled tokens in the loss. A chat template that does not render a conversation's
prefix as a prefix of the whole cannot be spliced; such a rollout falls back to the env's
`tokenize_conversation` with unknown log-probs (NaN: no importance correction), counted as
`retokenized`. The env's reward goes to the reward function as `env_reward`; an infra failure
scores `None` (TRL drops it from the group's statistics), not 0.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import gc
import json
import logging
import math
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from flywheel.data.costs import return_free_heap
from flywheel.environments.agent.messages import messages_with_dict_arguments
from flywheel.environments.hermes_base_env import HermesAgentBaseEnv

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    """One reply to generate on vLLM; `new` (and its log-probs) is filled by whichever thread serves its batch."""

    prompt_ids: list[int]
    temperature: float
    max_new: int
    new: list[int] | None = None
    logprobs: list[float] | None = None
    error: BaseException | None = None


@dataclass
class Trajectory:
    """The token ids one rollout's policy saw and sampled (see the module docstring).

    `completion_ids` holds every turn's sampled ids and, between turns, the template's tokens for
    what the env added; `mask` is 1 on sampled tokens, `logprobs` their sampling log-probs (NaN
    where the generator gave none, 0.0 on spliced tokens); `turns` counts the sampled replies. A
    call whose conversation does not continue this one (the env's LLM judge, say) is not part of
    it. `exact` turns False when a turn could not be spliced onto the ids before it.
    """

    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # The conversation of the last call.
    turns: int = 0
    exact: bool = True

    def covers(self, result: Any) -> bool:
        """Whether these are the tokens of `result`'s conversation: one sampled reply per assistant turn."""
        replies = sum(message["role"] == "assistant" for message in result.messages or [])
        return self.exact and self.turns > 0 and self.turns == replies

    def add(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.completion_ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [math.nan if sampled else 0.0] * len(ids)


_TRAJECTORY: contextvars.ContextVar[Trajectory | None] = contextvars.ContextVar("flywheel_trajectory", default=None)


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
        self,
        model: Callable[[], Any],
        tokenizer: Any,
        top_k: int,
        max_new_tokens: int,
        vllm: Any = None,
        device: Any = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens
        self.vllm = vllm
        self.device = device  # The rank's device: vLLM generates on it from a worker thread.
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
            device=trainer.accelerator.device,
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
        messages = messages_with_dict_arguments(messages)
        tools = kwargs.get("tools") or None
        trajectory = _TRAJECTORY.get()
        prompt_ids, continues = self._prompt_ids(messages, tools, trajectory)
        max_new = min(int(kwargs.get("max_tokens") or self.max_new_tokens), self.max_new_tokens)
        temperature = float(kwargs.get("temperature", 1.0))
        logprobs = None
        if self.vllm is not None:
            request = _Request(prompt_ids, temperature, max_new)
            new = await asyncio.to_thread(self._generate_on_vllm, request)
            logprobs = request.logprobs
        else:
            new = await self._generate_paged(prompt_ids, temperature, max_new)
        if trajectory is not None and continues:
            trajectory.add(new, sampled=True, logprobs=logprobs)
            trajectory.messages, trajectory.turns = messages, trajectory.turns + 1
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        message = SimpleNamespace(role="assistant", content=text, tool_calls=None)
        usage = SimpleNamespace(prompt_tokens=len(prompt_ids), completion_tokens=len(new))
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")], usage=usage)

    def _render(self, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _prompt_ids(
        self, messages: list[dict[str, Any]], tools: Any, trajectory: Trajectory | None
    ) -> tuple[list[int], bool]:
        """The ids to generate from, and whether the call continues the rollout's trajectory: the
        rendered conversation on a first turn (or outside a rollout, or for another conversation);
        on a later turn the trajectory's ids so far plus the template's tokens for what the env added
        since the last reply. The conversation so far renders, trimmed after its last end-of-turn
        token, as a prefix of the whole; what follows it is the splice (TRL's tool loop does the same)."""
        full = self._render(messages, tools, generation_prompt=True)
        if trajectory is None or not trajectory.exact:
            return full, trajectory is not None
        if not trajectory.prompt_ids:
            trajectory.prompt_ids = full
            return full, True
        seen = len(trajectory.messages)
        if len(messages) <= seen or messages[:seen] != trajectory.messages or messages[seen]["role"] != "assistant":
            return full, False  # Another conversation (the env's judge): not the agent's turn.
        before = self._render(messages[: seen + 1], tools, generation_prompt=False)
        ends = [i for i, token in enumerate(before) if token == self.tokenizer.eos_token_id]
        before = before[: ends[-1] + 1] if ends else before
        if full[: len(before)] != before:
            logger.warning("the chat template does not render a conversation's prefix as a prefix of the whole: "
                           "the rollout is re-tokenised, its sampling log-probs unknown")  # fmt: skip
            trajectory.exact = False
            return full, True
        trajectory.add(full[len(before) :], sampled=False)
        return trajectory.prompt_ids + trajectory.completion_ids, True

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
        _bind_thread_to(self.device)
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
                _, outputs, logprobs, _ = self.vllm.generate([r.prompt_ids for r in batch], None, 1)
            except BaseException as error:  # Every request of the batch fails with it, none silently empty.
                for request in batch:
                    request.error = error
                continue
            logprobs = logprobs or [None] * len(batch)
            for request, new, sampled in zip(batch, outputs, logprobs, strict=True):
                request.new = list(new)[: request.max_new]
                if sampled is not None:  # Per token, the sampled token's first: TRL asks vLLM for no more.
                    request.logprobs = [math.nan if lp[0] is None else lp[0] for lp in sampled][: request.max_new]


def _bind_thread_to(device: Any) -> None:
    """CUDA's current device is per thread, and a worker thread starts on cuda:0 whatever the rank's."""
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.set_device(device)


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


Outcome = tuple[Any, float | None, Trajectory]  # An agent result, its reward (None: an infra failure), its tokens.


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
        eos = trainer.processing_class.eos_token_id
        stops = set(getattr(trainer, "eos_token_ids", None) or [eos])
        out: dict[str, Any] = {k: [] for k in ("prompt_ids", "completion_ids", "env_mask", "logprobs")}
        out |= {"env_reward": [], "task_completed": [], "turns_used": [], "retokenized": []}
        for task, (result, reward, trajectory) in zip(batch, outcomes, strict=True):
            exact = trajectory.covers(result)
            prompt, completion, mask, logprobs = (
                _sampled(trajectory, max_completion_length) if exact else
                _retokenized(task, result, max_completion_length, stops, eos)
            )  # fmt: skip
            out["prompt_ids"].append(prompt)
            out["completion_ids"].append(completion)
            out["env_mask"].append(mask)
            out["logprobs"].append(logprobs)
            out["env_reward"].append(reward)
            out["task_completed"].append(result.task_completed)
            out["turns_used"].append(result.turns_used)
            out["retokenized"].append(not exact)
        if not getattr(trainer, "use_vllm", False):
            out["logprobs"] = None  # Without vLLM the trainer scores the old policy itself (no correction).
        return out

    return rollout


def _sampled(trajectory: Trajectory, limit: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """The rollout as sampled: prompt, completion (sampled turns and splices), mask, log-probs."""
    return (
        trajectory.prompt_ids,
        trajectory.completion_ids[:limit],
        trajectory.mask[:limit],
        trajectory.logprobs[:limit],
    )


def _retokenized(
    task: Task, result: Any, limit: int, stops: set[int], eos: int
) -> tuple[list[int], list[int], list[int], list[float]]:
    """A rollout that could not be spliced (or never generated): its conversation through the env's
    `tokenize_conversation`, with unknown sampling log-probs."""
    schemas, _ = task.env._resolve_tools_for_group()
    messages = result.messages if result.messages else task.env.build_messages(task.item, schemas)
    tokens, masks = task.env.tokenize_conversation(messages, schemas)
    start = next((i for i, m in enumerate(masks) if m != -100), len(tokens))
    completion = tokens[start:][:limit] or [eos]
    mask = [int(m != -100) for m in masks[start:][:limit]] or [0]
    completion, mask = _end_at_last_eos(completion, mask, stops)
    return tokens[:start], completion, mask, [math.nan] * len(completion)


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
        trajectory = Trajectory()
        _TRAJECTORY.set(trajectory)  # This task's context: its generation calls find it.
        result, reward = await task.env.run_agent(task.item, temperature)
        return result, reward, trajectory

    return await asyncio.gather(*(one(task) for task in batch))
