"""Shared fixtures: a real S3 HTTP endpoint (moto's server on loopback), stores on both backends, the
models, and a fake OpenAI-compatible server on 127.0.0.1 that plays a scripted model (`fake_openai`)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from flywheel.data import ArtifactStore

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
# Each pytest process (every xdist worker) gets its own Prefect home: two workers' ephemeral servers on
# one SQLite database lock each other out, and the tests leave the user's runs alone.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="flywheel-tests-prefect-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)

TEST_BUCKET = "flywheel-test"


REAL_MODEL_MODULES = "test_smollm2_"  # The `slow` tests' modules: the real SmolLM2-135M model.


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _real_model(nodeid: str) -> bool:
    return Path(_module(nodeid)).name.startswith(REAL_MODEL_MODULES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Real-model tests live in `test_smollm2_*.py` modules and run first: together they are the
    suite's longest unit of work under `pytest -n 2`, and started last they would leave a worker idle."""
    misplaced = [item.nodeid for item in items if item.get_closest_marker("slow") and not _real_model(item.nodeid)]
    if misplaced:
        raise pytest.UsageError(f"`slow` (real-model) tests belong in {REAL_MODEL_MODULES}*.py modules: {misplaced}")
    items.sort(key=lambda item: not _real_model(item.nodeid))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # Before xdist's own `--dist` schedulers.
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`pytest -n 2`: a module's tests go to one worker (its module-scoped fixtures run once), and the
    real-model modules all to the same one (one GGUF conversion, one model server)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "real-model" if _real_model(nodeid) else _module(nodeid)

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with a versioned bucket; AWS env vars point at it."""
    import boto3
    from moto.s3.responses import S3Response
    from moto.server import ThreadedMotoServer

    # moto checks a PUT's If-Match / If-None-Match and then writes, in two steps on a threaded server:
    # two conditional PUTs racing on one ETag can both succeed, which S3 never allows (a loaded run lost
    # one of 30 ref moves to it). One object PUT at a time makes the check and the write atomic again.
    put, one_at_a_time = S3Response.put_object, threading.Lock()

    def atomic_put(self: S3Response) -> Any:
        with one_at_a_time:
            return put(self)

    S3Response.put_object = atomic_put  # type: ignore[method-assign]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    client = boto3.client("s3")
    client.create_bucket(Bucket=TEST_BUCKET)
    client.put_bucket_versioning(Bucket=TEST_BUCKET, VersioningConfiguration={"Status": "Enabled"})
    yield endpoint
    server.stop()
    S3Response.put_object = put  # type: ignore[method-assign]
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh, empty store URL on the local disk or on the moto S3 server."""
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    request.getfixturevalue("s3_endpoint")
    return f"s3://{TEST_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture
def store(store_url: str) -> ArtifactStore:
    return ArtifactStore(store_url)


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    """One local store per test session that holds the prepared built-in models."""
    return ArtifactStore(tmp_path_factory.mktemp("model-store"))


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def tiny_model(model_store: ArtifactStore, model_cache: Path) -> Path:
    """The tiny random Llama (SmolLM2 tokenizer), as a local HF directory."""
    from flywheel.training.models import resolve_model

    return resolve_model("tiny", model_store, model_cache)


@pytest.fixture(scope="session")
def smollm2_model(model_store: ArtifactStore, model_cache: Path) -> Path:
    """SmolLM2-135M-Instruct converted from the shipped GGUF once per session, as a local HF directory."""
    from flywheel.training.models import resolve_model

    return resolve_model("smollm2", model_store, model_cache)


Handler = Callable[[str, dict[str, Any]], tuple[int, dict[str, Any] | str]]


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


@pytest.fixture(scope="module")
def function_calling_env(tiny_model: Path) -> Iterator[Any]:
    """A set-up `FunctionCallingEnv` acting as its oracle; every rollout's sandbox is released by the end."""
    import asyncio

    from flywheel.environments.function_calling import FunctionCallingEnv
    from flywheel.environments.tool_context import live_task_ids

    made = FunctionCallingEnv(tokenizer_name=str(tiny_model), teacher="oracle")
    asyncio.run(made.setup())
    yield made
    asyncio.run(made.teardown())
    assert live_task_ids() == []
