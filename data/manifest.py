"""The manifest: what an artifact is made of and where it came from, addressed by its own hash."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Iterable
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

SHA256_PATTERN = "^[0-9a-f]{64}$"
_MAX_PART_BYTES = 255  # NAME_MAX of the file systems an artifact is written to.
_MAX_NAME_CHARS = 200  # As a ref name: `kind/name` is also a ref.
_KIND = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_NAME = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")


def check_kind(kind: str) -> str:
    """Return `kind` if it is one folder-safe word; raise ValueError naming it otherwise."""
    if not _KIND.fullmatch(kind):
        raise ValueError(f"invalid kind {kind[:80]!r}: use letters, digits, '-', '_', '.' (no '/')")
    return kind


def check_relpaths(relpaths: Iterable[str]) -> None:
    """Raise ValueError unless every path is canonical, relative, inside its folder and not also a folder.

    Checked when an artifact is stored and again whenever a manifest is read, so a hand-edited
    or forged manifest can never make `get` or `materialize` write outside their destination.
    """
    relpaths = set(relpaths)
    for relpath in relpaths:
        parts = relpath.split("/")
        if (
            not relpath
            or "\\" in relpath
            or "\0" in relpath
            or any(part in ("", ".", "..") for part in parts)
            or any(len(part.encode()) > _MAX_PART_BYTES for part in parts)
        ):
            raise ValueError(f"file name '{relpath}' must be a relative path inside the artifact")
    folders = {relpath.rsplit("/", i)[0] for relpath in relpaths for i in range(1, relpath.count("/") + 1)}
    if clash := sorted(folders & relpaths):
        raise ValueError(f"'{clash[0]}' is both a file and a folder of the artifact")


class FileEntry(BaseModel):
    """One file of an artifact: the blob it points to."""

    model_config = ConfigDict(frozen=True)

    sha256: str = Field(pattern=SHA256_PATTERN, description="Hex sha256 of the file's bytes; also the blob's address.")
    size: int = Field(ge=0, description="Size in bytes.")


class Manifest(BaseModel):
    """An immutable artifact: a named set of files plus lineage, parameters and figures."""

    model_config = ConfigDict(frozen=True)

    kind: str = Field(description="Artifact kind: model, dataset, rollouts, eval, report, ...")
    name: str = Field(description="Human name; `kind/name` is also a ref to the newest version.")
    files: dict[str, FileEntry] = Field(default_factory=dict, description="Relative path -> blob.")
    parents: list[Annotated[str, Field(pattern=SHA256_PATTERN)]] = Field(
        default_factory=list, description="Manifest ids this was made from."
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Parameters that produced it.")
    code_version: str = Field(default_factory=lambda: code_version(), description="Code that made it.")
    created: str = Field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="milliseconds"),
        description="UTC creation time (ISO 8601, milliseconds: `ls` orders artifacts made in the same second).",
    )
    metrics: dict[str, Any] = Field(default_factory=dict, description="Figures: counts, scores, cost.")

    @field_validator("kind")
    @classmethod
    def _kind_is_a_word(cls, kind: str) -> str:
        return check_kind(kind)

    @field_validator("name")
    @classmethod
    def _name_is_plain(cls, name: str) -> str:
        """Names reach terminals, tables and refs: no control characters (terminal escapes), no markup brackets."""
        if len(name) > _MAX_NAME_CHARS or not _NAME.fullmatch(name):
            raise ValueError(
                f"invalid artifact name {name[:80]!r}: use at most {_MAX_NAME_CHARS} letters, digits, '-', '_', '.' "
                "in parts joined by '/'"
            )
        return name

    @field_validator("files")
    @classmethod
    def _files_stay_inside(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        check_relpaths(files)
        return files

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
