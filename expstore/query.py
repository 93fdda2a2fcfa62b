"""SQL over every table of a store (DuckDB over Arrow), streamed.

Each table is a relation named like the table: its payload columns, the server's
``item_id``, ``priority``, ``times_sampled``, ``inserted_at``, ``tier`` and, for trajectory
tables, the derived ``num_tokens``, ``num_generated`` (sum of loss_mask), ``num_turns`` and
``num_tool_calls`` (turns with a tool_name). Live items come from ``Table.scan`` (memory,
SSD and remote tiers, one chunk at a time); with ``archive = true`` the removed items
follow from the archive's Lance scan, with ``tier = 'archive'`` and null priority,
times_sampled and inserted_at (the archive keeps neither).

Pushdown, decided before any payload is read:

- columns: the statement is parsed by DuckDB's own parser (``json_serialize_sql``); a
  table is scanned for the columns whose names occur in any column reference of the
  statement (any part of a dotted name, so ``t.turns`` and ``turns.role`` both keep
  ``turns``), plus the inputs of the derived columns named. A ``*`` anywhere (also
  ``COLUMNS(...)``, NATURAL joins, PIVOT; not ``ORDER BY ALL``) scans every column. This over-approximates and
  never drops a needed column.
- chunks: in each ``SELECT ... FROM <table> [alias] WHERE ...`` the top-level AND-ed
  comparisons of ``policy_version`` or ``inserted_at`` with a number (=, <, <=, >, >=,
  BETWEEN, IN) become ``Table.scan`` bounds, and ``tier = ...`` / ``tier IN (...)``
  decides whether the live items and the archive are read at all. A table referenced
  several times is scanned once per reference with the loosest bounds of them all.
  DuckDB still applies the whole WHERE: pruning only skips rows it would drop.

Statements are bound first against empty relations of the full schema, so errors name
the real columns; then each table is registered as a lazy Arrow stream (a scan starts
only when DuckDB reads it). The connection has file system access disabled and its
configuration locked: a query reads the store and nothing else. Not thread-safe per
call; concurrent ``query`` calls each use their own DuckDB connection.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator, Mapping

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import InvalidArgument
from .schema import TRAJECTORY_V1

SERVER_COLUMNS = pa.schema([("item_id", pa.uint64()), ("priority", pa.float64()),
                            ("times_sampled", pa.int64()), ("inserted_at", pa.float64()),
                            ("tier", pa.string())])
DERIVED_COLUMNS = pa.schema([("num_tokens", pa.int64()), ("num_generated", pa.int64()),
                             ("num_turns", pa.int64()), ("num_tool_calls", pa.int64())])
_INPUT = {"num_tokens": "tokens", "num_generated": "loss_mask", "num_turns": "turns", "num_tool_calls": "turns"}
_ARCHIVE_INTERNAL = ("_item_id", "_removed", "_chunk", "_nbytes")
BATCH_ROWS = 65_536


@dataclass(frozen=True)
class Bounds:
    """What a scan may skip: policy_version in [min_pv, max_pv], inserted_at in (after,
    before), and which tiers are read (None: all). None bounds are open."""

    min_pv: int | None = None
    max_pv: int | None = None
    after: float | None = None
    before: float | None = None
    tiers: frozenset[str] | None = None

    def hull(self, other: "Bounds") -> "Bounds":
        def lo(a, b):
            return None if a is None or b is None else min(a, b)

        def hi(a, b):
            return None if a is None or b is None else max(a, b)
        tiers = None if self.tiers is None or other.tiers is None else self.tiers | other.tiers
        return Bounds(lo(self.min_pv, other.min_pv), hi(self.max_pv, other.max_pv),
                      lo(self.after, other.after), hi(self.before, other.before), tiers)

    def reads(self, tier: str) -> bool:
        return self.tiers is None or tier in self.tiers


class Source:
    """A relation's rows: ``payload`` is its stored schema, ``batches`` yields record
    batches of the requested payload columns plus all SERVER_COLUMNS."""

    payload: pa.Schema
    trajectory: bool

    def batches(self, columns: list[str], bounds: Bounds) -> Iterator[pa.RecordBatch]:
        raise NotImplementedError


class TableSource(Source):
    """A live table, then its archive."""

    def __init__(self, table) -> None:
        self.table = table
        self.payload = table.schema
        self.trajectory = table.spec.kind == "trajectory"

    def batches(self, columns, bounds):
        pv = dict(min_policy_version=bounds.min_pv, max_policy_version=bounds.max_pv) if self.trajectory else {}
        if any(bounds.reads(t) for t in ("memory", "ssd", "remote")):
            for batch in self.table.scan(columns, inserted_after=bounds.after,
                                         inserted_before=bounds.before, **pv):
                yield batch
        if bounds.reads("archive") and bounds.after is None and bounds.before is None:
            reader = self.table.scan_archive(columns + ["_item_id"], _lance_filter(bounds, self.trajectory))
            if reader is not None:
                yield from _archived(reader, "archive")


class LanceSource(Source):
    """A Lance dataset of a remote tier directory, read-only: a table's chunks
    (``<table>.lance``: rows as stored, without item ids) or its archive
    (``<table>.archive.lance``)."""

    def __init__(self, uri: str, storage_options: dict | None = None) -> None:
        import lance

        self.uri = uri
        self.dataset = lance.dataset(uri, storage_options=storage_options)
        self.archive = uri.rstrip("/").endswith(".archive.lance")
        self.payload = pa.schema([f for f in self.dataset.schema if f.name not in _ARCHIVE_INTERNAL])
        self.trajectory = all(n in self.payload.names for n in TRAJECTORY_V1.names)

    def batches(self, columns, bounds):
        tier = "archive" if self.archive else "remote"
        if not bounds.reads(tier) or bounds.after is not None or bounds.before is not None:
            return
        names = columns + (["_item_id"] if self.archive else [])
        reader = self.dataset.scanner(columns=names, filter=_lance_filter(bounds, self.trajectory)).to_reader()
        yield from _archived(reader, tier)


def store_sources(store) -> dict[str, Source]:
    return {t.name: TableSource(t) for t in store.tables()}


def remote_sources(uri: str, storage_options: dict | None = None) -> dict[str, Source]:
    """Every ``<uri>/tables/*.lance`` dataset, named by its file name without ``.lance``."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri.rstrip("/") + "/tables")
    try:
        paths = sorted(p for p in fs.ls(root, detail=False) if p.endswith(".lance"))
    except FileNotFoundError:
        raise InvalidArgument(f"{uri}: no tables/ directory (is this a remote tier or archive URI?)") from None
    base = uri.rstrip("/") + "/tables/"
    return {Path(p).name[:-len(".lance")]: LanceSource(base + Path(p).name, storage_options) for p in paths}


def relation_schema(source: Source) -> pa.Schema:
    fields = list(source.payload) + list(SERVER_COLUMNS)
    if source.trajectory:
        fields += list(DERIVED_COLUMNS)
    return pa.schema(fields)


def query(sources: Mapping[str, Source], sql: str, *, max_rows: int = 0,
          batch_rows: int = BATCH_ROWS) -> pa.RecordBatchReader:
    """Run one SELECT over ``sources``; the result streams (at most ``max_rows`` rows
    when > 0). Bad SQL or an unknown table or column: InvalidArgument with DuckDB's
    message on one line."""
    con = duckdb.connect()
    try:
        con.execute("SET enable_external_access = false; SET lock_configuration = true")
        scans = plan(sql, {name: relation_schema(s) for name, s in sources.items()}, con)
        for name, source in sources.items():
            full = relation_schema(source)
            columns, bounds = scans.get(name, (full.names, Bounds()))
            columns = columns or {"item_id"}  # count(*) reads no column, but DuckDB wants one
            con.unregister(name)
            con.register(name, _Stream(source, pa.schema([full.field(c) for c in full.names if c in columns]), bounds))
        reader = _run(lambda: con.sql(sql).to_arrow_reader(batch_rows))
    except BaseException:
        con.close()
        raise
    return pa.RecordBatchReader.from_batches(reader.schema, _limited(con, reader, max_rows))


def plan(sql: str, schemas: Mapping[str, pa.Schema], con: duckdb.DuckDBPyConnection | None = None
         ) -> dict[str, tuple[set[str], Bounds]]:
    """Bind ``sql`` against empty relations of ``schemas`` (raising DuckDB's error) and
    return, per table the statement names, the columns to scan and the bounds."""
    con = con or duckdb.connect()
    for name, schema in schemas.items():
        con.register(name, schema.empty_table())
    ast = json.loads(_run(lambda: con.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0]))
    if ast.get("error"):
        message = _one_line(ast.get("error_message", ""))
        raise InvalidArgument("only SELECT statements can be run" if message.startswith("Only SELECT") else message)
    if len(ast["statements"]) != 1:
        raise InvalidArgument("a query is exactly one SELECT statement")
    _run(lambda: con.sql(sql))  # binds: unknown tables and columns fail here, with full names
    refs = _Refs()
    refs.walk(ast["statements"][0]["node"])
    out = {}
    for name, bounds in refs.bounds.items():
        if name not in schemas or name in refs.ctes:
            continue
        names = set(schemas[name].names)
        if refs.star:
            columns = names
        else:
            columns = (refs.names & names) | {_INPUT[d] for d in refs.names & set(_INPUT) if d in names}
        out[name] = (columns, bounds)
    return out


class _Refs:
    """What a parsed statement references (see the module docstring)."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.star = False
        self.ctes: set[str] = set()
        self.bounds: dict[str, Bounds] = {}

    def walk(self, node) -> None:
        if isinstance(node, list):
            for n in node:
                self.walk(n)
            return
        if not isinstance(node, dict):
            return
        kind, cls = node.get("type"), node.get("class")
        if kind == "ORDER_MODIFIER":  # ORDER BY ALL: a star over the select list, not a table
            node = dict(node, orders=[o for o in node["orders"] if o["expression"].get("class") != "STAR"
                                      or o["expression"].get("relation_name") or o["expression"].get("expr")])
        if cls == "COLUMN_REF":
            self.names.update(node["column_names"])
        if cls == "STAR" or kind == "STAR" or "PIVOT" in str(kind) or node.get("ref_type") == "NATURAL":
            self.star = True
        self.names.update(node.get("using_columns") or [])
        for entry in (node.get("cte_map") or {}).get("map", []):
            self.ctes.add(entry["key"])
        if kind == "SELECT_NODE":
            base = node.get("from_table") or {}
            if base.get("type") == "BASE_TABLE":
                renamed = bool(base.get("column_name_alias"))  # FROM t AS x(a, b): by position
                self.star |= renamed
                self._add(base["table_name"], Bounds() if renamed else
                          _bounds(node.get("where_clause"), {base["table_name"], base.get("alias")}))
                node = dict(node, from_table=None)  # counted, with its bounds; not again as unbounded
        if kind == "BASE_TABLE":
            self.star |= bool(node.get("column_name_alias"))  # FROM t AS x(a, b) renames by position
            self._add(node["table_name"], Bounds())
        for value in node.values():
            if isinstance(value, (dict, list)):
                self.walk(value)

    def _add(self, name: str, bounds: Bounds) -> None:
        self.bounds[name] = self.bounds[name].hull(bounds) if name in self.bounds else bounds


_FLIP = {"COMPARE_GREATERTHAN": "COMPARE_LESSTHAN", "COMPARE_LESSTHAN": "COMPARE_GREATERTHAN",
         "COMPARE_GREATERTHANOREQUALTO": "COMPARE_LESSTHANOREQUALTO",
         "COMPARE_LESSTHANOREQUALTO": "COMPARE_GREATERTHANOREQUALTO", "COMPARE_EQUAL": "COMPARE_EQUAL"}


def _bounds(where, qualifiers: set[str]) -> Bounds:
    """Bounds implied by the top-level conjuncts of a WHERE clause (others are ignored)."""
    b = Bounds()
    for term in _conjuncts(where):
        kind = term.get("type")
        if kind in _FLIP:
            left, right = term["left"], term["right"]
            if _column(right, qualifiers):
                left, right, kind = right, left, _FLIP[kind]
            column, value = _column(left, qualifiers), _constant(right)
            if column and value is not None:
                b = _apply(b, column, kind, value)
        elif kind == "COMPARE_BETWEEN":
            column, lo, hi = _column(term["input"], qualifiers), _constant(term["lower"]), _constant(term["upper"])
            if column and lo is not None and hi is not None:
                b = _apply(_apply(b, column, "COMPARE_GREATERTHANOREQUALTO", lo), column, "COMPARE_LESSTHANOREQUALTO", hi)
        elif kind == "COMPARE_IN":
            column, values = _column(term["children"][0], qualifiers), [_constant(c) for c in term["children"][1:]]
            if column and values and all(v is not None for v in values):
                if column == "tier":
                    b = _apply(b, column, "COMPARE_EQUAL", frozenset(values))
                elif all(isinstance(v, Fraction) for v in values):
                    b = _apply(_apply(b, column, "COMPARE_GREATERTHANOREQUALTO", min(values)),
                               column, "COMPARE_LESSTHANOREQUALTO", max(values))
    return b


def _conjuncts(node) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "CONJUNCTION_AND":
        return [t for c in node["children"] for t in _conjuncts(c)]
    return [node]


def _column(node, qualifiers: set[str]) -> str | None:
    if node.get("class") != "COLUMN_REF":
        return None
    names = node["column_names"]
    if len(names) == 2 and names[0] in qualifiers:
        names = names[1:]
    return names[0] if len(names) == 1 and names[0] in ("policy_version", "inserted_at", "tier") else None


def _constant(node):
    literal = node.get("literal") if node.get("type") == "VALUE_CONSTANT" else None
    if not literal:
        return None
    if literal.get("kind") in ("INTEGER", "NUMERIC"):
        try:
            return Fraction(literal["text"])
        except (ValueError, ZeroDivisionError):
            return None
    return literal["text"] if literal.get("kind") == "STRING" else None


def _apply(b: Bounds, column: str, op: str, value) -> Bounds:
    if column == "tier":
        tiers = value if isinstance(value, frozenset) else frozenset([value])
        return replace(b, tiers=tiers if b.tiers is None else b.tiers & tiers) if op == "COMPARE_EQUAL" else b
    if not isinstance(value, Fraction):
        return b
    ge, le = op in ("COMPARE_GREATERTHANOREQUALTO", "COMPARE_EQUAL"), op in ("COMPARE_LESSTHANOREQUALTO", "COMPARE_EQUAL")
    gt, lt = op == "COMPARE_GREATERTHAN", op == "COMPARE_LESSTHAN"
    if column == "policy_version":
        lo = math.ceil(value) if ge else math.floor(value) + 1 if gt else None
        hi = math.floor(value) if le else math.ceil(value) - 1 if lt else None
        if lo is not None:
            b = replace(b, min_pv=lo if b.min_pv is None else max(b.min_pv, lo))
        if hi is not None:
            b = replace(b, max_pv=hi if b.max_pv is None else min(b.max_pv, hi))
        return b
    # inserted_at is a double; bounds are widened by a microsecond (DuckDB rounds the literal itself)
    if ge or gt:
        b = replace(b, after=float(value) - 1e-6 if b.after is None else max(b.after, float(value) - 1e-6))
    if le or lt:
        b = replace(b, before=float(value) + 1e-6 if b.before is None else min(b.before, float(value) + 1e-6))
    return b


def _lance_filter(bounds: Bounds, trajectory: bool) -> str | None:
    if not trajectory:
        return None
    terms = ([f"policy_version >= {bounds.min_pv}"] if bounds.min_pv is not None else []) + \
            ([f"policy_version <= {bounds.max_pv}"] if bounds.max_pv is not None else [])
    return " AND ".join(terms) or None


def _archived(reader: pa.RecordBatchReader, tier: str) -> Iterator[pa.RecordBatch]:
    """Lance batches -> payload + server columns (archived rows keep only their item id)."""
    for batch in reader:
        if batch.num_rows == 0:
            continue
        n = batch.num_rows
        ids = batch.column("_item_id") if "_item_id" in batch.schema.names else pa.nulls(n, pa.uint64())
        payload = [c for c in batch.schema.names if c not in _ARCHIVE_INTERNAL]
        columns = [batch.column(c) for c in payload] + [
            ids.cast(pa.uint64()), pa.nulls(n, pa.float64()), pa.nulls(n, pa.int64()), pa.nulls(n, pa.float64()),
            pa.array([tier] * n, pa.string())]
        yield pa.RecordBatch.from_arrays(columns, names=payload + SERVER_COLUMNS.names)


class _Stream:
    """A lazily started scan, as an Arrow C stream: DuckDB may open it several times
    (to read the schema, once per reference); each opening is a fresh scan."""

    def __init__(self, source: Source, schema: pa.Schema, bounds: Bounds) -> None:
        self.source, self.schema, self.bounds = source, schema, bounds

    def __arrow_c_stream__(self, requested_schema=None):
        reader = pa.RecordBatchReader.from_batches(self.schema, self._batches())
        return reader.__arrow_c_stream__(requested_schema)

    def _batches(self) -> Iterator[pa.RecordBatch]:
        wanted = set(self.schema.names)
        payload = [f.name for f in self.source.payload if f.name in wanted or f.name in
                   {_INPUT[d] for d in wanted & set(_INPUT)}]
        for batch in self.source.batches(payload, self.bounds):
            yield _conform(batch, self.schema)


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    columns = []
    for f in schema:
        col = _derived(batch, f.name) if f.name in _INPUT else batch.column(f.name)
        columns.append(col if col.type == f.type else col.cast(f.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _derived(batch: pa.RecordBatch, name: str) -> pa.Array:
    lists = batch.column(_INPUT[name])
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy().astype(np.int64)
    if name in ("num_tokens", "num_turns"):
        return pa.array(lengths)
    values = pc.list_flatten(lists)  # the elements of non-null rows, in order
    if name == "num_generated":
        counted = values.to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        tool = values.field("tool_name")
        counted = pc.fill_null(pc.greater(pc.binary_length(tool), 0), False).to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(lengths)
    sums = np.concatenate([[0], np.cumsum(counted)])
    return pa.array(sums[ends] - sums[ends - lengths])


def _limited(con, reader: pa.RecordBatchReader, max_rows: int) -> Iterator[pa.RecordBatch]:
    """The result's batches, cut at max_rows; closes the connection when done."""
    left = max_rows if max_rows > 0 else None
    try:
        while left is None or left > 0:
            try:
                batch = _run(reader.read_next_batch)
            except StopIteration:
                return
            if left is not None:
                batch = batch.slice(0, left)
                left -= batch.num_rows
            yield batch
    finally:
        con.close()


def _run(fn: Callable):
    try:
        return fn()
    except duckdb.Error as e:
        raise InvalidArgument(_one_line(str(e))) from None
    except pa.ArrowInvalid as e:  # a DuckDB error surfacing through the Arrow stream
        raise InvalidArgument(_one_line(str(e))) from None


def _one_line(message: str) -> str:
    """DuckDB's message without its source excerpt (LINE n: and the caret line)."""
    lines = [l.strip() for l in message.splitlines()]
    keep = []
    for line in lines:
        if line.startswith("LINE "):
            break
        if line:
            keep.append(line)
    return re.sub(r"\s+", " ", " ".join(keep)) or "query failed"
