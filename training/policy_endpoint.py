"""The policy under training behind HTTP, for the env workers of atropos-mode GRPO.

`POST /generate` (`{"prompt_ids", "max_tokens", "temperature", "seed"}` -> `{"token_ids", "logprobs",
"version"}`): token ids in and out, nothing re-tokenised. Two generators stand behind it:

- `generation_copy` (CPU): a second copy of the trainer's weights, so training never updates a tensor
  a forward pass is reading, served with `PolicyServer`'s continuous batching; `sync` loads the
  trainer's weights into it after every optimizer step, with the generation loops parked between
  forward passes. Replies carry `"logprobs": null` (seeded Gumbel-max sampling leaves none), as
  in-process CPU generation does: the trainer scores the old policy itself. Cached prompt pages are
  not shared between requests (they would hold keys and values of older weights for every later
  request with the same tool schemas).
- `on_vllm` (CUDA): TRL's colocated vLLM engine (`use_vllm`, `vllm_mode: colocate`: the engine on the
  trainer's GPU, `vllm_gpu_memory_utilization` of its memory), concurrent requests batched onto it.
  TRL loads the trainer's weights into the engine before each step's generation; that load waits
  for the batch in flight, goes before the next and sets the version. Replies carry vLLM's processed
  log-probs (`trajectory_api.UNKNOWN_LOGPROB` where one is unknown), which travel with the group,
  so TRL's importance-sampling correction covers both the engine's numerics and the group's age.
  A prompt longer than the engine's context is refused (vLLM would fail its whole batch).

The version is the trainer's step whose weights are loaded. A reply reports the version loaded when
its request arrived: one whose generation spans a load counts as made by the older weights, so a
group's age is never under-counted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from flywheel.environments.errors import ContextFull
from flywheel.inference import reachable_host
from flywheel.training.rollouts import PolicyServer, model_context
from flywheel.training.trajectory_api import logprobs_from_json, logprobs_to_json

logger = logging.getLogger(__name__)


class PolicyEndpoint:
    """The policy's generator (a copy, or the trainer's vLLM engine) over HTTP on a thread of its own; a
    context manager."""

    def __init__(
        self,
        server: PolicyServer,
        vocab_size: int,
        host: str = "127.0.0.1",
        engine_load: Callable[[], None] | None = None,
        step: Callable[[], int] = lambda: 0,
    ) -> None:
        """`engine_load`: the trainer's own weight load into the engine `server` generates on (vLLM), which
        `load_into_engine` wraps, stamping `step()` as the version; None: `sync` loads a copy."""
        self.server = server
        self.vocab_size = vocab_size
        self.engine_load = engine_load
        self.step = step
        self.version = 0
        self.served = 0
        self.host = host
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @classmethod
    def generation_copy(
        cls, model_dir: Path, tokenizer: Any, top_k: int, max_new_tokens: int, host: str = "127.0.0.1"
    ) -> PolicyEndpoint:
        """A CPU copy of the policy in `model_dir`, which `sync` keeps up with the trainer."""
        import torch
        from transformers import AutoModelForCausalLM

        generator = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        generator.requires_grad_(False)
        context = model_context(generator)
        server = PolicyServer(
            lambda: generator, tokenizer, top_k, max_new_tokens, prefix_sharing=False, context=context
        )
        return cls(server, int(generator.config.vocab_size), host)

    @classmethod
    def on_vllm(cls, trainer: Any, max_new_tokens: int, host: str = "127.0.0.1") -> PolicyEndpoint:
        """The vLLM engine of a TRL trainer (`use_vllm`, colocated), kept up by TRL's own weight sync."""
        generation = trainer.vllm_generation
        if generation.enable_sleep_mode:  # TRL's generate would then load weights itself, under the engine's lock.
            raise ValueError("rl_mode=atropos keeps the engine awake while training: turn vLLM's sleep mode off")
        server = PolicyServer.of_trainer(trainer, max_new_tokens)
        vocab_size = int(trainer.accelerator.unwrap_model(trainer.model).config.vocab_size)
        endpoint = cls(server, vocab_size, host, engine_load=generation.sync_weights,
                       step=lambda: trainer.state.global_step)  # fmt: skip
        generation.sync_weights = endpoint.load_into_engine  # TRL calls it from the training loop.
        return endpoint

    def load_into_engine(self) -> None:
        """TRL's weight load into its engine (`sync_weights`, before each step's generation), made to wait for
        the batch in flight and to go before the next, with the trainer's step as the version."""
        import torch

        if self.engine_load is None:
            raise TypeError("a generation copy is loaded by sync(model, version)")
        with self.server.paused():
            self.engine_load()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # Loaded before the next batch, on whatever stream it runs.
            self.version = self.step()

    def __enter__(self) -> PolicyEndpoint:
        """Serve (until `close`): the server runs on an event loop of its own thread."""
        self._loop = asyncio.new_event_loop()
        # A request to vLLM waits in a thread for its batch: room for every rollout the workers have in flight.
        self._loop.set_default_executor(ThreadPoolExecutor(max_workers=256, thread_name_prefix="policy-endpoint"))
        self._thread = threading.Thread(target=self._loop.run_forever, name="policy-endpoint", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync(self, model: Any, version: int) -> None:
        """Load `model`'s weights into the generation copy; replies requested from now on are `version`'s."""
        import torch

        if self.engine_load is not None:
            raise TypeError("an engine endpoint follows the trainer's own weight load (load_into_engine)")

        generator = self.server.model()
        source = dict(model.named_parameters()) | dict(model.named_buffers())
        with torch.no_grad(), self.server.paused():
            for name, tensor in [*generator.named_parameters(), *generator.named_buffers()]:
                tensor.copy_(source[name].detach().to(tensor.dtype))
        self.version = version

    def close(self) -> None:
        """Stop serving and the generation threads."""
        try:
            if self._loop is not None and self._thread is not None and self._thread.is_alive():
                asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
                self._loop.close()
        finally:
            self.server.close()  # Its generation threads would keep the process from exiting.

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/version", self._version)
        # A request whose worker gave up (a cancelled rollout) stops generating; shutdown waits 5 s for the rest.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{reachable_host(self.host)}:{port}"
        logger.info("policy endpoint at %s", self.url)

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.version})

    async def _generate(self, request: web.Request) -> web.Response:
        version = self.version
        try:
            body = await request.json()
            prompt_ids, seed = [int(i) for i in body["prompt_ids"]], int(body["seed"])
            max_new, temperature = int(body["max_tokens"]), float(body["temperature"])
        except (ValueError, KeyError, TypeError) as error:
            return web.json_response({"error": f"bad request: {error!r}"}, status=400)
        if (
            not prompt_ids
            or not all(0 <= i < self.vocab_size for i in prompt_ids)
            or max_new < 1
            or not temperature >= 0
        ):
            # One bad id would fail the generation step every request in flight shares.
            return web.json_response({"error": "bad request: empty prompt, an id outside the vocabulary, "
                                      "max_tokens < 1 or a negative temperature"}, status=400)  # fmt: skip
        context = self.server.context  # vLLM fails a whole batch for one prompt over its context.
        if context is not None and len(prompt_ids) >= context:  # The worker's `ContextFull`.
            return web.json_response({"error": f"a prompt of {len(prompt_ids)} tokens, over the engine's "
                                      f"{context - 1}"}, status=413)  # fmt: skip
        new, logprobs = await self.server.generate(prompt_ids, temperature, max_new, seed)
        self.served += 1
        logprobs = logprobs_to_json(logprobs) if logprobs is not None else None
        return web.json_response({"token_ids": new, "logprobs": logprobs, "version": version})


class RemotePolicy:
    """The env worker's side: `PolicyServer(remote=...)` generates through the trainer's endpoint."""

    def __init__(self, url: str, timeout: float = 600) -> None:
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def generate(
        self, prompt_ids: list[int], temperature: float, max_new: int, seed: int
    ) -> tuple[list[int], list[float] | None, int]:
        """The sampled ids of one reply, their sampling log-probs (None: the endpoint gives none; NaN: none for
        that token) and the version of the weights that sampled them."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        body = {"prompt_ids": prompt_ids, "max_tokens": max_new, "temperature": temperature, "seed": seed}
        async with self._session.post(f"{self.url}/generate", json=body) as response:
            if response.status == 413:  # The conversation outgrew the engine's context: the episode ends.
                raise ContextFull(f"policy endpoint: {await response.text()}")
            if response.status != 200:
                raise RuntimeError(f"policy endpoint {self.url}: HTTP {response.status}: {await response.text()}")
            reply = await response.json()
        logprobs = reply.get("logprobs")
        logprobs = logprobs_from_json(logprobs) if logprobs is not None else None
        return [int(i) for i in reply["token_ids"]], logprobs, int(reply["version"])

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
