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
scores `None`, not 0: TRL leaves it out of its group's mean and std and gives it no advantage, and
its `env_mask` is all 0, so its tokens are out of the loss (no KL term, not in the token count
that normalises everyone else's). A generation that fails and is retried leaves nothing in the
trajectory: the retry splices the env's turn once, as the env's conversation has it.

In-process sampling is reproducible: a batch of rollouts draws one seed from torch's RNG (which
the Trainer checkpoints and restores on resume), each rollout's seed mixes it with the rank and
the rollout's place in the batch, and each of its generation calls samples from its own stream
(Gumbel-max on a hash of that number and the position), so a reply does not depend on which other
requests shared its forward passes, or when they arrived (sandbox set-up and tool calls take as
long as they take). A resumed GRPO run rolls out what the uninterrupted run rolled out.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import gc
import hashlib
import json
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

from flywheel.data.costs import return_free_heap
from flywheel.environments.agent.messages import messages_with_dict_arguments
from flywheel.environments.errors import ContextFull
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
    it. `exact` turns False when a turn could not be spliced onto the ids before it. `seed` is the
    rollout's sampling seed (None outside a rollout); `calls` counts its generation calls; `versions`
    holds, for a remote policy, the weights' version that served each call.
    """

    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # The conversation of the last call.
    turns: int = 0
    exact: bool = True
    seed: int | None = None
    calls: int = 0
    versions: list[int] = field(default_factory=list)  # The policy version of each remote call.

    def covers(self, result: Any) -> bool:
        """Whether these are the tokens of `result`'s conversation: one sampled reply per assistant turn."""
        replies = sum(message["role"] == "assistant" for message in result.messages or [])
        return self.exact and self.turns > 0 and self.turns == replies

    def add(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.completion_ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [math.nan if sampled else 0.0] * len(ids)

    def size(self) -> tuple[int, int]:
        return len(self.prompt_ids), len(self.completion_ids)

    def truncate(self, size: tuple[int, int]) -> None:
        """Forget what a call added since `size()` said `size`: a failed generation's splice (or first prompt)."""
        prompt, completion = size
        del self.prompt_ids[prompt:], self.completion_ids[completion:]
        del self.mask[completion:], self.logprobs[completion:]

    def next_seed(self) -> int:
        """The seed of this rollout's next generation call."""
        assert self.seed is not None
        self.calls += 1
        return mix_seed(self.seed, self.calls)


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
    generated together: the thread that gets the engine next serves every request waiting. With
    `remote` (an env worker of atropos-mode GRPO) each reply comes from the trainer's policy endpoint
    (`flywheel.training.policy_endpoint`) with the version of the weights that made it. Use it as
    a context manager (or `close()` it): closing stops the generation thread and puts the model back
    in the mode it was in.
    """

    def __init__(
        self,
        model: Callable[[], Any],
        tokenizer: Any,
        top_k: int,
        max_new_tokens: int,
        vllm: Any = None,
        device: Any = None,
        remote: Any = None,
        prefix_sharing: bool = True,
        context: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens
        self.vllm = vllm
        self.device = device  # The rank's device: vLLM generates on it from a worker thread.
        self.remote = remote  # A `RemotePolicy`: the trainer's weights behind an endpoint (atropos mode).
        self.prefix_sharing = prefix_sharing  # Off where the weights change under running generation loops.
        self.context = context  # Tokens the model takes, prompt and reply; a longer conversation is `ContextFull`.
        self.servers: list[Any] = []  # atroposlib's `ServerManager` surface (an env's serve loop reads it): none.
        self._model_lock = threading.Lock()  # One vLLM generate at a time.
        self._turnstile = threading.Lock()  # Held by a weight load waiting for the engine: no new batch starts.
        self._closed = False
        self._queue_lock = threading.Lock()
        self._queue: list[_Request] = []
        self._managers: dict[float, Any] = {}  # Temperature -> continuous-batching manager.
        self._was_training: bool | None = None
        self._autocast_forward: Any = None  # Accelerate's bf16 wrapper of `forward`, lifted while generating.
        self._stops: set[int] = set()  # End-of-reply token ids, found when the first manager starts.
        self._seeded: set[float] = set()  # Temperatures whose manager samples each request from its seed.

    @classmethod
    def of_trainer(cls, trainer: Any, max_new_tokens: int) -> PolicyServer:
        """The policy a TRL trainer is training (its vLLM engine when the trainer uses one)."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        vllm = trainer.vllm_generation if getattr(trainer, "use_vllm", False) else None
        context = model_context(model) if vllm is None else int(vllm.llm.llm_engine.model_config.max_model_len)
        return cls(
            lambda: trainer.accelerator.unwrap_model(trainer.model),
            trainer.processing_class,
            trainer.args.top_k,
            max_new_tokens,
            vllm=vllm,
            device=trainer.accelerator.device,
            context=context,
        )

    def __enter__(self) -> PolicyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the generation threads (on vLLM: the batch in flight finishes, requests still waiting fail) and
        restore the model's train/eval mode."""
        with self._queue_lock:
            self._closed = True
        with self._model_lock:
            pass
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

    async def update_weight(self, weight: float) -> None:
        """atroposlib's `ServerManager` surface, which an env's serve loop calls with its sampling weight
        from run-api: one policy, nothing to weigh."""

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Every running generation loop parked, its requests and cache kept (on vLLM: the batch in flight
        done, the next one waiting): the weights may change in place."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._turnstile)
            stack.enter_context(self._model_lock)
            for manager in list(self._managers.values()):
                if manager.is_running():
                    stack.enter_context(manager.pause())
            yield

    async def chat_completion(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        messages = messages_with_dict_arguments(messages)
        tools = kwargs.get("tools") or None
        trajectory = _TRAJECTORY.get()
        seed = trajectory.next_seed() if trajectory is not None and trajectory.seed is not None else draw_seed()
        before = trajectory.size() if trajectory is not None else (0, 0)
        prompt_ids, continues = self._prompt_ids(messages, tools, trajectory)
        max_new = min(int(kwargs.get("max_tokens") or self.max_new_tokens), self.max_new_tokens)
        temperature = float(kwargs.get("temperature", 1.0))
        try:
            if self.context is not None and len(prompt_ids) >= self.context:  # vLLM would fail the whole batch.
                raise ContextFull(f"a conversation of {len(prompt_ids)} tokens: the model takes {self.context}")
            if self.remote is not None:
                new, logprobs, version = await self.remote.generate(prompt_ids, temperature, max_new, seed)
                if trajectory is not None:
                    trajectory.versions.append(version)
            else:
                new, logprobs = await self.generate(prompt_ids, temperature, max_new, seed)
        except BaseException:  # The loop may retry: the retry splices the env's turn again, so forget this one's.
            if trajectory is not None:
                trajectory.truncate(before)
            raise
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

    async def generate(
        self, prompt_ids: list[int], temperature: float, max_new: int, seed: int
    ) -> tuple[list[int], list[float] | None]:
        """One reply's ids and, on vLLM, their sampling log-probs (NaN where the engine gave none); in-process
        sampled from `seed`'s stream, on vLLM from the engine's (its replies are not reproducible by seed)."""
        if self.vllm is None:
            return await self._generate_paged(prompt_ids, temperature, max_new, seed), None
        request = _Request(prompt_ids, temperature, max_new)
        new = await asyncio.to_thread(self._generate_on_vllm, request)
        return new, request.logprobs

    async def _generate_paged(self, prompt_ids: list[int], temperature: float, max_new: int, seed: int) -> list[int]:
        """One reply from the continuous-batching manager, ending at its first end-of-sequence token; sampled
        from `seed`'s stream (see `SeededSampling`)."""
        manager = self._manager(temperature)
        sampling = {"seed": seed} if temperature in self._seeded else {}
        finished: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def deliver(output: Any) -> None:
            if output.is_finished() and not finished.done():
                finished.set_result(output)

        request_id = uuid.uuid4().hex
        manager.register_result_handler(request_id, deliver)  # Before the request: its result cannot come first.
        if manager.add_request(prompt_ids, request_id=request_id, max_new_tokens=max_new, **sampling) is None:
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
            page_size=PAGE_TOKENS, max_batch_tokens=PAGED_BATCH_TOKENS, max_memory_percent=PAGED_MEMORY_SHARE,
            allow_block_sharing=self.prefix_sharing,
        )  # fmt: skip
        # The last training step's activations sit freed, and fragmented, in the allocator (tcmalloc keeps
        # them): the pool's large tensors would be mapped beside them, so hand them back first.
        return_free_heap()
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=paging)
        if temperature > 0 and SeededSampling.install(manager):
            self._seeded.add(temperature)
        with torch.inference_mode():  # The generation thread runs in the mode it was started in.
            manager.start()
        self._managers[temperature] = manager
        return manager

    def _generate_on_vllm(self, request: _Request) -> list[int]:
        _bind_thread_to(self.device)
        with self._turnstile:  # Behind a weight load already waiting for the engine (a lock is not fair).
            pass
        with self._queue_lock:
            if self._closed:
                raise RuntimeError("the policy server is closed")
            self._queue.append(request)
        with self._model_lock:
            if request.new is None and request.error is None:  # Not served yet: serve every request waiting.
                with self._queue_lock:
                    waiting, self._queue = self._queue, []
                    closed = self._closed
                if closed:
                    for one in waiting:
                        one.error = RuntimeError("the policy server is closed")
                else:
                    self._serve_on_vllm(waiting)
        if request.error is not None:
            raise request.error
        return request.new or []

    def _serve_on_vllm(self, requests: list[_Request]) -> None:
        """Generate every request, one batch per temperature asked for (each sampled at the trainer's: TRL's
        engine takes its sampling settings from its own args)."""
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


def model_context(model: Any) -> int | None:
    """The tokens a transformers model takes, prompt and reply (its position embeddings), where it says."""
    length = getattr(model.config, "max_position_embeddings", None)
    return int(length) if isinstance(length, int) else None


def draw_seed() -> int:
    """A sampling seed from torch's RNG (the state a Trainer checkpoints and restores)."""
    import torch

    return int(torch.randint(0, 2**31 - 1, ()).item())


def mix_seed(*values: int) -> int:
    """A 31-bit seed from integers (stable across processes and runs, unlike `hash`)."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


_MASK32 = 0xFFFFFFFF


def _mul32(x: Any, factor: int) -> Any:
    """`x * factor mod 2**32` for int64 tensors in [0, 2**32), no product past 2**49 (int64 never overflows)."""
    high = ((x * (factor >> 16)) & 0xFFFF) << 16
    return (high + x * (factor & 0xFFFF)) & _MASK32


def _hash32(x: Any) -> Any:
    """A 32-bit integer hash with full avalanche (Wellons' lowbias32), elementwise on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seeds: Any, vocab: int) -> Any:
    """Standard Gumbel noise, one row per entry of `seeds`: a function of that entry and the token id only (no RNG
    state, so no row depends on another, or on the order rows are drawn in)."""
    import torch

    seeds = seeds.to(torch.int64)[:, None] & _MASK32
    first, second = _hash32(seeds ^ 0x9E3779B9), _hash32(seeds ^ 0x85EBCA6B)  # Two keys per row.
    tokens = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    bits = _hash32((_hash32(tokens ^ first) + second) & _MASK32)
    uniform = (bits.to(torch.float64) + 0.5) / 2**32  # In (0, 1): never 0 or 1.
    return -torch.log(-torch.log(uniform))


class SeededSampling(ContinuousBatchingLogitsProcessor):
    """The continuous-batching manager's sampler, per request: the last logits processor, it picks each
    row's token by Gumbel-max over the warped scores (temperature, top-k: exactly a sample of their
    softmax) with noise from the request's `seed` and the token's position, and leaves that token alone
    for the runner's argmax. torch's `multinomial` over the whole batch would give a request whatever
    random numbers its batch position drew, so its reply would depend on which requests it was batched
    with and when they arrived."""

    supported_kwargs: ClassVar[dict[str, type]] = {"seed": int}
    ignored_kwargs: tuple[str, ...] = ()

    @classmethod
    def install(cls, manager: Any) -> bool:
        """Make `manager` (not started yet) sample this way; False for a stand-in without logits processors."""
        processors = getattr(manager, "logit_processor", None)
        if processors is None or not hasattr(processors, "tensors_required"):
            return False
        processors.logits_processor.append(cls())
        processors.tensors_required += 1  # One int32 argument per row: its seed.
        processors.supported_keys.update(cls.supported_kwargs)
        processors.do_processing = True
        manager.generation_config.do_sample = False  # The runner's argmax takes the token picked here.
        return True

    def fill_defaults(self, int32_tensor: Any) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> Any:
        import torch

        seeds = [
            mix_seed(request.state.logit_processor_kwargs.get("seed", 0), _position(request.state))
            for request in requests_with_new_token
        ]
        return torch.tensor(seeds, dtype=torch.int32, device="cpu")

    def __call__(self, scores: Any, tensor_arg: Any) -> Any:
        import torch

        noise = gumbel_noise(tensor_arg[: scores.size(0)], scores.size(-1)).to(scores.dtype)
        chosen = (scores + noise).argmax(dim=-1, keepdim=True)
        return torch.full_like(scores, -math.inf).scatter_(-1, chosen, 0.0)


def _position(state: Any) -> int:
    """Where in its sequence a request's next token goes (unchanged when the manager re-queues it)."""
    return len(state.initial_tokens) + len(state.generated_tokens)


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
                sampled(trajectory, max_completion_length) if exact else
                retokenized(task, result, max_completion_length, stops, eos)
            )  # fmt: skip
            out["prompt_ids"].append(prompt)
            out["completion_ids"].append(completion)
            out["env_mask"].append(mask if reward is not None else [0] * len(mask))  # An infra failure: dropped.
            out["logprobs"].append(logprobs)
            out["env_reward"].append(reward)
            out["task_completed"].append(result.task_completed)
            out["turns_used"].append(result.turns_used)
            out["retokenized"].append(not exact)
        if not getattr(trainer, "use_vllm", False):
            out["logprobs"] = None  # Without vLLM the trainer scores the old policy itself (no correction).
        return out

    return rollout


def sampled(trajectory: Trajectory, limit: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """The rollout as sampled: prompt, completion (sampled turns and splices), mask, log-probs."""
    return (
        trajectory.prompt_ids,
        trajectory.completion_ids[:limit],
        trajectory.mask[:limit],
        trajectory.logprobs[:limit],
    )


def retokenized(
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
    """Every rollout of the batch, concurrently (the server batches their generation); the i-th samples
    from seed `mix_seed(s, rank, i)`, `s` drawn from torch's RNG once per batch (every rank's RNG starts
    from the run's seed, and a group's rollouts may be on several ranks: the rank keeps theirs apart)."""
    batch_seed, rank = draw_seed(), int(os.environ.get("RANK", "0"))

    async def one(index: int, task: Task) -> Outcome:
        task.env.server = server  # What the env calls besides the agent loop (an LLM judge) is the policy too.
        trajectory = Trajectory(seed=mix_seed(batch_seed, rank, index))
        _TRAJECTORY.set(trajectory)  # This task's context: its generation calls find it.
        result, reward = await task.env.run_agent(task.item, temperature, server=server)
        return result, reward, trajectory

    return await asyncio.gather(*(one(index, task) for index, task in enumerate(batch)))
