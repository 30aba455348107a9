"""A fake OpenAI-compatible server on 127.0.0.1 that plays a scripted model (`fake_openai`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

Handler = Callable[[str, dict[str, Any]], tuple[int, dict[str, Any] | str]]


def completion(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI completion body with one choice."""
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    return {"id": "x", "object": kind, "created": 0, "model": "fake", "choices": [choice], "usage": usage}


def chat_reply(text: str) -> tuple[int, dict[str, Any]]:
    """A 200 chat completion whose assistant message is `text`."""
    message = {"role": "assistant", "content": text}
    return 200, completion("chat.completion", {"index": 0, "message": message, "finish_reason": "stop"})


@pytest.fixture
def fake_openai() -> Iterator[Callable[..., str]]:
    """`fake_openai(handle, headers=None)` -> base URL; `handle(path, body)` gives (status, JSON body
    or text); each request's headers (lower-case names) are appended to `headers` when given."""
    servers: list[ThreadingHTTPServer] = []

    def start(handle: Handler, headers: list[Any] | None = None) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if headers is not None:
                    headers.append({k.lower(): v for k, v in self.headers.items()})
                status, payload = handle(self.path, body)
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
