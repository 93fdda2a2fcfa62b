"""The catalog: the set of tables one server owns, and the data dir they persist in.

A registry lock guards the name -> table map only; each table has its own lock, so work
on one table never waits for another. With a data dir, the catalog opens its RocksDB (under
an exclusive lock: one server per dir), records each durable table's config in the meta
column family and restores every durable table at start. Memory-only tables are volatile.
``checkpoint`` snapshots the data dir and the versions of the tables' remote datasets as
of one instant (``expstore.checkpoint`` uploads them).

A table that cannot be restored (its record, snapshot or journal fails its checksum, or
anything else goes wrong opening it) does not stop the others: it is logged, kept aside
in ``unopened`` with its data untouched, calls naming it fail with that error (DATA_LOSS
for damage), and DropTable deletes it.

The remote tier is not contacted at start: tables know from their journals what it holds,
and the mover (``start_mover``) reaches it in the background, so a server starts and
serves its memory and SSD tiers while the remote tier is down. The data dir records where
its remote tier is, and refuses to open with another one while a table keeps chunks there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from expstore_proto import arrow_ipc
from rocksdict import WriteBatch

from .errors import AlreadyExists, DataLoss, ExpstoreError, FailedPrecondition, NotFound, Unavailable
from .journal import Journal
from .parts import Backing
from .spec import TableSpec
from .table import Table
from .tiers.checksums import RemoteChecksums
from .tiers.rocks import CACHE_BYTES, MEMTABLE_BYTES, Database, RocksTier, table_prefix

log = logging.getLogger("expstore.catalog")
_TABLE = b"table/"
_NEXT_TABLE_ID = b"next_table_id"
_REMOTE = b"remote"


class Catalog:
    """``remote`` makes a table's remote tier (``remote(table_name)``); ``remote_uri`` says
    where it is, recorded in the data dir (``remote_in_data_dir``: the default location
    inside the data dir, which moves with it; ``remote_restored``: a checkpoint restore
    has just copied the tables' remote datasets there, so it replaces the one recorded).
    ``memtable_bytes`` and ``cache_bytes`` bound RocksDB's memory (``tiers.rocks``)."""

    def __init__(self, data_dir: str | Path | None = None, *, seed: int | None = None,
                 remote: Callable[[str], object] | None = None, min_free_bytes: int = 0,
                 remote_uri: str | None = None, remote_in_data_dir: bool = False,
                 remote_restored: bool = False, memtable_bytes: int = MEMTABLE_BYTES,
                 cache_bytes: int = CACHE_BYTES, direct_writes: bool = True) -> None:
        self._tables: dict[str, Table] = {}
        self._lock = threading.Lock()
        self._seed = seed
        self._remote = remote
        self.db = Database(data_dir, min_free_bytes, memtable_bytes=memtable_bytes, cache_bytes=cache_bytes,
                           direct_writes=direct_writes) if data_dir is not None else None
        self.restored: dict[str, dict[str, int]] = {}
        self.unopened: dict[str, Unopened] = {}  # tables that failed to restore, by name
        self.remote_error: str | None = None  # the last failure of the mover, until a pass succeeds
        self._stop = threading.Event()
        self._mover: threading.Thread | None = None
        # Journal snapshots are packed and written here, not under their table's lock.
        self._snapshots = ThreadPoolExecutor(1, thread_name_prefix="expstore-snapshots") \
            if self.db is not None else None
        if self.db is not None:
            try:
                if remote_uri is not None:
                    self._check_remote(remote_uri, remote_in_data_dir, remote_restored)
                self._restore()
            except BaseException:
                self.close()
                raise

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
                except BaseException as e:  # noqa: BLE001 - a bug, or a panic in a native library
                    # (pyo3's PanicException is a BaseException): a dead mover would let the
                    # SSD tier fill up unseen, so log it, report it and keep moving.
                    log.exception("mover pass failed; retrying with backoff")
                    self.remote_error = f"mover: {type(e).__name__}: {e}"
                    backoff = min(max_backoff_s, backoff * 2)
        self._mover = threading.Thread(target=run, name="expstore-mover", daemon=True)
        self._mover.start()

    def wait_for_snapshots(self) -> None:
        """Return once the journal snapshots taken so far are written (they are written
        while the tables' calls go on: a benchmark timing calls after building a large
        table waits for its snapshot first)."""
        if self._snapshots is not None:
            self._snapshots.submit(lambda: None).result()

    def create_table(self, spec: TableSpec, *, if_not_exists: bool = False) -> Table:
        """Create a table. With ``if_not_exists``, an existing table of the same spec is
        returned; one with a different spec is still ALREADY_EXISTS."""
        spec = spec.resolved(durable=self.db is not None)
        with self._lock:
            if spec.name in self.unopened:
                raise self.unopened[spec.name].error()
            existing = self._tables.get(spec.name)
            if existing is not None:
                if if_not_exists and existing.spec == spec:
                    return existing
                detail = "with a different config" if if_not_exists else "already"
                raise AlreadyExists(f"table {spec.name!r} exists {detail}; drop it first or use another name")
            storage = None
            if spec.tiers != "memory":
                storage = Backing(self.db, self._next_table_id(), self._remote, self._snapshots)
            table = self._open(spec, storage)
            if storage is not None:
                self._save(spec, storage.table_id)
            self._tables[spec.name] = table
            return table

    def drop_table(self, name: str) -> None:
        """Close a table and delete everything it stored, giving its disk space back before
        returning (never refused on a full disk; ``Database.reclaim``). If its remote tier
        is down, the error (UNAVAILABLE) leaves it registered, closed, with its data whole:
        a retried drop finishes it."""
        with self._lock:
            if name in self.unopened:
                self._purge_unopened(self.unopened.pop(name))
                return
            table = self._tables.get(name)
            if table is None:
                raise NotFound(self._unknown(name))
            table.close()
            table_id = None
            if table.storage is not None:
                table.purge()
                wb = WriteBatch(raw_mode=True)
                wb.delete(_TABLE + name.encode(), self.db.handle["meta"])
                self.db.write(wb, "wal")
                table_id = table.storage.table_id
            del self._tables[name]
        # The disk space, now (the advice on a full disk is to drop tables); not for a table
        # with damage found in it or unopened: compacting a damaged block stops RocksDB.
        if table_id is not None and not table.stats()["quarantined_chunks"]:
            try:
                self.db.reclaim(table_prefix(table_id), table_prefix(table_id + 1))
            except ExpstoreError as e:
                log.warning("dropped table %r; its disk space comes back with RocksDB's own compactions: %s", name, e)

    def table(self, name: str) -> Table:
        table = self._tables.get(name)
        if table is None:
            if name in self.unopened:
                raise self.unopened[name].error()
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
        if self._snapshots is not None:
            self._snapshots.shutdown(wait=True)  # snapshots taken before the close are written
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

    def _open(self, spec: TableSpec, storage: Backing | None) -> Table:
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

    def _check_remote(self, uri: str, in_data_dir: bool, restored: bool) -> None:
        """Refuse a remote tier other than the one the data dir's tables moved chunks to:
        restored against another, their items would be missing. A data dir without such
        tables, or just restored from a checkpoint into ``uri``, takes the new one."""
        raw = self.db.get("meta", [_REMOTE])[0]
        recorded = json.loads(raw) if raw is not None else None
        here = {"uri": uri, "in_data_dir": in_data_dir}
        if recorded == here:
            return
        moved = recorded is not None and recorded["uri"] != uri and not (recorded["in_data_dir"] and in_data_dir)
        if moved and not restored:
            specs = [json.loads(v)["spec"] for _, v in self._table_records() if v is not None]
            users = sorted(spec["name"] for spec in specs if spec.get("tiers") == "remote")
            if users:
                raise FailedPrecondition(
                    f"data dir {self.db.path} keeps chunks of tables {', '.join(users)} on the remote tier "
                    f"{recorded['uri']}, but the server was started with remote tier {uri}; start it with "
                    f"--remote-uri {recorded['uri']} (or [remote] uri): nothing was changed")
        wb = WriteBatch(raw_mode=True)
        wb.put(_REMOTE, json.dumps(here).encode(), self.db.handle["meta"])
        self.db.write(wb, "wal")

    def _restore(self) -> None:
        for key, value in self._table_records():
            name = key[len(_TABLE):].decode(errors="replace")
            table_id, table = None, None
            try:
                if value is None:
                    raise DataLoss(f"table {name!r}: its record in the SSD tier is damaged")
                record = json.loads(value)
                table_id = record["id"]
                spec = dict(record["spec"])
                if record["schema"] is not None:  # before validation: a generic table needs its schema
                    spec["schema"] = arrow_ipc.decode_schema(bytes.fromhex(record["schema"]))
                spec = TableSpec.from_dict(spec)
                started = time.perf_counter()
                table = self._open(spec, Backing(self.db, table_id, self._remote, self._snapshots))
                self.restored[spec.name] = result = table.restore()
            except Exception as e:  # one table that cannot be opened must not keep the others closed
                if table is not None:
                    table.close()
                self.unopened[name] = Unopened(name, table_id, e)
                log.error("table %r could not be restored; its data is kept, calls naming it fail "
                          "until it is dropped: %s: %s", name, type(e).__name__, e)
                continue
            log.info("restored table %r: %d items from %d journal records in %.2f s%s%s", spec.name,
                     result["items"], result["records"], time.perf_counter() - started,
                     f"; {result['lost']} items acknowledged at durability 'memory' were lost"
                     if result["lost"] else "",
                     f"; {result['quarantined']} items are quarantined (damaged)" if result["quarantined"] else "")
            self._tables[spec.name] = table

    def _table_records(self) -> list[tuple[bytes, bytes | None]]:
        """The table records, (key, value). When some sit in a damaged block the keys are
        listed with RocksDB's checksums off (a listing, never data), then each value is
        read checked; a damaged one comes back None."""
        try:
            return list(self.db.items("meta", _TABLE))
        except DataLoss:  # read them one by one
            pass
        out = []
        for key in self.db.keys_unverified("meta", _TABLE):
            try:
                out.append((key, self.db.get("meta", [key])[0]))
            except DataLoss:
                out.append((key, None))
        return out

    def _purge_unopened(self, t: "Unopened") -> None:
        """DropTable of a table that could not be opened: delete what its id owns in the
        SSD tier, what its remote datasets hold (if reachable), and its record."""
        if t.table_id is not None:
            Journal(self.db, t.table_id).drop()
            RocksTier(self.db, t.table_id).delete_all()
            RemoteChecksums(self.db, t.table_id).drop()
        if self._remote is not None:
            for name in (t.name, t.name + ".archive"):
                try:
                    tier = self._remote(name)
                    tier.delete(tier.chunk_ids())
                    tier.close()
                except ExpstoreError as e:
                    log.warning("dropping table %r: its remote dataset %r was not cleaned: %s", t.name, name, e)
        wb = WriteBatch(raw_mode=True)
        wb.delete(_TABLE + t.name.encode(), self.db.handle["meta"])
        self.db.write(wb, "wal")

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


@dataclasses.dataclass(frozen=True)
class Unopened:
    """A table that failed to restore at start: its name, its id (None when its record is
    unreadable) and the error."""

    name: str
    table_id: int | None
    cause: Exception

    def error(self) -> ExpstoreError:
        """What a call naming the table raises, naming the cause: DATA_LOSS for damage,
        UNAVAILABLE for a tier that is down, FAILED_PRECONDITION for anything else."""
        kind = next((k for k in (DataLoss, Unavailable) if isinstance(self.cause, k)), FailedPrecondition)
        return kind(f"table {self.name!r} could not be restored at start: {self.cause}; its data is "
                    f"kept: restore a checkpoint, or DropTable to delete it")
