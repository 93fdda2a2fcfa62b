"""``expstore``: look inside a store, query it with SQL, audit rewards, replay tool calls,
export a table for training-data pipelines.

Talks to a running server (``--server``, ``--token``), or reads data directly: a stopped
server's data dir (``--data-dir``: the Store opened under its lock) or a remote tier or
archive directory (``--remote``: its Lance datasets, read-only); ``console`` serves the same
views to a browser (``expstore_server.console``). Reward functions and tools run here, in
the CLI's processes, never in the server. Every error is one line on stderr,
``expstore: ...``, and exit code 2; ``audit`` and ``replay`` exit 1 when the data did not
reproduce. Documented in docs/cli.md (a test checks every flag is).
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import os
import sys
from pathlib import Path

import pyarrow as pa

DEFAULT_SERVER = "127.0.0.1:50051"
CELL = 40        # characters per cell of the aligned table
TABLE_ROWS = 50  # rows the aligned table shows by default
AUDIT_STREAM_S = 86_400.0  # the deadline of an audit's row stream: rows arrive as workers take them
EXPORT_STREAM_S = 86_400.0  # the deadline of an export's row stream: rows arrive as shards are written


class CliError(Exception):
    """An error to report as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise CliError(f"{self.prog.removeprefix('expstore').strip() or 'usage'}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="expstore", description="query, inspect and audit an expstore server or its data")
    p.add_argument("--server", default=os.environ.get("EXPSTORE_SERVER", DEFAULT_SERVER),
                   help=f"server address, or shards as HOST:PORT,HOST:PORT,... (env EXPSTORE_SERVER, "
                        f"default {DEFAULT_SERVER})")
    p.add_argument("--token", default=os.environ.get("EXPSTORE_TOKEN"), help="bearer token (env EXPSTORE_TOKEN)")
    p.add_argument("--tls-ca", metavar="PEM", default=os.environ.get("EXPSTORE_TLS_CA"),
                   help="connect with TLS, trusting this root certificate (env EXPSTORE_TLS_CA)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per call to the server (default 60)")
    p.add_argument("--data-dir", help="offline: open a stopped server's data dir directly")
    p.add_argument("--config", help="offline: the server's TOML config (for its remote tier settings)")
    p.add_argument("--remote", metavar="URI", help="offline: the Lance datasets under URI/tables/ as read-only tables")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    sub.add_parser("tables", help="list the tables")
    s = sub.add_parser("describe", help="a table's config and columns")
    s.add_argument("table")
    s = sub.add_parser("stats", help="counters of one table or all")
    s.add_argument("table", nargs="?")
    s.add_argument("--watch", action="store_true", help="a live view: tiers, rates, waits, staleness, groups")
    s.add_argument("--interval", type=float, default=2.0, help="--watch: seconds between refreshes (default 2)")
    s.add_argument("--count", type=int, help="--watch: stop after this many refreshes (default: never)")
    s = sub.add_parser("query", help="run one SQL SELECT over the tables")
    s.add_argument("sql")
    s.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table")
    s.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    s.add_argument("--max-rows", type=int, default=0,
                   help=f"at most this many rows (0: all; the table format shows {TABLE_ROWS} unless given)")
    s = sub.add_parser("show", help="one trajectory, turn by turn")
    s.add_argument("table")
    s.add_argument("item_id", type=int)
    s.add_argument("--tokenizer", metavar="MODULE:CALLABLE", help="returns an object with decode(ids)")
    s = sub.add_parser("manifest", help="what training step N sampled")
    s.add_argument("table")
    s.add_argument("--step", type=int, required=True)
    s = sub.add_parser("audit", help="recompute rewards and diff them with the stored ones")
    s.add_argument("table")
    s.add_argument("--reward", required=True, metavar="MODULE:FUNC")
    s.add_argument("--where", metavar="SQL", help="a SQL condition selecting the rows")
    s.add_argument("--limit", type=int, help="at most this many rows")
    s.add_argument("--out", metavar="TABLE_OR_FILE", help="results to a .parquet file or a generic table of the store")
    s.add_argument("--tolerance", type=float, default=1e-6, help="largest |delta| that still matches (default 1e-6)")
    s.add_argument("--max-mismatch", type=int, default=0,
                   help="exit 1 when more items than this mismatch, fail or time out (default 0)")
    s.add_argument("--workers", type=int, help="processes (default: CPUs, at most 8)")
    s.add_argument("--item-timeout", type=float, default=30.0, help="seconds per item (default 30)")
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    s = sub.add_parser("replay", help="re-run a trajectory's tool calls and diff the results")
    s.add_argument("table")
    s.add_argument("item_id", type=int)
    s.add_argument("--tools", required=True, metavar="MODULE",
                   help="MODULE.TOOLS[name] or MODULE.<name>: called with the args string, returns a string")
    s = sub.add_parser("checkpoint", help="snapshot the server to its remote tier")
    s.add_argument("name", nargs="?", default="")
    s = sub.add_parser("console", help="serve the web console for --server (docs/console.md)")
    from .console.serve import add_arguments

    add_arguments(s)
    s = sub.add_parser("export", help="a table's rows as Parquet shards or a Hugging Face datasets directory")
    s.add_argument("table")
    s.add_argument("--out", required=True, metavar="DIR", help="the directory to create (must not exist)")
    s.add_argument("--format", choices=["parquet", "hf"], default="parquet",
                   help="parquet shards (default) or a datasets save_to_disk directory")
    s.add_argument("--where", metavar="SQL", help="a SQL condition selecting the rows")
    s.add_argument("--columns", metavar="SQL", help="the SELECT list (default *: stored and server columns)")
    s.add_argument("--rows-per-shard", type=int, default=100_000, help="rows per shard (default 100000)")
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    return p


# -- backends: a server, a data dir, an archive ------------------------------------------

class Online:
    def __init__(self, args) -> None:
        from expstore_client import connect

        self.where = args.server
        self.client = connect(args.server, args.token, tls=args.tls_ca, timeout=args.timeout)  # "a,b": shards

    def tables(self) -> list[dict]:
        return [_table_row(t.name, t.config, t.num_items, t.policy_version) for t in self.client.list_tables()]

    def describe(self, name: str) -> tuple[dict, pa.Schema]:
        info = self.client.describe(name)
        return info.config, info.schema

    def stats(self, name: str | None) -> dict[str, dict[str, float]]:
        return self.client.stats(name)

    def query(self, sql: str, max_rows: int = 0, timeout: float | None = None) -> pa.RecordBatchReader:
        return self.client.query(sql, max_rows=max_rows, timeout=timeout)

    def manifest(self, table: str, step: int):
        return self.client.manifest(table, step)

    def checkpoint(self, name: str) -> dict:
        return self.client.checkpoint(name)

    def save(self, name: str, data: pa.Table) -> None:
        self.client.create_table(name, kind="generic", schema=data.schema, if_not_exists=True)
        self.client.insert(name, data)

    def close(self) -> None:
        self.client.close()


class Offline:
    """A stopped server's data dir, opened under its lock."""

    def __init__(self, args) -> None:
        from expstore_server import config as config_mod
        from expstore_server.main import open_store

        path = Path(args.data_dir)
        if not (path / "rocksdb").is_dir():
            raise CliError(f"{path} is not an expstore data dir (no rocksdb/ in it)")
        cfg = config_mod.load(args.config, {"data_dir": str(path)})
        self.where = str(path)
        self.limits = cfg.query_limits  # the server's query limits, spilling inside the data dir
        self.store, _ = open_store(cfg)

    def tables(self) -> list[dict]:
        return [_table_row(t.name, t.spec.to_dict(), len(t), t.policy_version) for t in self.store.tables()]

    def describe(self, name: str) -> tuple[dict, pa.Schema]:
        t = self.store.table(name)
        config = t.spec.to_dict()
        config.pop("schema", None)
        return config, t.schema

    def stats(self, name: str | None) -> dict[str, dict[str, float]]:
        tables = [self.store.table(name)] if name else self.store.tables()
        return {t.name: t.stats() for t in tables}

    def query(self, sql: str, max_rows: int = 0, timeout: float | None = None) -> pa.RecordBatchReader:
        from expstore import query

        return query.query(query.store_sources(self.store), sql, max_rows=max_rows, limits=self.limits)

    def manifest(self, table: str, step: int):
        return self.store.table(table).manifest(step)

    def checkpoint(self, name: str) -> dict:
        raise CliError("checkpoint needs a running server (--server), not --data-dir")

    def save(self, name: str, data: pa.Table) -> None:
        from expstore.spec import TableSpec

        table = self.store.create_table(TableSpec(name=name, kind="generic", schema=data.schema), if_not_exists=True)
        table.insert(data)

    def close(self) -> None:
        self.store.close()


class Archive:
    """The Lance datasets of a remote tier or archive directory, read-only."""

    def __init__(self, args) -> None:
        import dataclasses

        from expstore import query
        from expstore_server import config as config_mod

        self.where = args.remote
        self.sources = query.remote_sources(args.remote)
        # The query limits of --config (or the defaults); spilling to the system's temp dir.
        self.limits = dataclasses.replace(config_mod.load(args.config, {}).query_limits, temp_root=None)

    def tables(self) -> list[dict]:
        return [{"name": name, "kind": "trajectory" if s.trajectory else "generic", "items": s.dataset.count_rows(),
                 "source": s.uri} for name, s in self.sources.items()]

    def describe(self, name: str) -> tuple[dict, pa.Schema]:
        if name not in self.sources:
            raise CliError(f"no table {name!r} in {self.where} (tables: {', '.join(self.sources) or 'none'})")
        s = self.sources[name]
        return {"name": name, "source": s.uri, "rows": s.dataset.count_rows()}, s.payload

    def stats(self, name):
        raise CliError("stats needs a server or a data dir; --remote holds only the Lance datasets")

    def query(self, sql: str, max_rows: int = 0, timeout: float | None = None) -> pa.RecordBatchReader:
        from expstore import query

        return query.query(self.sources, sql, max_rows=max_rows, limits=self.limits)

    def manifest(self, table, step):
        raise CliError("manifest needs a server or a data dir; --remote holds only the Lance datasets")

    def checkpoint(self, name):
        raise CliError("checkpoint needs a running server (--server), not --remote")

    def save(self, name, data):
        raise CliError("--remote is read-only: write the audit to a .parquet file")

    def close(self) -> None:
        pass


def _table_row(name: str, config: dict, items: int, version: int) -> dict:
    return {"name": name, "kind": config.get("kind", "trajectory"), "items": items, "policy_version": version,
            "sampler": (config.get("sampler") or {}).get("type", "uniform"), "tiers": config.get("tiers", ""),
            "archive": bool(config.get("archive", False))}


def _backend(args):
    if args.data_dir and args.remote:
        raise CliError("give --data-dir or --remote, not both")
    if args.data_dir:
        return Offline(args)
    if args.remote:
        return Archive(args)
    return Online(args)


# -- commands --------------------------------------------------------------------------

def cmd_tables(b, args, out) -> int:
    rows = b.tables()
    _print_rows(out, rows, list(rows[0]) if rows else ["name"])
    return 0


def cmd_describe(b, args, out) -> int:
    config, schema = b.describe(args.table)
    out.write(json.dumps(config, indent=2, default=str) + "\n")
    from expstore.query import DERIVED_COLUMNS, SERVER_COLUMNS

    rows = [{"column": f.name, "type": str(f.type), "null": "" if f.nullable else "not null", "origin": "stored"}
            for f in schema]
    if "item_id" not in schema.names:
        rows += [{"column": f.name, "type": str(f.type), "null": "", "origin": "server"} for f in SERVER_COLUMNS]
        if all(n in schema.names for n in ("tokens", "loss_mask", "turns")):
            rows += [{"column": f.name, "type": str(f.type), "null": "", "origin": "derived"} for f in DERIVED_COLUMNS]
    _print_rows(out, rows, ["column", "type", "null", "origin"])
    return 0


def cmd_stats(b, args, out) -> int:
    if args.watch:
        from .watch import watch

        return watch(lambda: b.stats(args.table), out, interval=args.interval, count=args.count)
    for name, values in b.stats(args.table).items():
        out.write(f"{name}\n")
        width = max((len(k) for k in values), default=0)
        for k in sorted(values):
            v = values[k]
            out.write(f"  {k:<{width}}  {int(v) if float(v).is_integer() and abs(v) < 1e15 else format(v, 'g')}\n")
    return 0


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
        _WRITERS[args.format](reader, sink, args)
    finally:
        if target is not None:
            target.close()
    return 0


def _write_table(reader, sink, args) -> None:
    rows = reader.read_all()
    shown = rows.slice(0, TABLE_ROWS) if not args.max_rows else rows
    _print_rows(sink, shown.to_pylist(), rows.schema.names)
    if shown.num_rows < rows.num_rows:
        sink.write("(more rows not shown: give --max-rows N, or --format csv|json|parquet for all)\n")
    else:
        sink.write(f"({rows.num_rows} row{'s' if rows.num_rows != 1 else ''})\n")


def _write_csv(reader, sink, args) -> None:
    w = csv.writer(sink)
    w.writerow(reader.schema.names)
    for batch in reader:
        for row in batch.to_pylist():
            w.writerow([csv_cell(v) for v in row.values()])


def _write_json(reader, sink, args) -> None:
    for batch in reader:
        for row in batch.to_pylist():
            sink.write(json.dumps(row, default=_json_default) + "\n")


def _write_parquet(reader, sink, args) -> None:
    import pyarrow.parquet as pq

    with pq.ParquetWriter(sink, reader.schema) as w:
        for batch in reader:
            w.write_batch(batch)


_WRITERS = {"table": _write_table, "csv": _write_csv, "json": _write_json, "parquet": _write_parquet}


def _json_default(v):
    return v.isoformat() if hasattr(v, "isoformat") else str(v)


def csv_cell(v) -> str:
    """A CSV cell: nested values as JSON (``query --format csv`` and the console's download)."""
    if v is None:
        return ""
    if isinstance(v, (list, dict, tuple)):
        return json.dumps(v, default=_json_default)
    return str(v)


def _cell(v) -> str:
    if v is None:
        s = "NULL"
    elif isinstance(v, float):
        s = f"{v:.6g}"
    elif isinstance(v, list) and len(v) > 8:
        s = "[" + ", ".join(_cell(x) for x in v[:8]) + f", … ({len(v)})]"
    else:
        s = json.dumps(v, default=_json_default) if isinstance(v, (list, dict, tuple)) else str(v)
    s = s.replace("\n", "\\n")
    return s if len(s) <= CELL else s[:CELL - 1] + "…"


def _print_rows(out, rows: list[dict], names: list[str]) -> None:
    cells = [[_cell(r.get(n)) for n in names] for r in rows]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    out.write("  ".join(n.ljust(w) for n, w in zip(names, widths)).rstrip() + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for c in cells:
        out.write("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip() + "\n")


def item(b, table: str, item_id: int) -> dict:
    """One item's row (its columns, the server's and the derived ones) as Python values."""
    rows = b.query(f"SELECT * FROM {quote(table)} WHERE item_id = {int(item_id)}", 1).read_all().to_pylist()
    if not rows:
        raise CliError(f"table {table!r}: no item with id {item_id}")
    return rows[0]


def cmd_show(b, args, out) -> int:
    row = item(b, args.table, args.item_id)
    tok = _load(args.tokenizer, "--tokenizer")() if args.tokenizer else None
    color = out.isatty() and not os.environ.get("NO_COLOR")

    def paint(text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if color else text

    for k in ("item_id", "traj_id", "task", "prompt_id", "group_id", "policy_version", "finish_reason", "reward",
              "reward_components", "tier", "priority", "times_sampled", "num_tokens", "num_generated"):
        if k in row:
            v = dict(row[k]) if k == "reward_components" and row[k] is not None else row[k]
            out.write(f"{k:<18} {v}\n")
    tokens, mask, logprobs = row.get("tokens") or [], row.get("loss_mask") or [], row.get("logprobs") or []
    turns = row.get("turns") or []
    segments = token_segments(turns, len(tokens))
    for title, turn, lo, hi in segments:
        out.write(paint(f"\n== {title}  tokens [{lo}, {hi})", "1") + "\n")
        if turn is not None and turn.get("tool_name"):
            out.write(paint(f"   tool {turn['tool_name']}({turn.get('tool_args') or ''})", "36") + "\n")
            out.write(f"   -> [{turn.get('tool_status')}] {turn.get('tool_result')!r}  "
                      f"({turn.get('latency_ms')} ms)\n")
        for i in range(lo, hi):
            piece = repr(tok.decode([tokens[i]])) if tok is not None else str(tokens[i])
            line = f"   {i:>6}  {piece:<12}  mask {mask[i] if i < len(mask) else '-'}  " \
                   f"logprob {logprobs[i] if i < len(logprobs) else float('nan'):.4f}"
            out.write((paint(line, "32") if i < len(mask) and mask[i] else paint(line, "2")) + "\n")
    return 0


def token_segments(turns: list[dict], num_tokens: int) -> list[tuple[str, dict | None, int, int]]:
    """(title, turn or None, start, end) covering the tokens: each turn, and the prompt or
    the tokens between and after the turns."""
    segments, pos = [], 0
    for k, t in enumerate(turns):
        if t["start"] > pos:
            segments.append(("prompt" if pos == 0 else "(between turns)", None, pos, t["start"]))
        segments.append((f"turn {k}: {t['role']}", t, t["start"], t["end"]))
        pos = t["end"]
    if pos < num_tokens:
        segments.append(("prompt" if pos == 0 else "(after the turns)", None, pos, num_tokens))
    return segments


def cmd_manifest(b, args, out) -> int:
    ids, versions = b.manifest(args.table, args.step)
    out.write(f"step {args.step}: {len(ids)} items\n")
    _print_rows(out, [{"item_id": int(i), "policy_version": int(v)} for i, v in zip(ids, versions)],
                ["item_id", "policy_version"])
    return 0


def cmd_audit(b, args, out) -> int:
    report = run_audit(b, args.table, args.reward, where=args.where, limit=args.limit, tolerance=args.tolerance,
                       workers=args.workers, item_timeout=args.item_timeout, progress=args.progress)
    out.write(report.format() + "\n")
    if args.out:
        if args.out.endswith(".parquet"):
            report.write_parquet(args.out)
        else:
            b.save(args.out, report.results)
        out.write(f"results: {args.out}\n")
    return 1 if report.failures > args.max_mismatch else 0


def run_audit(b, table: str, reward: str, *, where: str | None = None, limit: int | None = None,
              tolerance: float = 1e-6, workers: int | None = None, item_timeout: float = 30.0,
              progress: bool | None = None):
    """Audit the rows of ``table`` (``where``: a SQL condition; ``limit``: the lowest item
    ids) on backend ``b`` with ``expstore.audit``: what ``expstore audit`` and the console run."""
    from expstore import audit

    quoted = quote(table)
    where = f" WHERE {where}" if where else ""
    total = sum(b.query(f"SELECT count(*) AS n FROM {quoted}{where}").read_all().column(0).to_pylist())  # a row per shard
    if limit is not None:
        total = min(total, limit)
    # ORDER BY only with a limit: it makes the selection deterministic, but sorts it whole
    sql = f"SELECT * FROM {quoted}{where}" + (f" ORDER BY item_id LIMIT {int(limit)}" if limit is not None else "")
    try:
        return audit.audit(b.query(sql, limit or 0, timeout=AUDIT_STREAM_S), reward, tolerance=tolerance,
                           workers=workers, timeout=item_timeout, total=total, progress=progress)
    except ValueError as e:
        raise CliError(str(e)) from None


def quote(name: str) -> str:
    """A table name as a SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def cmd_replay(b, args, out) -> int:
    row = item(b, args.table, args.item_id)
    module = _import(args.tools, "--tools")
    registry = getattr(module, "TOOLS", None)
    calls = [(k, t) for k, t in enumerate(row.get("turns") or []) if t.get("tool_name")]
    if not calls:
        out.write(f"item {args.item_id}: no tool calls to replay\n")
        return 0
    first = None
    for k, t in calls:
        name, stored = t["tool_name"], t.get("tool_result")
        fn = registry.get(name) if isinstance(registry, dict) else getattr(module, name, None)
        if not callable(fn):
            got, note = None, f"no tool {name!r} in {args.tools}"
        else:
            try:
                got, note = str(fn(t.get("tool_args") or "")), None
            except Exception as e:
                got, note = None, f"raised {type(e).__name__}: {e}"
        same = note is None and got == stored
        out.write(f"turn {k}: {name}({_cell(t.get('tool_args'))}) {'same' if same else 'DIVERGED'}\n")
        if not same:
            first = k if first is None else first
            out.write(f"   stored: {stored!r}\n   now:    {note or repr(got)}\n")
            if note is None and stored is not None:
                at = next((i for i, (a, c) in enumerate(zip(stored, got)) if a != c), min(len(stored), len(got)))
                out.write(f"   first difference at character {at}\n")
    if first is None:
        out.write(f"all {len(calls)} tool calls reproduced\n")
        return 0
    out.write(f"first divergence: turn {first}\n")
    return 1


def cmd_checkpoint(b, args, out) -> int:
    infos = b.checkpoint(args.name)
    for shard, info in ({"": infos} if "uri" in infos else infos).items():  # sharded: one per shard
        out.write(f"{f'shard {shard}: ' if shard else ''}checkpoint {info['name']}: {info['num_bytes']} bytes "
                  f"to {info['uri']} in {info['seconds']:.2f} s\n")
    return 0


def cmd_export(b, args, out) -> int:
    from .export import ExportError, export

    try:
        result = export(lambda sql: b.query(sql, 0, EXPORT_STREAM_S), args.table, Path(args.out), fmt=args.format,
                        where=args.where, columns=args.columns, rows_per_shard=args.rows_per_shard,
                        progress=args.progress)
    except ExportError as e:
        raise CliError(str(e)) from None
    out.write(f"exported {result['rows']} rows of {args.table} to {result['out']} "
              f"({result['shards']} {args.format} shard{'s' if result['shards'] != 1 else ''})\n")
    return 0


def _import(name: str, flag: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise CliError(f"{flag} {name}: cannot import it: {e}") from None


def _load(spec: str, flag: str):
    module, _, attr = spec.partition(":")
    fn = getattr(_import(module, flag), attr, None) if attr else None
    if not callable(fn):
        raise CliError(f"{flag} {spec}: expected MODULE:CALLABLE")
    return fn


def _console(args) -> int:
    if args.data_dir or args.remote:
        raise CliError("console needs a running server (--server), not --data-dir or --remote")
    try:
        from .console.serve import run
    except ImportError as e:
        raise CliError(f"console needs the console extra (pip install 'expstore[console]'): {e}") from None
    return run(args)


COMMANDS = {"tables": cmd_tables, "describe": cmd_describe, "stats": cmd_stats, "query": cmd_query,
            "show": cmd_show, "manifest": cmd_manifest, "audit": cmd_audit, "replay": cmd_replay,
            "checkpoint": cmd_checkpoint, "export": cmd_export}


def error_message(e: BaseException, server: str) -> str:
    """One line for an error, as the CLI prints it (and the console shows it)."""
    import grpc

    if isinstance(e, grpc.RpcError):
        code = e.code()
        if code == grpc.StatusCode.UNAVAILABLE and "connect" in (e.details() or "").lower():
            return f"cannot reach the server at {server}: {e.details()}"
        return f"{code.name}: {e.details()}"
    text = " ".join(str(e).split()) or type(e).__name__
    return text


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, os.getcwd())  # reward functions, tools and tokenizers of the current project
    args = None
    try:
        args = build_parser().parse_args(argv)
        if args.command == "console":  # a session per browser token, not one backend
            return _console(args)
        backend = _backend(args)
        try:
            return COMMANDS[args.command](backend, args, sys.stdout)
        finally:
            backend.close()
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # never a traceback: one line
        sys.stderr.write(f"expstore: {error_message(e, args.server) if args is not None else e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
