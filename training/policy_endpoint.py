"""The policy under training behind HTTP, for the env workers of atropos-mode GRPO.

The trainer keeps a second copy of its weights for generation, so training never updates a tensor
a forward pass is reading, serves it with `PolicyServer`'s continuous batching at `POST /generate`
(`{"prompt_ids", "max_tokens", "temperature", "seed"}` -> `{"token_ids", "version"}`: token ids in and
out, nothing re-tokenised), and loads the trainer's weights into the copy after every optimizer step
(`sync`, with the generation loops parked between forward passes), the version becoming the
trainer's step. A reply reports the version loaded when its request arrived: one whose generation
spans a sync counts as made by the older weights, so a group's age is never under-counted. Cached
prompt pages are not shared between requests here (they would hold keys and values of older
weights for every later request with the same tool schemas). Replies carry no sampling log-probs
(seeded Gumbel-max sampling leaves none), as in-process CPU generation does: the trainer scores
the old policy itself.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from flywheel.inference import reachable_host
from flywheel.training.rollouts import PolicyServer

logger = logging.getLogger(__name__)


class PolicyEndpoint:
    """A generation copy of the policy, served over HTTP on a thread of its own; a context manager."""

    def __init__(self, model_dir: Path, tokenizer: Any, top_k: int, max_new_tokens: int, host: str = "127.0.0.1"):
        import torch
        from transformers import AutoModelForCausalLM

        self.generator = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.generator.requires_grad_(False)
        self.server = PolicyServer(lambda: self.generator, tokenizer, top_k, max_new_tokens, prefix_sharing=False)
        self.vocab_size = int(self.generator.config.vocab_size)
        self.version = 0
        self.served = 0
        self.host = host
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> PolicyEndpoint:
        """Serve (until `close`): the server runs on an event loop of its own thread."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="policy-endpoint", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync(self, model: Any, version: int) -> None:
        """Load `model`'s weights into the generation copy; replies requested from now on are `version`'s."""
        import torch

        source = dict(model.named_parameters()) | dict(model.named_buffers())
        with torch.no_grad(), self.server.paused():
            for name, tensor in [*self.generator.named_parameters(), *self.generator.named_buffers()]:
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
        new = await self.server.generate_paged(prompt_ids, temperature, max_new, seed)
        self.served += 1
        return web.json_response({"token_ids": new, "version": version})


class RemotePolicy:
    """The env worker's side: `PolicyServer(remote=...)` generates through the trainer's endpoint."""

    def __init__(self, url: str, timeout: float = 600) -> None:
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def generate(
        self, prompt_ids: list[int], temperature: float, max_new: int, seed: int
    ) -> tuple[list[int], int]:
        """The sampled ids of one reply and the version of the weights that sampled them."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        body = {"prompt_ids": prompt_ids, "max_tokens": max_new, "temperature": temperature, "seed": seed}
        async with self._session.post(f"{self.url}/generate", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"policy endpoint {self.url}: HTTP {response.status}: {await response.text()}")
            reply = await response.json()
        return [int(i) for i in reply["token_ids"]], int(reply["version"])

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
