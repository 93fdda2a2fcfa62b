"""The ``expstore`` command line: global options and every command's flags, in one place
(docs/cli.md documents each; a test checks that it does)."""

from __future__ import annotations

import argparse
import os

from .errors import CliError
from .output import TABLE_ROWS

DEFAULT_SERVER = "127.0.0.1:50051"


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
    from ..console.serve import add_arguments

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
