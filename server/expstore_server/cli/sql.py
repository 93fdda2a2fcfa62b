"""Commands that move rows out by SQL: ``query`` (to stdout or a file, in the format
asked) and ``export`` (Parquet shards or a datasets directory: ``expstore_server.export``)."""

from __future__ import annotations

import sys
from pathlib import Path

from expstore_client.reward_audit import quote  # one quoting rule for the CLI and reward audits

from .errors import CliError
from .output import TABLE_ROWS, WRITERS

__all__ = ["cmd_export", "cmd_query", "quote"]

EXPORT_STREAM_S = 86_400.0  # the deadline of an export's row stream: rows arrive as shards are written


def cmd_query(b, args, out) -> int:
    limit = args.max_rows
    if args.format == "table" and not limit:
        limit = TABLE_ROWS + 1  # one more tells whether rows were left out
    reader = b.query(args.sql, limit)
    if args.format == "parquet" and not args.out and sys.stdout.isatty():
        raise CliError("--format parquet writes binary: give --out FILE or redirect stdout")
    binary = args.format == "parquet"
    target = (open(args.out, "wb") if binary else open(args.out, "w", newline="")) if args.out else None
    try:
        sink = target or (sys.stdout.buffer if binary else out)
        WRITERS[args.format](reader, sink, args.max_rows)
    finally:
        if target is not None:
            target.close()
    return 0


def cmd_export(b, args, out) -> int:
    from ..export import ExportError, export

    try:
        result = export(lambda sql: b.query(sql, 0, EXPORT_STREAM_S), args.table, Path(args.out), fmt=args.format,
                        where=args.where, columns=args.columns, rows_per_shard=args.rows_per_shard,
                        progress=args.progress)
    except ExportError as e:
        raise CliError(str(e)) from None
    out.write(f"exported {result['rows']} rows of {args.table} to {result['out']} "
              f"({result['shards']} {args.format} shard{'s' if result['shards'] != 1 else ''})\n")
    return 0
