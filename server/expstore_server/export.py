"""``expstore export``: a table's rows as Parquet shards or a Hugging Face datasets directory.

For training-data pipelines (SFT on the best rollouts, offline RL, reward-model data).
The rows come from one SQL query, ``SELECT <columns> FROM <table> [WHERE <condition>]``,
run by whichever backend the CLI opened (a server, a stopped server's data dir, a remote
tier), and are written batch by batch: memory holds the batch in flight and one shard's
writer, never the table.

The output directory is built under a temporary name beside ``--out`` and renamed into
place once complete, so an interrupted or failed export leaves nothing at ``--out`` and
removes what it wrote; an existing ``--out`` is never touched (the export refuses it).

* ``parquet``: ``part-00000.parquet``, ``part-00001.parquet``, ... of ``rows_per_shard``
  rows each (the last one shorter); ``pyarrow.dataset`` or ``datasets.load_dataset(
  "parquet", data_dir=...)`` read them as one dataset.
* ``hf``: what ``datasets.Dataset.save_to_disk`` writes (``load_from_disk`` reads it), one
  Arrow shard per ``rows_per_shard`` rows. Needs the ``datasets`` package (the ``[hf]``
  extra). Map columns (``reward_components``) become lists of ``{key, value}`` structs,
  their storage layout, since ``datasets`` has no map feature.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

FORMATS = ("parquet", "hf")
DEFAULT_ROWS_PER_SHARD = 100_000


class ExportError(Exception):
    """A problem with the request itself (the output exists, a bad argument)."""


def quote(name: str) -> str:
    """A SQL identifier: ``rollouts.archive`` or ``my-table`` stay one name."""
    return '"' + name.replace('"', '""') + '"'


def export_sql(table: str, columns: str | None, where: str | None) -> str:
    return f"SELECT {columns or '*'} FROM {quote(table)}" + (f" WHERE {where}" if where else "")


def export(query: Callable[[str], pa.RecordBatchReader], table: str, out: Path, *, fmt: str = "parquet",
           where: str | None = None, columns: str | None = None, rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
           progress: bool | None = None) -> dict:
    """Write the rows of ``table`` (those matching ``where``) to the directory ``out``.
    ``query(sql)`` runs SQL on the store. Returns {"rows", "shards", "out"}."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if rows_per_shard < 1:
        raise ExportError(f"--rows-per-shard {rows_per_shard}: expected at least 1")
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise ExportError(f"{out} exists: give a new directory (an export never writes into an existing one)")
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent} is not a directory")
    if fmt == "hf":
        _import_datasets()  # fail before the query runs
    sql = export_sql(table, columns, where)
    total = _count(query, table, where)
    staging = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.partial"  # the umask's permissions, not 0700
    staging.mkdir()
    try:
        bar = _bar(total, sys.stderr.isatty() if progress is None else progress)
        with bar:
            shards = _write_shards(query(sql), staging / ("arrow" if fmt == "hf" else ""), fmt, rows_per_shard,
                                   bar.update)
        rows = sum(n for _, n in shards)
        if fmt == "hf":
            _save_to_disk([path for path, _ in shards], staging / "dataset", len(shards))
            (staging / "dataset").rename(out)
        else:
            staging.rename(out)
        return {"rows": rows, "shards": len(shards), "out": str(out)}
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _count(query, table: str, where: str | None) -> int:
    n = query(export_sql(table, "count(*) AS n", where)).read_all()
    return int(n.column("n")[0].as_py() or 0)


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="rows", unit_scale=True, desc="export", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


def _batches(reader: pa.RecordBatchReader, rows_per_shard: int) -> Iterator[tuple[bool, pa.RecordBatch]]:
    """(starts a new shard, batch): batches split so that no shard exceeds rows_per_shard."""
    filled = 0
    for batch in reader:
        start = 0
        while start < batch.num_rows:
            if filled == rows_per_shard:
                filled = 0
            take = min(rows_per_shard - filled, batch.num_rows - start)
            yield filled == 0, batch.slice(start, take)
            filled += take
            start += take


def _write_shards(reader: pa.RecordBatchReader, folder: Path, fmt: str, rows_per_shard: int,
                  advance: Callable[[int], object]) -> list[tuple[Path, int]]:
    folder.mkdir(parents=True, exist_ok=True)
    schema = _hf_schema(reader.schema) if fmt == "hf" else reader.schema
    shards: list[tuple[Path, int]] = []
    writer = None
    try:
        for new_shard, batch in _batches(reader, rows_per_shard):
            if new_shard:
                if writer is not None:
                    writer.close()
                path = folder / f"part-{len(shards):05d}.{'arrow' if fmt == 'hf' else 'parquet'}"
                writer = pa.ipc.new_stream(path, schema) if fmt == "hf" else pq.ParquetWriter(path, schema)
                shards.append((path, 0))
            if fmt == "hf":
                batch = batch.cast(schema)
            writer.write_batch(batch)
            shards[-1] = (shards[-1][0], shards[-1][1] + batch.num_rows)
            advance(batch.num_rows)
        if not shards:  # no rows: one empty shard that still carries the schema
            path = folder / f"part-00000.{'arrow' if fmt == 'hf' else 'parquet'}"
            writer = pa.ipc.new_stream(path, schema) if fmt == "hf" else pq.ParquetWriter(path, schema)
            shards.append((path, 0))
    finally:
        if writer is not None:
            writer.close()
    return shards


def _hf_schema(schema: pa.Schema) -> pa.Schema:
    """Map columns as list<struct<key, value>> (their storage layout): datasets has no map feature."""
    return pa.schema([f.with_type(_hf_type(f.type)) for f in schema], metadata=schema.metadata)


def _hf_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_map(t):
        return pa.list_(pa.struct([pa.field("key", _hf_type(t.key_type), nullable=False),
                                   pa.field("value", _hf_type(t.item_type))]))
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_hf_type(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_hf_type(t.value_type)))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_hf_type(f.type)) for f in t])
    return t


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise ExportError("--format hf needs the datasets package: pip install 'expstore[hf]' "
                          "(or pip install datasets)") from None
    return datasets


def _save_to_disk(shards: list[Path], out: Path, num_shards: int) -> None:
    """The Arrow shards (memory-mapped, not loaded) as one Dataset, saved in its format."""
    datasets = _import_datasets()
    parts = [datasets.Dataset.from_file(str(path)) for path in shards]
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    dataset.save_to_disk(str(out), num_shards=max(1, min(num_shards, len(dataset))))
