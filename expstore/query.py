"""SQL over every table of a store (DuckDB over Arrow), streamed.

Each table is a relation named like the table: its payload columns, the server's
``item_id``, ``priority``, ``times_sampled``, ``inserted_at``, ``tier`` and, for trajectory
tables, the derived ``num_tokens``, ``num_generated`` (sum of loss_mask), ``num_turns`` and
``num_tool_calls`` (turns with a tool_name). Live items come from ``Table.scan`` (memory,
SSD and remote tiers, one chunk at a time); with ``archive = true`` the removed items
follow from the archive's Lance scan, with ``tier = 'archive'`` and null priority,
times_sampled and inserted_at (the archive keeps neither); then the quarantined items
(their stored bytes are damaged: see quarantine.py), with ``tier = 'quarantined'``, their
item id and null everywhere else. Every byte a scan reads is verified; damage fails the
query with DataLoss (so does any engine error a scan raises: it is not DuckDB's).

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
configuration locked: a query reads the store and nothing else.

Limits (:class:`Limits`): each query has a DuckDB of its own with a memory limit, a
bounded spill directory and a thread count. Its spill directory is a fresh private
directory (DuckDB lets a query read its temp directory even with file access off, and
its default is ``<cwd>/.tmp``), removed when the query closes. Time is bounded by a
watchdog that interrupts DuckDB once the query has computed for ``timeout_s`` in all;
the time its reader spends between batches does not count.

Threads: a :class:`Query` is read by one thread at a time; ``close`` may be called from
any thread at any moment (a client gone away): a DuckDB call in progress is interrupted
and the connection closed as that call returns. Concurrent queries each use their own
DuckDB connection.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator, Mapping

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import DeadlineExceeded, ExpstoreError, InvalidArgument, ResourceExhausted, Unavailable
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
            reader = self.table.scan_archive(columns + ["_item_id"])  # verified: DuckDB filters
            if reader is not None:
                yield from _archived(reader, "archive")
        if bounds.reads("quarantined") and bounds.after is None and bounds.before is None:
            yield from _archived(self.table.scan_quarantined(columns), "quarantined")


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


TEMP_PREFIX = "query-"  # each query's spill directory: <temp_root>/query-XXXXXXXX


@dataclass(frozen=True)
class Limits:
    """What one query may use.

    timeout_s: seconds of computing (all DuckDB calls together) before the query is
        interrupted with DeadlineExceeded.
    memory_bytes: DuckDB's ``memory_limit``; past it DuckDB spills to disk.
    temp_bytes: DuckDB's ``max_temp_directory_size``: spill beyond it (or memory beyond
        memory_bytes with nothing left to spill) is ResourceExhausted.
    threads: DuckDB's worker threads for the query.
    temp_root: where the query's private spill directory is made (None: the system's
        temporary directory).
    """

    timeout_s: float = 300.0
    memory_bytes: int = 1 << 30
    temp_bytes: int = 1 << 30
    threads: int = 1
    temp_root: str | None = None


def query(sources: Mapping[str, Source], sql: str, *, max_rows: int = 0,
          batch_rows: int = BATCH_ROWS, limits: Limits = Limits()) -> pa.RecordBatchReader:
    """Run one SELECT over ``sources``; the result streams (at most ``max_rows`` rows
    when > 0). Bad SQL or an unknown table or column: InvalidArgument with DuckDB's
    message on one line. Past ``limits``: DeadlineExceeded or ResourceExhausted."""
    q = Query(limits)
    try:
        q.start(sources, sql, max_rows=max_rows, batch_rows=batch_rows)
    except BaseException:
        q.close()
        raise
    return pa.RecordBatchReader.from_batches(q.schema, q.batches())


class Query:
    """One query on a DuckDB connection of its own, within ``limits``: ``start``, then
    ``next_batch`` until None (or ``batches``), and ``close`` (from any thread)."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self.schema: pa.Schema | None = None
        self._lock = threading.Lock()  # guards the state below, never held across a DuckDB call
        self._con: duckdb.DuckDBPyConnection | None = None
        self._temp: str | None = None
        self._busy = self._closed = self._expired = False
        self._spent = 0.0
        self._reader: pa.RecordBatchReader | None = None
        self._errors: list[ExpstoreError] = []  # what the scans raised, under DuckDB's own error
        self._left: int | None = None

    def start(self, sources: Mapping[str, Source], sql: str, *, max_rows: int = 0,
              batch_rows: int = BATCH_ROWS) -> None:
        """Plan and start the statement (DuckDB may compute a whole aggregate here)."""
        self._reader = self._call(lambda: self._prepare(sources, sql, batch_rows))
        self.schema = self._reader.schema
        self._left = max_rows if max_rows > 0 else None

    def next_batch(self) -> pa.RecordBatch | None:
        """The next result batch, or None at the end (or at max_rows)."""
        if self._left == 0:
            return None
        try:
            batch = self._call(self._reader.read_next_batch)
        except StopIteration:
            return None
        if self._left is not None:
            batch = batch.slice(0, self._left)
            self._left -= batch.num_rows
        return batch

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The remaining batches; closes the query when done or abandoned."""
        try:
            while (batch := self.next_batch()) is not None:
                yield batch
        finally:
            self.close()

    def close(self) -> None:
        """Interrupt a DuckDB call in progress (it closes the connection as it returns)
        or close the connection now, and remove the spill directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._busy:
                if self._con is not None:
                    self._con.interrupt()
                return
        self._release()

    # -- internals ------------------------------------------------------------------

    def _prepare(self, sources: Mapping[str, Source], sql: str, batch_rows: int) -> pa.RecordBatchReader:
        limits = self.limits
        if limits.temp_root is not None:
            Path(limits.temp_root).mkdir(parents=True, exist_ok=True)
        temp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=limits.temp_root)
        con = duckdb.connect(config={"threads": limits.threads, "memory_limit": f"{limits.memory_bytes}B",
                                     "max_temp_directory_size": f"{limits.temp_bytes}B", "temp_directory": temp})
        with self._lock:
            self._con, self._temp = con, temp
            stopped = self._closed or self._expired
        if stopped:  # closed or out of time while connecting: there was nothing to interrupt
            raise Unavailable("query stopped before it started")
        con.execute("SET enable_external_access = false; SET lock_configuration = true")
        scans = plan(sql, {name: relation_schema(s) for name, s in sources.items()}, con)
        for name, source in sources.items():
            full = relation_schema(source)
            columns, bounds = scans.get(name, (full.names, Bounds()))
            columns = columns or {"item_id"}  # count(*) reads no column, but DuckDB wants one
            con.unregister(name)
            con.register(name, _Stream(source, pa.schema([full.field(c) for c in full.names if c in columns]),
                                       bounds, self._errors))
        return _run(lambda: con.sql(sql).to_arrow_reader(batch_rows))

    def _call(self, fn: Callable):
        """Run one DuckDB call under the time budget left; map what interrupted it."""
        with self._lock:
            if self._closed:
                raise Unavailable("query is closed")
            left = self.limits.timeout_s - self._spent
            if self._expired or left <= 0:
                raise self._timed_out()
            self._busy = True
        watchdog = threading.Timer(left, self._expire)
        watchdog.daemon = True
        watchdog.start()
        started = time.monotonic()
        try:
            return _run(fn)
        except StopIteration:
            raise
        except Exception:
            if self._expired:
                raise self._timed_out() from None
            if self._closed:
                raise Unavailable("query closed while it ran") from None
            if self._errors:  # a scan failed (DATA_LOSS, UNAVAILABLE): its error, not DuckDB's wrapping
                raise self._errors[0] from None
            raise
        finally:
            watchdog.cancel()
            self._spent += time.monotonic() - started
            with self._lock:
                self._busy = False
                release = self._closed
            if release:
                self._release()

    def _expire(self) -> None:
        with self._lock:
            if self._busy and not self._closed:
                self._expired = True
                if self._con is not None:
                    self._con.interrupt()

    def _timed_out(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"query stopped after {self.limits.timeout_s:g} s of computing (query_timeout_s); "
                                "narrow it with WHERE or LIMIT, or raise the limit")

    def _release(self) -> None:
        if self._con is not None:
            self._con.close()
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)


def remove_leftover_temp(temp_root: str | Path) -> None:
    """Remove the spill directories that queries of a process that died left under
    ``temp_root`` (only ``query-*`` directories: what :class:`Query` makes there)."""
    root = Path(temp_root)
    if root.is_dir():
        for path in root.glob(TEMP_PREFIX + "*"):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)


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

    def __init__(self, source: Source, schema: pa.Schema, bounds: Bounds, errors: list) -> None:
        self.source, self.schema, self.bounds, self.errors = source, schema, bounds, errors

    def __arrow_c_stream__(self, requested_schema=None):
        reader = pa.RecordBatchReader.from_batches(self.schema, self._batches())
        return reader.__arrow_c_stream__(requested_schema)

    def _batches(self) -> Iterator[pa.RecordBatch]:
        wanted = set(self.schema.names)
        payload = [f.name for f in self.source.payload if f.name in wanted or f.name in
                   {_INPUT[d] for d in wanted & set(_INPUT)}]
        try:
            for batch in self.source.batches(payload, self.bounds):
                yield _conform(batch, self.schema)
        except ExpstoreError as e:
            self.errors.append(e)
            raise


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


def _run(fn: Callable):
    try:
        return fn()
    except duckdb.OutOfMemoryException as e:
        raise _out_of_memory(e) from None
    except duckdb.Error as e:
        raise InvalidArgument(_one_line(str(e))) from None
    except (pa.ArrowInvalid, OSError) as e:  # a DuckDB error surfacing through the Arrow stream
        if "Out of Memory Error" in str(e):
            raise _out_of_memory(e) from None
        if isinstance(e, pa.ArrowInvalid):
            raise InvalidArgument(_one_line(str(e))) from None
        raise


def _out_of_memory(e: Exception) -> ResourceExhausted:
    first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"  # the rest advises a PRAGMA
    return ResourceExhausted(f"query needs more memory than it may use (query_memory_bytes, "
                             f"query_temp_bytes to spill): {first}")


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
