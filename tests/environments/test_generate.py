"""Generation in shards: a part cut into runs of its task stream, each stored as its own artifact,
merges into the rollouts a whole part gives (same groups, same order), without copying a blob."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.data import ArtifactStore, StoreError
from flywheel.data.columnar import read_rows, splits
from flywheel.environments.generate import GenerationPart, generate_rollouts, plan_shards


def test_shards_are_consecutive_runs_of_each_part() -> None:
    parts = [
        GenerationPart(env="tool_use_chain", groups=5, label="teacher"),
        GenerationPart(env="web_navigation", groups=2),
    ]
    shards = plan_shards(parts, 2)
    assert [(s.split, s.first_item, s.groups) for s in shards] == [
        ("tool_use_chain-teacher", 0, 2), ("tool_use_chain-teacher", 2, 2), ("tool_use_chain-teacher", 4, 1),
        ("web_navigation", 0, 2),
    ]  # fmt: skip


def test_a_sharded_generation_reads_as_the_whole_one(tmp_path: Path, tiny_model: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    parts = [
        GenerationPart(env="tool_use_chain", groups=5, label="teacher", seed=3),
        GenerationPart(env="function_calling", groups=3, label="teacher", seed=4),
    ]
    common = {"group_size": 1, "tokenizer": str(tiny_model), "seed": 1}
    whole = generate_rollouts(store, parts, name="whole", **common)
    ran: list[int] = []

    def in_reverse(run, shards):  # Shards finish in any order; the merge keeps the plan's.
        ran.extend(shard.first_item for shard in shards)
        return [run(shard) for shard in reversed(shards)][::-1]

    sharded = generate_rollouts(store, parts, name="sharded", shard_groups=2, map_shards=in_reverse, **common)
    assert ran == [0, 2, 4, 0, 2]
    assert splits(sharded) == splits(whole) == ["function_calling-teacher", "tool_use_chain-teacher"]
    for split in splits(whole):
        groups = [list(read_rows(store, ref.id, "rollouts", split)) for ref in (whole, sharded)]
        assert [g["meta"]["item_id"] for g in groups[1]] == [g["meta"]["item_id"] for g in groups[0]]
        assert [g["tokens"] for g in groups[1]] == [g["tokens"] for g in groups[0]]
    assert sharded.metrics["groups_written"] == whole.metrics["groups_written"] == 8
    assert len(sharded.parents) == 5 and sharded.params["parts"] == whole.params["parts"]
    shard_blobs = {e.sha256 for p in sharded.parents for e in store.manifest(p).files.values()}
    assert {e.sha256 for path, e in sharded.files.items() if path.endswith(".parquet")} <= shard_blobs


def test_an_entry_of_a_blob_the_store_lacks_is_refused(tmp_path: Path) -> None:
    store, other = ArtifactStore(tmp_path / "a"), ArtifactStore(tmp_path / "b")
    entry = other.put("dataset", "x", {"f": b"only in b"}).files["f"]
    with pytest.raises(StoreError, match="names blob .* of 9 bytes, which this store lacks"):
        store.put("dataset", "y", {"f": entry})
    assert store.put("dataset", "z", {"g": store.put("dataset", "w", {"f": b"in a"}).files["f"]}).files["g"].size == 4
