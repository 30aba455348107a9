"""Lineage: the tree of artifacts an artifact was made from, found by walking `parents`."""

from __future__ import annotations

from dataclasses import dataclass, field

from flywheel.data.manifest import Manifest
from flywheel.data.store import ArtifactStore


@dataclass
class LineageNode:
    """One artifact and the artifacts it was made from."""

    manifest: Manifest
    parents: list[LineageNode] = field(default_factory=list)
    repeated: bool = False  # Already shown elsewhere in the tree (diamond-shaped lineage).

    def walk(self) -> list[Manifest]:
        """Every manifest in the tree, depth first, each once."""
        out = [self.manifest]
        for parent in self.parents:
            out.extend(parent.walk())
        return out


def lineage(store: ArtifactStore, ref: str) -> LineageNode:
    """The ancestry tree of `ref`; shared ancestors are expanded once and marked `repeated` after."""
    seen: set[str] = set()

    def build(manifest_id: str) -> LineageNode:
        manifest = store.manifest(manifest_id)
        if manifest_id in seen:
            return LineageNode(manifest, repeated=True)
        seen.add(manifest_id)
        return LineageNode(manifest, [build(parent) for parent in manifest.parents])

    return build(store.resolve(ref))
