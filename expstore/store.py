"""The store: the set of tables one server owns, and the data dir they persist in.

A registry lock guards the name -> table map only; each table has its own lock, so work
on one table never waits for another. With a data dir, the store opens its RocksDB (under
an exclusive lock: one server per dir), records each durable table's config in the meta
column family and restores every durable table at start. Memory-only tables are volatile.
``checkpoint`` snapshots the data dir and the versions of the tables' remote datasets as
of one instant (``expstore.checkpoint`` uploads them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable

from rocksdict import WriteBatch

from .errors import AlreadyExists, ExpstoreError, FailedPrecondition, NotFound
from .proto import arrow_ipc
from .spec import TableSpec
from .table import Storage, Table
from .tiers.rocks import Database

log = logging.getLogger("expstore.store")
_TABLE = b"table/"
_NEXT_TABLE_ID = b"next_table_id"


class Store:
    def __init__(self, data_dir: str | Path | None = None, *, seed: int | None = None,
                 remote: Callable[[str], object] | None = None, min_free_bytes: int = 0) -> None:
        self._tables: dict[str, Table] = {}
        self._lock = threading.Lock()
        self._seed = seed
        self._remote = remote
        self.db = Database(data_dir, min_free_bytes) if data_dir is not None else None
        self.restored: dict[str, dict[str, int]] = {}
        self.remote_error: str | None = None  # the last demotion failure, until one succeeds
        self._stop = threading.Event()
        self._mover: threading.Thread | None = None
        if self.db is not None:
            self._restore()

    # -- the mover: SSD -> remote demotion ----------------------------------------------

    def start_mover(self, interval_s: float = 1.0, max_backoff_s: float = 60.0) -> None:
        """Demote chunks of tables over their SSD watermark in the background. A failing
        remote tier is retried with exponential backoff; meanwhile ``remote_error`` says
        why (health reports degraded) and the data stays on the SSD."""
        def run():
            backoff = interval_s
            while not self._stop.wait(backoff):
                try:
                    while any(t.demote() + t.archive_pending() for t in self.tables()
                              if t.spec.tiers == "remote"):
                        if self._stop.is_set():
                            return
                    self.remote_error, backoff = None, interval_s
                except ExpstoreError as e:
                    if self.remote_error is None:
                        log.warning("remote tier unavailable, retrying with backoff: %s", e)
                    self.remote_error, backoff = str(e), min(max_backoff_s, backoff * 2)
        self._mover = threading.Thread(target=run, name="expstore-mover", daemon=True)
        self._mover.start()

    def create_table(self, spec: TableSpec, *, if_not_exists: bool = False) -> Table:
        """Create a table. With ``if_not_exists``, an existing table of the same spec is
        returned; one with a different spec is still ALREADY_EXISTS."""
        spec = spec.resolved(durable=self.db is not None)
        with self._lock:
            existing = self._tables.get(spec.name)
            if existing is not None:
                if if_not_exists and existing.spec == spec:
                    return existing
                detail = "with a different config" if if_not_exists else "already"
                raise AlreadyExists(f"table {spec.name!r} exists {detail}; drop it first or use another name")
            storage = None
            if spec.tiers != "memory":
                storage = Storage(self.db, self._next_table_id(), self._remote)
            table = self._open(spec, storage)
            if storage is not None:
                self._save(spec, storage.table_id)
            self._tables[spec.name] = table
            return table

    def drop_table(self, name: str) -> None:
        with self._lock:
            table = self._tables.pop(name, None)
            if table is None:
                raise NotFound(self._unknown(name))
            table.close()
            if table.storage is not None:
                table.purge()
                wb = WriteBatch(raw_mode=True)
                wb.delete(_TABLE + name.encode(), self.db.handle["meta"])
                self.db.write(wb, "wal")

    def table(self, name: str) -> Table:
        table = self._tables.get(name)
        if table is None:
            raise NotFound(self._unknown(name))
        return table

    def __contains__(self, name: str) -> bool:
        return name in self._tables

    def tables(self) -> list[Table]:
        with self._lock:
            return sorted(self._tables.values(), key=lambda t: t.name)

    def close(self) -> None:
        self._stop.set()
        if self._mover is not None:
            self._mover.join()
        for table in self.tables():
            table.close()
        if self.db is not None:
            self.db.close()
            self.db = None

    # -- checkpoints --------------------------------------------------------------------

    def checkpoint(self, path: str | Path) -> list[tuple[Table, object, int | None]]:
        """A RocksDB checkpoint of the data dir at ``path`` (a directory that must not
        exist yet) and, as of the same instant, the version of every remote dataset the
        tables use: ``(table, tier, version)`` per remote tier, version None where the
        dataset does not exist yet. Together they are what a crash at that instant would
        leave. Each tier is held (``RemoteTier.hold``: no cleanup of any version's files)
        until ``release``.

        No remote commit may be in flight at that instant, so it is taken holding every
        table's ``remote_lock``. They are taken without waiting (a demotion may hold one
        for seconds while it uploads, and holding the others meanwhile would stall their
        reads), after the memtables were flushed outside them: they are held for the few
        milliseconds of RocksDB's own checkpoint only."""
        if self.db is None:
            raise FailedPrecondition("a store without a data dir has nothing to checkpoint")
        for table in self._remote_tables():
            with table.remote_lock:  # reading a version opens its dataset: I/O, not with every lock held
                _ = [tier.version for tier in table.remote_tiers()]
        self.db.flush()
        while True:
            tables = self._remote_tables()
            locks = [t.remote_lock for t in tables]
            busy = _acquire_all(locks)
            if busy is not None:
                with busy:  # wait for it holding nothing, then try again
                    continue
            try:
                if self._remote_tables() != tables:  # a table was created or dropped meanwhile
                    continue
                self.db.checkpoint(path)
                held = [(t, tier, tier.version) for t in tables for tier in t.remote_tiers()]
                for _, tier, _ in held:
                    tier.hold()
                return held
            finally:
                for lock in locks:
                    lock.release()

    def release(self, held: list[tuple[Table, object, int | None]]) -> None:
        """Let the cleanup of the tiers ``checkpoint`` held go on."""
        for table, tier, _ in held:
            with table.remote_lock:
                tier.release()

    def _remote_tables(self) -> list[Table]:
        # Without the registry lock: drop_table holds it while it waits for a remote_lock.
        return sorted((t for t in self._tables.copy().values() if t.remote_tiers()), key=lambda t: t.name)

    # -- persistence ------------------------------------------------------------------

    def _open(self, spec: TableSpec, storage: Storage | None) -> Table:
        seed = None if self._seed is None else self._seed + len(self._tables)
        return Table(spec, seed=seed, storage=storage)

    def _save(self, spec: TableSpec, table_id: int) -> None:
        d = spec.to_dict()
        d.pop("columns", None)  # the schema travels as Arrow IPC: every type round-trips
        record = {"id": table_id, "spec": d,
                  "schema": arrow_ipc.encode_schema(spec.schema).hex() if spec.schema is not None else None}
        wb = WriteBatch(raw_mode=True)
        wb.put(_TABLE + spec.name.encode(), json.dumps(record).encode(), self.db.handle["meta"])
        self.db.write(wb, "wal")

    def _next_table_id(self) -> int:
        raw = self.db.get("meta", [_NEXT_TABLE_ID])[0]
        table_id = int(raw) if raw is not None else 1
        wb = WriteBatch(raw_mode=True)
        wb.put(_NEXT_TABLE_ID, str(table_id + 1).encode(), self.db.handle["meta"])
        self.db.write(wb, "wal")
        return table_id

    def _restore(self) -> None:
        for _, value in self.db.items("meta", _TABLE):
            record = json.loads(value)
            spec = TableSpec.from_dict(record["spec"])
            if record["schema"] is not None:
                spec = dataclasses.replace(spec, schema=arrow_ipc.decode_schema(bytes.fromhex(record["schema"])))
            started = time.perf_counter()
            table = self._open(spec, Storage(self.db, record["id"], self._remote))
            self.restored[spec.name] = result = table.restore()
            log.info("restored table %r: %d items from %d journal records in %.2f s%s", spec.name,
                     result["items"], result["records"], time.perf_counter() - started,
                     f"; {result['lost']} items acknowledged at durability 'memory' were lost"
                     if result["lost"] else "")
            self._tables[spec.name] = table

    def _unknown(self, name: str) -> str:
        known = sorted(self._tables)
        return f"no table {name!r} (tables: {', '.join(known) if known else 'none'})"


def _acquire_all(locks: list[threading.Lock]) -> threading.Lock | None:
    """Acquire every lock without waiting; at the first busy one, release those taken and
    return it."""
    for i, lock in enumerate(locks):
        if not lock.acquire(blocking=False):
            for taken in locks[:i]:
                taken.release()
            return lock
    return None
