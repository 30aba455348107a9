"""Shared fixtures: a real S3 HTTP endpoint (moto's server on loopback) and stores on both backends."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from data import ArtifactStore

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

TEST_BUCKET = "flywheel-test"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with a versioned bucket; AWS env vars point at it."""
    import boto3
    from moto.server import ThreadedMotoServer

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
    from training.models import resolve_model

    return resolve_model("tiny", model_store, model_cache)


@pytest.fixture(scope="session")
def smollm2_model(model_store: ArtifactStore, model_cache: Path) -> Path:
    """SmolLM2-135M-Instruct converted from the shipped GGUF once per session, as a local HF directory."""
    from training.models import resolve_model

    return resolve_model("smollm2", model_store, model_cache)
