"""The manifest: what an artifact is made of and where it came from, addressed by its own hash."""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class FileEntry(BaseModel):
    """One file of an artifact: the blob it points to."""

    model_config = ConfigDict(frozen=True)

    sha256: str = Field(description="Hex sha256 of the file's bytes; also the blob's address.")
    size: int = Field(description="Size in bytes.")


class Manifest(BaseModel):
    """An immutable artifact: a named set of files plus lineage, parameters and figures."""

    model_config = ConfigDict(frozen=True)

    kind: str = Field(description="Artifact kind: model, dataset, rollouts, eval, report, ...")
    name: str = Field(description="Human name; `kind/name` is also a ref to the newest version.")
    files: dict[str, FileEntry] = Field(default_factory=dict, description="Relative path -> blob.")
    parents: list[str] = Field(default_factory=list, description="Manifest ids this was made from.")
    params: dict[str, Any] = Field(default_factory=dict, description="Parameters that produced it.")
    code_version: str = Field(default_factory=lambda: code_version(), description="Code that made it.")
    created: str = Field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"),
        description="UTC creation time (ISO 8601).",
    )
    metrics: dict[str, Any] = Field(default_factory=dict, description="Figures: counts, scores, cost.")

    def canonical_bytes(self) -> bytes:
        """The exact bytes stored and hashed: sorted keys, no whitespace variance."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()

    @property
    def id(self) -> str:
        """The manifest's address: sha256 of its canonical bytes."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    @property
    def size(self) -> int:
        """Total bytes of all files."""
        return sum(entry.size for entry in self.files.values())


@cache
def code_version() -> str:
    """The git commit of the flywheel checkout (with `+dirty`), else the package version."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return f"git:{commit[:12]}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"flywheel=={version('flywheel')}"
        except PackageNotFoundError:
            return "unknown"
