"""Datasets as Parquet shards in the store: rows round-trip (tool-call arguments stay dicts), shards
roll at their size, `datasets` streams them from the store, and datasets stored as JSONL still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.data import ArtifactStore, StoreError
from flywheel.data.columnar import ShardWriter, format_params, read_rows, rollouts_to_shards, splits


def sft_row(number: int) -> dict:
    call = {"type": "function", "function": {"name": "read_file", "arguments": {"path": f"f{number}", "n": number}}}
    messages = [
        {"role": "user", "content": f"task {number} ✓"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "read_file", "content": "x"},
    ]
    meta = {"item_id": f"i{number}", "content_digest": None, "env": "tool_use_chain", "category": "c",
            "difficulty": "easy", "reward": number / 10}  # fmt: skip
    return {"messages": messages, "tools": [{"type": "function", "function": {"name": "read_file"}}], "meta": meta}


def put_rows(store: ArtifactStore, tmp_path: Path, rows: list[dict], per_shard: int) -> str:
    writer = ShardWriter(tmp_path / "shards", "sft", rows_per_shard=per_shard)
    for row in rows:
        writer.write(row)
    files = {path.name: path for path in writer.close()}
    return store.put("dataset", "sft", files, params=format_params("sft")).id


def test_rows_round_trip_across_shards_that_roll_at_their_size(store: ArtifactStore, tmp_path: Path) -> None:
    rows = [sft_row(n) for n in range(5)]
    ref = put_rows(store, tmp_path, rows, per_shard=2)
    assert sorted(store.manifest(ref).files) == [f"train-0000{n}.parquet" for n in range(3)]
    assert list(read_rows(store, ref, "sft")) == rows


def test_datasets_streams_the_shards_from_the_store(store: ArtifactStore, tmp_path: Path) -> None:
    from datasets import load_dataset

    ref = put_rows(store, tmp_path, [sft_row(n) for n in range(3)], per_shard=2)
    urls = store.file_urls(ref, ".parquet")
    assert len(urls) == 2 and urls[0].startswith(("file://", "s3://"))
    stream = load_dataset("parquet", data_files=urls, split="train", streaming=True)
    records = list(stream)
    assert [r["item_id"] for r in records] == ["i0", "i1", "i2"] and records[2]["reward"] == pytest.approx(0.2)
    assert json.loads(records[1]["messages"])[1]["tool_calls"][0]["function"]["arguments"] == {"path": "f1", "n": 1}


def test_a_dataset_with_no_rows_is_one_empty_shard(store: ArtifactStore, tmp_path: Path) -> None:
    ref = put_rows(store, tmp_path, [], per_shard=2)
    assert list(store.manifest(ref).files) == ["train-00000.parquet"] and list(read_rows(store, ref, "sft")) == []


def test_a_dataset_stored_as_jsonl_still_reads(store: ArtifactStore) -> None:
    rows = [sft_row(n) for n in range(2)]
    ref = store.put("dataset", "old", {"train.jsonl": "".join(json.dumps(r) + "\n" for r in rows)}).id
    assert list(read_rows(store, ref, "sft")) == rows


def test_a_newer_format_version_is_refused_with_what_to_do(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    writer = ShardWriter(tmp_path / "shards", "sft")
    writer.write(sft_row(0))
    params = {"format": format_params("sft")["format"] | {"version": 2}}
    ref = store.put("dataset", "future", {p.name: p for p in writer.close()}, params=params).id
    with pytest.raises(StoreError, match="format version 2; this flywheel reads version 1: upgrade"):
        list(read_rows(store, ref, "sft"))


def test_rollout_groups_are_stored_in_item_order_and_read_back_whole_with_fields_the_schema_lacks(
    tmp_path: Path,
) -> None:
    store = ArtifactStore(tmp_path / "store")
    groups = [
        {"tokens": [[1, 2], [3]], "masks": [[-100, 2], [3]], "scores": [1.0, 0.0], "messages": [[], []],
         "advantages": None, "ref_logprobs": None, "group_overrides": None, "overrides": None, "images": None,
         "meta": {"item_id": item, "env": "web", "category": "c", "difficulty": "easy", "completed": [True, False],
                  "tools": [{"name": "t"}]}, "inference_logprobs": [[-0.5], [-1.0]]}
        for item in ("b", "c", "a")
    ]  # fmt: skip
    source = tmp_path / "web-policy.jsonl"
    source.write_text("".join(json.dumps(g) + "\n" for g in groups))
    shards = rollouts_to_shards(source, tmp_path / "shards", rows_per_shard=2)
    files = {p.name: p for p in shards} | {"stats.json": "{}"}
    ref = store.put("rollouts", "r", files, params=format_params("rollouts")).id
    assert splits(store.manifest(ref)) == ["web-policy"]
    read = list(read_rows(store, ref, "rollouts", "web-policy"))
    assert read == sorted(groups, key=lambda g: g["meta"]["item_id"])
