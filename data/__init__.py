"""Artifacts: the content-addressed store, manifests, refs and lineage."""

from data.errors import ArtifactNotFound, CorruptBlobError, RefConflict, StoreError
from data.lineage import LineageNode, lineage
from data.manifest import FileEntry, Manifest
from data.store import ArtifactStore

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
