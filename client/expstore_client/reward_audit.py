"""Reward audits over SQL: select a table's rows with a query, recompute their rewards.

The one selection behind ``expstore audit``, the console's audits and
``ShardedClient.audit``: count the rows (for the progress bar), stream ``SELECT *`` with
the condition, and score them with ``expstore.audit`` in worker processes of the caller
(reward functions never run in the server). "Audit" here is reward recomputation, not
the server's security audit log (``expstore_server.security_log``).

``query`` is any ``(sql, timeout) -> RecordBatchReader`` that returns all rows (a
``Client``, a ``ShardedClient``, or the CLI's offline backends). Rows from shards carry
a ``shard`` column: it is kept off the rows a reward function sees and added to the
results, and ``limit`` takes the lowest item ids over all shards, ties by shard name.

``expstore.audit`` ships with the ``expstore`` distribution (the server's), not with
``expstore-client``: it is imported on the first call, so the client installs without it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from ._merge import SHARD_COLUMN

ROW_STREAM_S = 86_400.0  # the deadline of the row stream: rows arrive as the workers take them

Query = Callable[[str, "float | None"], pa.RecordBatchReader]
"""Runs one SQL SELECT and returns all its rows; the timeout is the call's deadline in
seconds (None: the caller's default)."""


def quote(name: str) -> str:
    """A table name as a SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def reward_audit(query: Query, table: str, reward: str, *, where: str | None = None, limit: int | None = None,
                 tolerance: float = 1e-6, workers: int | None = None, item_timeout: float = 30.0,
                 progress: bool | None = None) -> Any:
    """Recompute ``reward`` (MODULE:FUNC) for the rows of ``table`` that satisfy ``where``
    (a SQL condition; ``limit``: only the lowest item ids) and diff it with the stored
    reward: an ``expstore.audit.AuditReport``. ValueError when ``reward`` cannot be
    loaded; ImportError without the expstore distribution (before any query)."""
    try:
        from expstore import audit
    except ImportError:
        raise ImportError("reward audits recompute rewards with expstore.audit, part of the expstore distribution "
                          "(the server's), not expstore-client: pip install ./client -e . from a checkout") from None

    source, cond = quote(table), f" WHERE {where}" if where else ""
    counts = query(f"SELECT count(*) AS n FROM {source}{cond}", None).read_all()  # one row per shard
    total = pc.sum(counts.column("n")).as_py() or 0
    if limit is None:
        reader = query(f"SELECT * FROM {source}{cond}", ROW_STREAM_S)
    else:  # ORDER BY only with a limit: it makes the selection deterministic, but sorts it whole
        reader = query(f"SELECT * FROM {source}{cond} ORDER BY item_id LIMIT {int(limit)}", ROW_STREAM_S)
        total = min(total, limit)
        if SHARD_COLUMN in reader.schema.names:  # each shard's lowest ids: the lowest of the union
            rows = reader.read_all()
            rows = rows.take(pc.sort_indices(rows, [("item_id", "ascending"), (SHARD_COLUMN, "ascending")])[:limit])
            reader = pa.RecordBatchReader.from_batches(rows.schema, rows.to_batches())
    if SHARD_COLUMN not in reader.schema.names:
        return audit.audit(reader, reward, tolerance=tolerance, workers=workers, timeout=item_timeout,
                           total=total, progress=progress)

    shard_of_row: list[pa.Array] = []

    def without_shard() -> Iterator[pa.RecordBatch]:
        for batch in reader:
            shard_of_row.append(batch.column(SHARD_COLUMN))
            yield batch.drop_columns([SHARD_COLUMN])

    report = audit.audit(without_shard(), reward, tolerance=tolerance, workers=workers, timeout=item_timeout,
                         total=total, progress=progress)
    shards = pa.concat_arrays(shard_of_row) if shard_of_row else pa.array([], pa.string())
    return dataclasses.replace(report, results=report.results.append_column(SHARD_COLUMN, shards))
