"""Where the CLI reads from: a running server, a stopped server's data dir, or the Lance
datasets of a remote tier. Each backend answers the same calls (tables, describe, stats,
query, manifest, checkpoint, save, close), or refuses one with a CliError that says which
backend can; the commands never ask which backend they hold.

Not thread-safe: one command runs on one backend (the console holds one ``Online`` per
session).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from .errors import CliError


class Online:
    """A running server, or shards as ``HOST:PORT,HOST:PORT,...`` (``expstore_client.connect``)."""

    def __init__(self, args) -> None:
        from expstore_client import connect

        self.where = args.server
        self.client = connect(args.server, args.token, tls=args.tls_ca, timeout=args.timeout)  # "a,b": shards

    def tables(self) -> list[dict]:
        return [table_row(t.name, t.config, t.num_items, t.policy_version) for t in self.client.list_tables()]

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
        return [table_row(t.name, t.spec.to_dict(), len(t), t.policy_version) for t in self.store.tables()]

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


class RemoteDatasets:
    """``--remote URI``: the Lance datasets of a remote tier or archive directory, read-only
    (a table's remote chunks and its archive alike)."""

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


def table_row(name: str, config: dict, items: int, version: int) -> dict:
    """One line of ``expstore tables``."""
    return {"name": name, "kind": config.get("kind", "trajectory"), "items": items, "policy_version": version,
            "sampler": (config.get("sampler") or {}).get("type", "uniform"), "tiers": config.get("tiers", ""),
            "archive": bool(config.get("archive", False))}


def open_backend(args):
    """The backend the global options name: --data-dir, --remote, else --server."""
    if args.data_dir and args.remote:
        raise CliError("give --data-dir or --remote, not both")
    if args.data_dir:
        return Offline(args)
    if args.remote:
        return RemoteDatasets(args)
    return Online(args)
