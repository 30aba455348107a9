"""The two OpenAI calls atroposlib's `OpenAIServer` makes, over one aiohttp session, without the SDK.

atroposlib calls only `client.chat.completions.create(**kwargs)` and `client.completions.create(**kwargs)`.
The OpenAI SDK spends ~4 ms of CPU a request walking its typed-dict annotations over the request
(`_async_transform_recursive`: every tool schema, every message) before it sends a byte; at a few
hundred requests a second that, not the server, caps a rollout process. This client posts the
kwargs as they are (`extra_body` merged, as the SDK does) and builds the SDK's own response types
with `construct` (no validation, as the SDK does), so callers see the same objects.

An HTTP error raises `APIStatusError` with the SDK's `status_code`, `message` and `body`, which
the agent loop reads to tell a server that choked on the model's tool call from one that is down.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from openai.types.chat.chat_completion import ChatCompletion
from openai.types.completion import Completion


class APIStatusError(Exception):
    """The server answered with an HTTP error: the SDK's error of that name (its `status_code`,
    `message` and `body`), built the SDK's way from the reply."""

    def __init__(self, status_code: int, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").strip()
        self.status_code = status_code
        self.message = f"Error code: {status_code}"
        self.body: Any = text or None
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            pass
        else:
            self.body = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
            message = self.body.get("message") if isinstance(self.body, dict) else None
            if isinstance(message, str) and message:
                self.message += f" - {message}"
        super().__init__(self.message)


class _Endpoint:
    """`create(**kwargs)` for one path, returning `response_type`."""

    def __init__(self, client: LeanOpenAIClient, path: str, response_type: type[Any]) -> None:
        self._client, self._path, self._type = client, path, response_type

    async def create(self, **kwargs: Any) -> Any:
        data = await self._client.post(self._path, kwargs)
        return self._type.construct(**data)


class _Namespace:
    def __init__(self, **endpoints: _Endpoint) -> None:
        self.__dict__.update(endpoints)


class LeanOpenAIClient:
    """`chat.completions.create` and `completions.create` against `base_url`; a session per event loop."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        self.base_url = str(base_url).rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.chat = _Namespace(completions=_Endpoint(self, "/chat/completions", ChatCompletion))
        self.completions = _Endpoint(self, "/completions", Completion)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def post(self, path: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """POST the request body `kwargs` (its `extra_body` merged in, `extra_headers` sent as headers)."""
        body = {k: v for k, v in kwargs.items() if k not in ("extra_body", "extra_headers", "timeout")}
        body.update(kwargs.get("extra_body") or {})
        headers = {"Content-Type": "application/json", **(kwargs.get("extra_headers") or {})}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        timeout = aiohttp.ClientTimeout(total=kwargs.get("timeout") or self.timeout)
        session = self._session_for(asyncio.get_running_loop())
        async with session.post(self.base_url + path, data=json.dumps(body), headers=headers, timeout=timeout) as reply:
            raw = await reply.read()
            if reply.status >= 400:
                raise APIStatusError(reply.status, raw)
            return json.loads(raw)

    def _session_for(self, loop: asyncio.AbstractEventLoop) -> aiohttp.ClientSession:
        """The session of the running loop (a session cannot outlive or cross its loop)."""
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
