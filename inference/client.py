"""A minimal OpenAI-compatible chat call, for smoke checks and the CLI (rollouts use atroposlib)."""

from __future__ import annotations

import os
from typing import Any

import httpx

from flywheel.inference.server import ServerError


def chat(
    base_url: str,
    model: str,
    messages: list[dict[str, Any]],
    *,
    api_key_env: str | None = None,
    timeout_s: float = 300.0,
    **params: Any,
) -> str:
    """Send one chat completion and return the assistant's text.

    `api_key_env` names the environment variable that holds the key; the key itself never
    appears in configs or logs.
    """
    headers = {}
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise ServerError(f"environment variable {api_key_env} (the API key) is not set")
        headers["Authorization"] = f"Bearer {key}"
    try:
        response = httpx.post(
            f"{base_url.rstrip('/')}/chat/completions",
            json={"model": model, "messages": messages, **params},
            headers=headers,
            timeout=timeout_s,
        )
    except httpx.HTTPError as err:
        raise ServerError(f"cannot reach {base_url}: {type(err).__name__}") from err
    if response.status_code != 200:
        raise ServerError(f"{base_url} answered HTTP {response.status_code}: {response.text[:300]}")
    return response.json()["choices"][0]["message"].get("content") or ""
