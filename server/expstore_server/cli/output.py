"""How the CLI writes rows: an aligned text table for people, CSV, JSON lines or Parquet
for programs (``query --format``), and the cells of each."""

from __future__ import annotations

import csv
import json

CELL = 40        # characters per cell of the aligned table
TABLE_ROWS = 50  # rows the aligned table shows by default


def json_default(v):
    return v.isoformat() if hasattr(v, "isoformat") else str(v)


def csv_cell(v) -> str:
    """A CSV cell: nested values as JSON (``query --format csv`` and the console's download)."""
    if v is None:
        return ""
    if isinstance(v, (list, dict, tuple)):
        return json.dumps(v, default=json_default)
    return str(v)


def cell(v) -> str:
    """A cell of the aligned table: one line, at most CELL characters, long lists elided."""
    if v is None:
        s = "NULL"
    elif isinstance(v, float):
        s = f"{v:.6g}"
    elif isinstance(v, list) and len(v) > 8:
        s = "[" + ", ".join(cell(x) for x in v[:8]) + f", … ({len(v)})]"
    else:
        s = json.dumps(v, default=json_default) if isinstance(v, (list, dict, tuple)) else str(v)
    s = s.replace("\n", "\\n")
    return s if len(s) <= CELL else s[:CELL - 1] + "…"


def print_rows(out, rows: list[dict], names: list[str]) -> None:
    """``rows`` as an aligned table of the columns ``names``, with a header."""
    cells = [[cell(r.get(n)) for n in names] for r in rows]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    out.write("  ".join(n.ljust(w) for n, w in zip(names, widths)).rstrip() + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for c in cells:
        out.write("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip() + "\n")


def write_table(reader, sink, max_rows: int) -> None:
    """The aligned table: TABLE_ROWS rows unless ``max_rows`` is given (the reader holds one
    more, to tell whether rows were left out)."""
    rows = reader.read_all()
    shown = rows.slice(0, TABLE_ROWS) if not max_rows else rows
    print_rows(sink, shown.to_pylist(), rows.schema.names)
    if shown.num_rows < rows.num_rows:
        sink.write("(more rows not shown: give --max-rows N, or --format csv|json|parquet for all)\n")
    else:
        sink.write(f"({rows.num_rows} row{'s' if rows.num_rows != 1 else ''})\n")


def write_csv(reader, sink, max_rows: int) -> None:
    w = csv.writer(sink)
    w.writerow(reader.schema.names)
    for batch in reader:
        for row in batch.to_pylist():
            w.writerow([csv_cell(v) for v in row.values()])


def write_json(reader, sink, max_rows: int) -> None:
    """JSON lines: one object per row."""
    for batch in reader:
        for row in batch.to_pylist():
            sink.write(json.dumps(row, default=json_default) + "\n")


def write_parquet(reader, sink, max_rows: int) -> None:
    import pyarrow.parquet as pq

    with pq.ParquetWriter(sink, reader.schema) as w:
        for batch in reader:
            w.write_batch(batch)


WRITERS = {"table": write_table, "csv": write_csv, "json": write_json, "parquet": write_parquet}
"""``query --format`` -> writer(reader, sink, max_rows); parquet's sink is binary."""
