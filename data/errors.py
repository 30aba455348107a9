"""Errors raised by the artifact store, each naming the offending ref, blob or URL.

`translate` lives here too, so that every module reaching storage through fsspec turns transport
and credential failures into the same one-line messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


class StoreError(Exception):
    """Base class: any failure of the artifact store that a user can act on."""


class ArtifactNotFound(StoreError, LookupError):
    """A ref, manifest id or file inside an artifact does not exist."""


class CorruptBlobError(StoreError):
    """A blob's bytes no longer hash to its address."""


class RefConflict(StoreError):
    """A compare-and-swap on a ref lost against a concurrent writer."""


def translate(url: str, call: Callable[[], Any], missing: str | None = None) -> Any:
    """Run an fsspec call on the store at `url`, turning transport and credential failures into one-line StoreErrors."""
    try:
        return call()
    except StoreError:
        raise
    except FileNotFoundError as err:
        if missing is None:
            raise
        raise ArtifactNotFound(f"{missing} is missing from {url}") from err
    except Exception as err:  # botocore raises many unrelated classes; name the cause.
        name = type(err).__name__
        if name == "NoCredentialsError":
            raise StoreError(
                f"no S3 credentials for {url}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            ) from err
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            raise StoreError(f"cannot reach the S3 endpoint {endpoint or '(AWS default)'} for {url}") from err
        if isinstance(err, PermissionError):
            raise StoreError(f"access denied to {url}: {err}") from err
        raise
