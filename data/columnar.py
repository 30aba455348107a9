"""Datasets as sharded Parquet: SFT rows, preference pairs and rollout groups in the store.

A dataset artifact holds `<split>-00000.parquet`, `<split>-00001.parquet`, ... of at most
`rows_per_shard` rows each, written as the rows stream in, so neither writer nor reader holds more
than a shard. Conversations keep their JSON text in one string column each (`messages`, `prompt`,
...): a tool call's arguments differ in keys and types from call to call, which no one Arrow type
holds; what a reader filters or groups by (env, category, difficulty, rewards) are typed columns.
The format and its schema version are in the manifest's params (`format`), and datasets from
before it (`train.jsonl`) still read; `flywheel artifacts export REF OUT.jsonl` writes any of them
as JSONL.

Readable with the library too: `datasets.load_dataset("parquet", data_files=store.file_urls(ref,
".parquet"), streaming=True)`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from flywheel.data.errors import StoreError

ShardMap = Callable[[Callable[[Any], str], list[Any]], list[str]]
"""Runs a stage's shards (`run(shard) -> artifact id` each) and returns their ids in the shards' order:
in turn here, or as tasks on a cluster (`flows/shards.py`)."""

SCHEMA_VERSION = 1
ROWS_PER_SHARD = 10_000


@dataclass(frozen=True)
class RowSchema:
    """A row kind: JSON text columns, typed columns stored as they are, and the typed columns its
    `meta` is flattened into (`meta` rebuilt from them unless it is a JSON column of its own: then
    they are copies to filter on)."""

    json_columns: tuple[str, ...]
    meta_columns: tuple[tuple[str, pa.DataType], ...]
    typed_columns: tuple[tuple[str, pa.DataType], ...] = ()
    keeps_other_keys: bool = False  # Keys the schema does not name go to an `other` JSON column.

    @property
    def arrow(self) -> pa.Schema:
        names = (*self.json_columns, "other") if self.keeps_other_keys else self.json_columns
        fields = [pa.field(name, pa.string()) for name in names]
        return pa.schema(fields + [pa.field(name, kind) for name, kind in (*self.typed_columns, *self.meta_columns)])

    def to_record(self, row: dict[str, Any]) -> dict[str, Any]:
        meta = row.get("meta") or {}
        record = (
            {name: json.dumps(row.get(name), ensure_ascii=False) for name in self.json_columns}
            | {name: row.get(name) for name, _ in self.typed_columns}
            | {name: meta.get(name) for name, _ in self.meta_columns}
        )
        if self.keeps_other_keys:
            named = {*self.json_columns, *(name for name, _ in self.typed_columns)}
            record["other"] = json.dumps({k: v for k, v in row.items() if k not in named}, ensure_ascii=False)
        return record

    def from_record(self, record: dict[str, Any]) -> dict[str, Any]:
        row = {name: json.loads(record[name]) for name in self.json_columns}
        row |= {name: record[name] for name, _ in self.typed_columns}
        if self.meta_columns and "meta" not in self.json_columns:
            row["meta"] = {name: record[name] for name, _ in self.meta_columns}
        return row | (json.loads(record["other"]) if self.keeps_other_keys else {})


_SLICE = (("item_id", pa.string()), ("content_digest", pa.string()), ("env", pa.string()),
          ("category", pa.string()), ("difficulty", pa.string()))  # fmt: skip
_IDS = pa.list_(pa.list_(pa.int32()))
SCHEMAS = {
    "sft": RowSchema(("messages", "tools"), (*_SLICE, ("reward", pa.float64()))),
    "pairs": RowSchema(
        ("prompt", "chosen", "rejected", "tools"),
        (*_SLICE, ("chosen_reward", pa.float64()), ("rejected_reward", pa.float64())),
    ),
    # Curation's screened rows, between its shards and its merge (`data/curation.py`).
    "candidates": RowSchema(
        ("row",), (), (("kind", pa.string()), ("digest", pa.binary()), ("signature", pa.list_(pa.uint32())))
    ),
    # An Atropos scored group: token ids, masks and scores typed; what atroposlib leaves None here
    # (advantages, overrides, images), the env's meta, and any field a later atroposlib adds as JSON.
    "rollouts": RowSchema(
        ("messages", "meta", "advantages", "ref_logprobs", "group_overrides", "overrides", "images"),
        _SLICE,
        (("tokens", _IDS), ("masks", _IDS), ("scores", pa.list_(pa.float64()))),
        keeps_other_keys=True,
    ),
}


def format_params(kind: str) -> dict[str, Any]:
    """What a manifest records of the format: reader code checks the version, people read the schema."""
    return {"format": {"name": "parquet", "rows": kind, "version": SCHEMA_VERSION, "schema": str(SCHEMAS[kind].arrow)}}


class ShardWriter:
    """Writes rows of one kind as Parquet shards under `folder` as they come."""

    def __init__(self, folder: Path, kind: str, split: str = "train", rows_per_shard: int = ROWS_PER_SHARD) -> None:
        self.folder, self.schema, self.split, self.rows_per_shard = folder, SCHEMAS[kind], split, rows_per_shard
        self.paths: list[Path] = []
        self._buffer: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None
        self._in_shard = 0

    def write(self, row: dict[str, Any]) -> None:
        self._buffer.append(self.schema.to_record(row))
        if len(self._buffer) >= min(1_000, self.rows_per_shard):  # Row groups of up to 1,000 rows.
            self._flush()

    def close(self) -> list[Path]:
        """The shards written (one empty shard when no row came: a dataset with no rows still reads)."""
        self._flush()
        if self._writer is None:
            self._open_shard()
        assert self._writer is not None
        self._writer.close()
        return self.paths

    def _flush(self) -> None:
        while self._buffer:
            if self._writer is None or self._in_shard >= self.rows_per_shard:
                self._open_shard()
            assert self._writer is not None
            take = min(len(self._buffer), self.rows_per_shard - self._in_shard)
            batch, self._buffer = self._buffer[:take], self._buffer[take:]
            self._writer.write_table(pa.Table.from_pylist(batch, schema=self.schema.arrow))
            self._in_shard += take

    def _open_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
        path = self.folder / f"{self.split}-{len(self.paths):05d}.parquet"
        self.folder.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(path, self.schema.arrow)
        self.paths.append(path)
        self._in_shard = 0


def read_rows(store: Any, ref: str, kind: str, split: str = "train") -> Iterator[dict[str, Any]]:
    """A dataset artifact's rows of `split` in order, one verified shard in memory at a time; one stored
    before the Parquet format (`<split>.jsonl`) reads the same."""
    manifest = store.manifest(ref)
    legacy = f"{split}.jsonl"
    shards = shard_paths(manifest, split)
    if not shards and legacy in manifest.files:
        for number, line in enumerate(store.read_bytes(manifest.id, legacy).decode().splitlines(), start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    where = f"{manifest.kind}/{manifest.name}:{legacy}"
                    raise StoreError(f"{where} line {number} is not JSON: {err}") from err
        return
    version = (manifest.params.get("format") or {}).get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise StoreError(
            f"{manifest.kind}/{manifest.name} is in dataset format version {version}; this flywheel reads "
            f"version {SCHEMA_VERSION}: upgrade flywheel to read it"
        )
    for relpath in shards:
        yield from read_shard(store, manifest.id, relpath, kind)


def read_shard(store: Any, ref: str, relpath: str, kind: str) -> Iterator[dict[str, Any]]:
    """One Parquet shard's rows, verified."""
    table = pq.ParquetFile(io.BytesIO(store.read_bytes(ref, relpath)))
    for batch in table.iter_batches():
        yield from (SCHEMAS[kind].from_record(record) for record in batch.to_pylist())


def shard_paths(manifest: Any, split: str) -> list[str]:
    """A split's Parquet shards in an artifact, in order."""
    return sorted(p for p in manifest.files if _is_shard(p) and p.rsplit("-", 1)[0] == split)


def splits(manifest: Any) -> list[str]:
    """The splits an artifact holds: its `<split>-NNNNN.parquet` shards' and `<split>.jsonl` files' names."""
    names = {path.rsplit("-", 1)[0] for path in manifest.files if _is_shard(path)}
    return sorted(names | {path[:-6] for path in manifest.files if path.endswith(".jsonl") and "/" not in path})


def export_jsonl(store: Any, ref: str, out: Path, split: str | None = None) -> int:
    """Write an artifact's rows (every split in order, or `split`) as JSONL to `out`; the rows written."""
    manifest = store.manifest(ref)
    kind = (manifest.params.get("format") or {}).get("rows", "sft")  # A JSONL dataset reads as it is.
    chosen = [split] if split else splits(manifest)
    unknown = sorted(set(chosen) - set(splits(manifest)))
    if unknown or not chosen:
        raise StoreError(
            f"{manifest.kind}/{manifest.name} has no split {', '.join(unknown) or 'of rows'}; "
            f"it has: {', '.join(splits(manifest)) or 'none'}"
        )
    written = 0
    with out.open("w", encoding="utf-8") as lines:
        for name in chosen:
            for row in read_rows(store, manifest.id, kind, name):
                lines.write(json.dumps(row, ensure_ascii=False) + "\n")
                written += 1
    return written


def rollouts_to_shards(source: Path, folder: Path, rows_per_shard: int = ROWS_PER_SHARD) -> list[Path]:
    """A part's rollout groups (atroposlib's `process` JSONL, in completion order) as Parquet shards
    named after it, in task-stream order (`item_order`): the dataset then depends on what was generated, not on which
    rollout finished first. One part's groups are sorted in memory (a generation shard's, bounded)."""
    with source.open(encoding="utf-8") as lines:
        groups = [json.loads(line) for line in lines if line.strip()]
    writer = ShardWriter(folder, "rollouts", split=source.stem, rows_per_shard=rows_per_shard)
    for group in sorted(groups, key=item_order):
        writer.write(group)
    return writer.close()


def item_order(group: dict[str, Any]) -> tuple[int, str]:
    """The order groups are stored and read in: their place in the env's task stream (so a part
    generated in shards of consecutive items reads as if generated whole), else their item id."""
    meta = group.get("meta") or {}
    index = meta.get("index")
    return (index if isinstance(index, int) else -1, str(meta.get("item_id", "")))


def _is_shard(path: str) -> bool:
    stem, _, number = path.removesuffix(".parquet").rpartition("-")
    return path.endswith(".parquet") and bool(stem) and len(number) == 5 and number.isdigit()
