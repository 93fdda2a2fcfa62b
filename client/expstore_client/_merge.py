"""Merging what several shards answered: stats, table infos and query results."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ._codec import TableInfo

SHARD_COLUMN = "shard"
MERGE_RELATION = "results"
# Stats that are the same setting on every shard (max, not sum), and per-shard item ids
# (meaningless summed: only in the per-shard breakdown).
_SETTINGS = {"policy_version", "rate_limiter_samples_per_insert", "rate_limiter_min_size_to_sample",
             "rate_limiter_min_diff", "rate_limiter_max_diff"}
_PER_SHARD_IDS = (".position", ".committed")


def stats(per_shard: Mapping[str, Mapping[str, Mapping[str, float]]], down: list[str]) -> dict[str, dict[str, float]]:
    """{table: {key: value}} over the shards that answered: counters and gauges summed,
    settings as their max; plus ``shards_up`` and ``shards_down``."""
    out: dict[str, dict[str, float]] = {}
    for tables in per_shard.values():
        for table, values in tables.items():
            merged = out.setdefault(table, {"shards_up": 0.0, "shards_down": float(len(down))})
            merged["shards_up"] += 1
            for key, value in values.items():
                if key.startswith("group.") and key.endswith(_PER_SHARD_IDS):
                    continue
                if key in _SETTINGS:
                    merged[key] = max(merged.get(key, value), value)
                else:
                    merged[key] = merged.get(key, 0.0) + value
    return out


def table_info(infos: list[TableInfo]) -> TableInfo:
    """One table's info over its shards: items summed, the newest policy version."""
    return dataclasses.replace(infos[0], num_items=sum(i.num_items for i in infos),
                               policy_version=max(i.policy_version for i in infos))


def table_infos(per_shard: list[list[TableInfo]]) -> list[TableInfo]:
    """Every table any shard has, merged, by name."""
    by_name: dict[str, list[TableInfo]] = {}
    for infos in per_shard:
        for info in infos:
            by_name.setdefault(info.name, []).append(info)
    return [table_info(infos) for _, infos in sorted(by_name.items())]


def with_shard(readers: Mapping[str, pa.RecordBatchReader], max_rows: int) -> pa.RecordBatchReader:
    """The shards' results one after the other (in shard order), each row with a
    ``shard`` column naming its shard; at most ``max_rows`` rows (0: all)."""
    names = sorted(readers)
    first = readers[names[0]].schema
    if SHARD_COLUMN in first.names:
        raise ValueError(f"the query returns a column named {SHARD_COLUMN!r}, which the sharded client adds: "
                         f"rename it (AS ...)")
    schema = first.append(pa.field(SHARD_COLUMN, pa.string()))

    def batches() -> Iterator[pa.RecordBatch]:
        left = max_rows or None
        for name in names:
            for batch in readers[name]:
                if left is not None:
                    batch = batch.slice(0, left)
                    left -= batch.num_rows
                if batch.schema != first:
                    batch = _conform(batch, first, name)
                shard = pc.cast(pa.DictionaryArray.from_arrays(np.zeros(batch.num_rows, np.int32), [name]), pa.string())
                yield pa.RecordBatch.from_arrays([*batch.columns, shard], schema=schema)
                if left == 0:
                    return

    return pa.RecordBatchReader.from_batches(schema, batches())


def _conform(batch: pa.RecordBatch, schema: pa.Schema, shard: str) -> pa.RecordBatch:
    try:
        return batch.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as e:
        raise ValueError(f"shard {shard}: its query result has columns {batch.schema} where the first shard's "
                         f"have {schema}: {e}") from None


def merge_sql(results: pa.Table, sql: str, max_rows: int) -> pa.RecordBatchReader:
    """Run ``sql`` in DuckDB over the concatenated results, registered as ``results``
    (the map-reduce step of a sharded query). Needs duckdb, installed with the server."""
    try:
        import duckdb
    except ImportError:
        raise ImportError("ShardedClient.query(merge=...) runs the merge step in DuckDB: pip install duckdb") from None
    con = duckdb.connect()
    con.register(MERGE_RELATION, results)
    try:
        table = con.sql(sql).to_arrow_table()
    except duckdb.Error as e:
        raise ValueError(f"merge SQL over the shards' {MERGE_RELATION!r}: {e}") from None
    finally:
        con.close()
    if max_rows:
        table = table.slice(0, max_rows)
    return pa.RecordBatchReader.from_batches(table.schema, table.to_batches())
