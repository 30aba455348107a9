"""Lineage: the tree of artifacts an artifact was made from, found by walking `parents`.

Both walks use an explicit stack, not recursion: a chain of rounds grows a few artifacts deeper
each round, and must never reach Python's recursion limit.
"""

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
        """Every node's manifest, depth first (a `repeated` ancestor again where it repeats)."""
        out, stack = [], [self]
        while stack:
            node = stack.pop()
            out.append(node.manifest)
            stack += reversed(node.parents)
        return out


def lineage(store: ArtifactStore, ref: str) -> LineageNode:
    """The ancestry tree of `ref`; shared ancestors are expanded once and marked `repeated` after."""
    root = LineageNode(store.manifest(store.resolve(ref)))
    seen = {root.manifest.id}
    stack = [(root, parent) for parent in reversed(root.manifest.parents)]
    while stack:
        child, manifest_id = stack.pop()
        node = LineageNode(store.manifest(manifest_id), repeated=manifest_id in seen)
        child.parents.append(node)
        if not node.repeated:
            seen.add(manifest_id)
            stack += [(node, parent) for parent in reversed(node.manifest.parents)]
    return root
