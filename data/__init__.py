"""Artifacts: the content-addressed store, manifests, refs and lineage."""

from flywheel.data.errors import ArtifactNotFound, CorruptBlobError, RefConflict, StoreError
from flywheel.data.lineage import LineageNode, lineage
from flywheel.data.manifest import FileEntry, Manifest
from flywheel.data.store import ArtifactStore

__all__ = [
    "ArtifactNotFound",
    "ArtifactStore",
    "CorruptBlobError",
    "FileEntry",
    "LineageNode",
    "Manifest",
    "RefConflict",
    "StoreError",
    "lineage",
]
