"""Datasets as sharded Parquet: SFT rows, preference pairs and rollout groups in the store.

A dataset artifact holds `<split>-00000.parquet`, `<split>-00001.parquet`, ... of at most
`rows_per_shard` rows each, written as the rows stream in, so neither writer nor reader holds more
than a shard. Conversations keep their JSON text in one string column each (`messages`, `prompt`,
...): a tool call's arguments differ in keys and types from call to call, which no one Arrow type
holds; what a reader filters or groups by (env, category, difficulty, rewards) are typed columns.
The format and its schema version are in the manifest's params (`format`), and datasets from
before it (`train.jsonl`) still read.

Readable with the library too: `datasets.load_dataset("parquet", data_files=store.file_urls(ref,
".parquet"), streaming=True)`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1
ROWS_PER_SHARD = 10_000
LEGACY_FILE = "train.jsonl"  # A dataset artifact stored before the Parquet format.


@dataclass(frozen=True)
class RowSchema:
    """A row kind: JSON text columns, and the typed columns its `meta` is flattened into."""

    json_columns: tuple[str, ...]
    meta_columns: tuple[tuple[str, pa.DataType], ...]

    @property
    def arrow(self) -> pa.Schema:
        fields = [pa.field(name, pa.string()) for name in self.json_columns]
        return pa.schema(fields + [pa.field(name, kind) for name, kind in self.meta_columns])

    def to_record(self, row: dict[str, Any]) -> dict[str, Any]:
        meta = row.get("meta") or {}
        return {name: json.dumps(row[name], ensure_ascii=False) for name in self.json_columns} | {
            name: meta.get(name) for name, _ in self.meta_columns
        }

    def from_record(self, record: dict[str, Any]) -> dict[str, Any]:
        row = {name: json.loads(record[name]) for name in self.json_columns}
        return row | {"meta": {name: record[name] for name, _ in self.meta_columns}}


_SLICE = (("item_id", pa.string()), ("content_digest", pa.string()), ("env", pa.string()),
          ("category", pa.string()), ("difficulty", pa.string()))  # fmt: skip
SCHEMAS = {
    "sft": RowSchema(("messages", "tools"), (*_SLICE, ("reward", pa.float64()))),
    "pairs": RowSchema(
        ("prompt", "chosen", "rejected", "tools"),
        (*_SLICE, ("chosen_reward", pa.float64()), ("rejected_reward", pa.float64())),
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
    """A dataset artifact's rows in order, one verified shard in memory at a time; a dataset stored
    before the Parquet format (`train.jsonl`) reads the same."""
    manifest = store.manifest(ref)
    shards = sorted(p for p in manifest.files if p.startswith(f"{split}-") and p.endswith(".parquet"))
    if not shards and LEGACY_FILE in manifest.files:
        for line in store.read_bytes(manifest.id, LEGACY_FILE).decode().splitlines():
            if line.strip():
                yield json.loads(line)
        return
    version = (manifest.params.get("format") or {}).get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{manifest.kind}/{manifest.name} is in dataset format version {version}; this flywheel reads "
            f"version {SCHEMA_VERSION}: upgrade flywheel to read it"
        )
    schema = SCHEMAS[kind]
    for relpath in shards:
        table = pq.ParquetFile(io.BytesIO(store.read_bytes(manifest.id, relpath)))
        for batch in table.iter_batches():
            yield from (schema.from_record(record) for record in batch.to_pylist())
