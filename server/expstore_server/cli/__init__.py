"""``expstore``: look inside a store, query it with SQL, audit rewards, replay tool calls,
export a table for training-data pipelines.

Talks to a running server (``--server``, ``--token``), or reads data directly: a stopped
server's data dir (``--data-dir``: the Catalog opened under its lock) or a remote tier or
archive directory (``--remote``: its Lance datasets, read-only); ``console`` serves the same
views to a browser (``expstore_server.console``). Reward functions and tools run here, in
the CLI's processes, never in the server. Every error is one line on stderr,
``expstore: ...``, and exit code 2; ``audit`` and ``replay`` exit 1 when the data did not
reproduce. Documented in docs/cli.md (a test checks every flag is).

The package, one job a module:

- ``parser``: the global options and every command's flags;
- ``backends``: ``Online`` (a server or shards), ``Offline`` (a data dir),
  ``RemoteDatasets`` (``--remote``), one interface;
- ``catalog`` (tables, describe, stats, manifest), ``sql`` (query, export),
  ``trajectories`` (show, replay), ``rewards`` (audit: reward recomputation),
  ``server`` (checkpoint, console): the commands, each ``cmd_*(backend, args, out) -> exit code``;
- ``output``: the aligned table, CSV, JSON lines and Parquet writers;
- ``errors``: ``CliError`` and the one-line message of any error.

The names below are also what the console shares with the CLI.
"""

from __future__ import annotations

import os
import sys

from .backends import Offline, Online, RemoteDatasets, open_backend
from .catalog import cmd_describe, cmd_manifest, cmd_stats, cmd_tables
from .errors import CliError, error_message
from .output import csv_cell
from .parser import build_parser
from .rewards import cmd_reward_audit, run_reward_audit
from .server import cmd_checkpoint, run_console
from .sql import cmd_export, cmd_query, quote
from .trajectories import cmd_replay, cmd_show, item, token_segments

__all__ = ["COMMANDS", "CliError", "Offline", "Online", "RemoteDatasets", "build_parser", "csv_cell",
           "error_message", "item", "main", "quote", "run_reward_audit", "token_segments"]

COMMANDS = {"tables": cmd_tables, "describe": cmd_describe, "stats": cmd_stats, "query": cmd_query,
            "show": cmd_show, "manifest": cmd_manifest, "audit": cmd_reward_audit, "replay": cmd_replay,
            "checkpoint": cmd_checkpoint, "export": cmd_export}
"""Command name -> ``cmd(backend, args, out) -> exit code`` (``console`` runs apart)."""


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, os.getcwd())  # reward functions, tools and tokenizers of the current project
    args = None
    try:
        args = build_parser().parse_args(argv)
        if args.command == "console":  # a session per browser token, not one backend
            return run_console(args)
        backend = open_backend(args)
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
