"""A table: item index + payload tier + sampler + remover + rate limiter + consumer groups.

Concurrency model: one ``threading.Condition`` per table guards all of its state. Every
public method takes it for a short, non-blocking critical section of numpy work; payload
rows are gathered from the (immutable) chunk batches *after* releasing it, and validation
of inserted data happens *before* taking it. Calls that may wait are attempts that never
block (``try_insert``, ``try_sample``, ``try_stream``: done, or a ``Wait``) repeated under a
waiter of the caller's kind (admission.py): the table's Condition for threads
(``insert``, ``sample``, ``stream`` with a timeout), ``subscribe`` notifications for the
asyncio server. The table owns admission; the rate limiter is arithmetic. Blocked inserts
and samples are admitted first come, first served, each kind in its own line
(``turns.py``, as Reverb does).

A held-back insert has already written its chunks to the SSD tier (``prepare_insert``,
before the first attempt); only its journal record waits for admission. See
docs/semantics.md ("Rate limiter") for why, and what a timeout or a crash leaves.

Bounds: ``max_size`` bounds items (the remover makes room). A volatile (memory-only)
table's memory budget bounds bytes: an insert that cannot fit is refused whole with
RESOURCE_EXHAUSTED. A durable table writes its chunks to the SSD tier before taking the
lock, logs every change in its journal under the lock (so the log order is the apply
order), and acknowledges after the log write at the requested durability; ``restore``
rebuilds it after a restart (see journal.py and placement.py).

Damage: every read of stored bytes is verified. The call whose read meets damage fails
with DataLoss naming the table, chunk and block, and the live items stored there are
quarantined at once (quarantine.py): no later call touches them, and the healthy items
of the same chunk are still served.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections import Counter
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import group_timeouts, ingest_checks, names, pacing, routed
from . import schema as protocol
from .errors import (DataLoss, DeadlineExceeded, ExpstoreError, FailedPrecondition, InvalidArgument,
                     NotFound, ResourceExhausted, Unavailable)
from .archive import ARCHIVE_SUFFIX, Archive
from .chunks import ChunkStore
from .gather import take_rows
from .group_timeouts import GroupTimeouts
from .ingest_checks import Checks, Lineage, References
from .index import COLUMNS, ItemIndex
from .journal import Journal
from .keys import KeyRegistry
from .pacing import Pacing, Reservation
from .placement import Placement, ReadPlan, Staged
from .quarantine import Event, Quarantine
from .ratelimit import RateLimiter
from .retention import Retention
from .samplers import make_remover, make_sampler
from .samplers.base import Codebook, Items
from .spec import TableSpec
from .streams import ConsumerGroup
from .tiers.checksums import ARCHIVE, RemoteChecksums
from .tiers.memory import MemoryTier
from .tiers.rocks import Database, RocksTier
from .admission import Admission, Wait
from .turns import Line, Turn

log = logging.getLogger("expstore.table")

DEFAULT_VISIBILITY_TIMEOUT = 60.0
MANIFESTS_IN_MEMORY = 10_000  # steps a volatile table remembers
# Samplers whose selections are i.i.d.: their rows may be returned in storage order.
_UNORDERED = ("uniform", "prioritized")
# Upper bounds (policy versions behind the table's) of the staleness counts in stats.
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class PreparedInsert:
    """Validated rows ready to commit: built outside the lock by ``prepare_insert``."""

    batches: list[pa.RecordBatch]
    keys: list[str] | None
    priorities: np.ndarray
    policy_versions: np.ndarray
    groups: pa.ChunkedArray | None  # group_id strings, for the group codebook
    group_sizes: np.ndarray
    tasks: pa.ChunkedArray | None
    rewards: np.ndarray
    durability: str = "memory"
    staged: list[Staged] = field(default_factory=list)  # one chunk per batch, until committed
    episodes: np.ndarray | None = None  # int64 episode hashes (ingest_checks.episode_hashes)
    data_versions: np.ndarray | None = None  # int64, the rows' data_version column
    references: References | None = None  # what the ingest checks compared the rows with
    reservations: np.ndarray | None = None  # uint64, the rows' reservation_id (pacing)

    @property
    def num_rows(self) -> int:
        return len(self.priorities)

    @property
    def nbytes(self) -> int:
        """What the rows cost the memory tier if all are stored."""
        return sum(b.get_total_buffer_size() for b in self.batches)


@dataclass(frozen=True)
class InsertResult:
    item_ids: np.ndarray  # uint64, one per row (the stored id for duplicates)
    num_inserted: int
    num_duplicates: int
    num_stale: int


@dataclass(frozen=True)
class PriorityUpdate:
    num_updated: int  # distinct live items whose priority was set
    unknown_item_ids: np.ndarray  # uint64: ids naming no live item, once each, in call order; ignored


@dataclass(frozen=True)
class Rows:
    """Rows out of a table (Sample, Stream, Get) with their per-row facts, row-aligned."""

    data: pa.RecordBatch
    item_ids: np.ndarray
    priorities: np.ndarray
    times_sampled: np.ndarray
    policy_versions: np.ndarray
    probabilities: np.ndarray | None = None
    weights: np.ndarray | None = None


@dataclass(frozen=True)
class Storage:
    """Where a durable table keeps its data: the server's RocksDB under ``table_id``, and
    the remote tier factory (``remote(table_name)``) when the table uses one."""

    db: Database
    table_id: int
    remote: Callable[[str], object] | None = None


class Table:
    def __init__(self, spec: TableSpec, *, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic, storage: Storage | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        """``clock`` times waits and deadlines of calls; ``wall_clock`` stamps
        ``inserted_at`` and times group timeouts (it must survive a restart)."""
        spec = spec.resolved(durable=storage is not None)
        self.spec = spec
        self.name = spec.name
        self.schema = protocol.table_schema(spec.kind, spec.schema, table=spec.name, added=spec.engine_columns())
        self._trajectory = spec.kind == "trajectory"
        self._clock = clock
        self._wall_clock = wall_clock
        self._rng = np.random.default_rng(seed)
        self._cond = threading.Condition()
        self._listeners: list[Callable[[], None]] = []
        self._epoch = 0  # changes so far: a waiter that saw an older count does not wait
        self._closed = False

        self._index = ItemIndex()
        durable = spec.tiers != "memory"
        if spec.tiers == "remote" and storage.remote is None:
            raise FailedPrecondition(f"table {self.name!r}: tiers = \"remote\" needs the server's "
                                     f"remote tier to be configured ([remote] uri)")
        self.storage = storage if durable else None
        self._journal = Journal(storage.db, storage.table_id) if durable else None
        self._replaying = False
        remote = spec.tiers == "remote"
        self._chunks = ChunkStore(Placement(
            MemoryTier(spec.memory_bytes),
            RocksTier(storage.db, storage.table_id) if durable else None,
            storage.remote(spec.name) if remote else None,
            ssd_budget=spec.ssd_bytes,
            checksums=RemoteChecksums(storage.db, storage.table_id) if remote else None))
        self._archive = Archive(storage.remote(spec.name + ARCHIVE_SUFFIX),
                                RemoteChecksums(storage.db, storage.table_id, ARCHIVE)) if spec.archive else None
        self._quarantine = Quarantine()
        self._keys = KeyRegistry(spec.dedup_window) if spec.key is not None else None
        self._tasks, self._groups = Codebook(), Codebook()
        self._sampler = make_sampler(spec.sampler, self._tasks)
        self._remover = make_remover(spec.remover)
        self._limiter = RateLimiter.from_spec(spec.rate_limiter)
        self._timeouts = GroupTimeouts(spec.group_timeout_s, spec.group_timeout_action) \
            if spec.group_timeout_s is not None else None
        self._checks = Checks(spec.ingest_checks, spec.name) if spec.ingest_checks else None
        self._lineage = Lineage()
        self._versioned = "data_version" in self.schema.names and spec.sampler.mixed
        self._lines = {"insert": Line(), "sample": Line(), "reserve": Line()}  # blocked calls, first come first served
        self._consumers: dict[str, ConsumerGroup] = {}
        self._manifests: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._prefetch_pool: ThreadPoolExecutor | None = None
        self._prefetching: set[int] = set()  # chunks being read ahead for streams

        # Samples the live items may still take under max_times_sampled (sum of allowances).
        self._allowance = 0
        self._touches = 0  # inserts and priority updates so far: the index's "touched" column
        self.policy_version = 0
        self.counters: Counter[str] = Counter()
        self._pacing = Pacing(spec.pacing.rollouts_per_version, spec.max_staleness, spec.pacing.lease_s,
                              spec.name, self.counters) if spec.pacing is not None else None
        self._retention = Retention(spec.hot_retention_s, spec.hot_retention_bytes, spec.retention_s,
                                    spec.retention_bytes) if spec.retains else None
        # Items returned by sample / stream per staleness bucket (the last: beyond them all).
        self._staleness = {op: np.zeros(len(STALENESS_BUCKETS) + 1, np.int64) for op in ("sample", "stream")}

    # -- inserts ----------------------------------------------------------------------

    def prepare_insert(self, data: Sequence[pa.RecordBatch | pa.Table] | pa.RecordBatch | pa.Table,
                       priorities: np.ndarray | Sequence[float] | None = None,
                       durability: str | None = None) -> PreparedInsert:
        """Conform and validate rows, and write their chunks to the SSD tier (no lock
        held). Raises InvalidArgument naming the table, row and column of the first
        problem; nothing is applied then. A prepared insert is committed (perhaps after
        retries) or abandoned."""
        durability = self._durability(durability)
        parts = [data] if isinstance(data, (pa.RecordBatch, pa.Table)) else list(data)
        if not parts:
            raise InvalidArgument(f"table {self.name!r}: insert of no rows")
        batches: list[pa.RecordBatch] = []
        offset = 0
        for part in parts:
            self._check_routed_experts(part, offset)
            t = protocol.conform(part, self.schema, table=self.name)
            if self._trajectory:
                protocol.validate_trajectories(t, table=self.name, row_offset=offset,
                                               vocab_size=self.spec.vocab_size)
                self._check_server_filled(t, offset)
                if self._checks is not None:
                    self._checks.check_rows(t, offset)
            offset += t.num_rows
            batches.extend(b for b in t.to_batches() if b.num_rows)
        if offset == 0:
            raise InvalidArgument(f"table {self.name!r}: insert of no rows")
        n = offset
        whole = pa.Table.from_batches(batches, schema=self.schema)
        pr = self._priorities(priorities, n)
        keys = None
        if self.spec.key is not None:
            key_col = whole.column(self.spec.key)
            keys = key_col.cast(pa.string()).to_pylist()
            self._check_keys(keys)  # across all parts of the call, not only within each
        if self._trajectory:
            groups = whole.column("group_id")
            group_sizes = whole.column("group_size").fill_null(0).to_numpy().astype(np.int64)
            self._check_group_sizes(group_sizes)
            episodes = ingest_checks.episode_hashes(whole)
            references = self._check_lineage(whole, episodes) if self._checks is not None else None
            prep = PreparedInsert(
                batches=batches, keys=keys, priorities=pr,
                policy_versions=whole.column("policy_version").to_numpy().astype(np.int64),
                groups=groups, group_sizes=group_sizes, tasks=whole.column("task"),
                rewards=whole.column("reward").cast(pa.float64()).fill_null(np.nan).to_numpy(),
                durability=durability, episodes=episodes, references=references,
                data_versions=self._data_versions(whole),
                reservations=None if self._pacing is None else self._pacing.check_rows(whole.column(pacing.COLUMN), 0))
        else:
            prep = PreparedInsert(
                batches=batches, keys=keys, priorities=pr, policy_versions=np.zeros(n, np.int64),
                groups=None, group_sizes=np.zeros(n, np.int64), tasks=None,
                rewards=np.full(n, np.nan), durability=durability)
        try:
            for b in batches:  # the SSD writes, outside the lock
                prep.staged.append(self._chunks.stage(b, durability))
        except BaseException:
            self.abandon_insert(prep)
            raise
        return prep

    def _check_routed_experts(self, part: pa.Table | pa.RecordBatch, offset: int) -> None:
        """Shapes and ids of ``routed_experts`` as sent, before the cast to its type
        (routed.py), so that errors name the row, token and layer."""
        spec = self.spec.routed_experts
        if spec is None or routed.COLUMN not in part.schema.names or "tokens" not in part.schema.names:
            return
        tokens = part.column("tokens")
        counts = pc.list_value_length(tokens).fill_null(0).to_numpy(zero_copy_only=False)
        routed.check(part.column(routed.COLUMN), counts.astype(np.int64), spec, table=self.name, row_offset=offset)

    def _check_server_filled(self, t: pa.Table, offset: int) -> None:
        """Columns the server fills on every read may not be written."""
        name = group_timeouts.COLUMN
        if self._timeouts is not None and t.column(name).null_count != t.num_rows:
            row = int(np.argmax(t.column(name).is_valid().to_numpy(zero_copy_only=False)))
            raise InvalidArgument(f"table {self.name!r}: row {offset + row}, column {name!r}: set by the server "
                                  f"on every read (group timeouts); leave it out of inserts")

    def _check_lineage(self, whole: pa.Table, episodes: np.ndarray) -> References:
        """The ingest checks "extends" and "group_prefix" (ingest_checks.py): references
        looked up under the lock, the stored ones read and compared outside it."""
        groups = whole.column("group_id").to_pylist() if "group_prefix" in self._checks.names \
            else [None] * whole.num_rows
        with self._cond:
            refs = self._lineage.references(episodes, groups, self._live)
        stored, stored_ids = None, np.zeros(0, np.uint64)
        if refs.ids:
            ids = np.array(refs.ids, np.uint64)
            try:
                with self._cond:
                    slots = self._index.lookup(ids)
                    stored_ids = ids[slots >= 0]
                    snap = self._snapshot(slots[slots >= 0])
                columns = [c for c in ingest_checks.REFERENCE_COLUMNS if c in self.schema.names]
                stored = pa.Table.from_batches([self._gather(snap, columns).data])
            except ExpstoreError as e:  # a tier down, damage: compare within the insert only
                log.warning("table %r: ingest checks compare within the insert only: %s", self.name, e)
                stored, stored_ids = None, np.zeros(0, np.uint64)
                with self._cond:
                    self.counters["ingest_unchecked"] += whole.num_rows
        self._checks.check_lineage(whole, episodes, refs, stored, stored_ids.tolist())
        return refs

    def _live(self, ids: np.ndarray) -> np.ndarray:
        """bool per item id: whether it is live (lock held)."""
        return self._index.lookup(np.asarray(ids, np.uint64)) >= 0

    def _data_versions(self, whole: pa.Table) -> np.ndarray | None:
        if not self._versioned:
            return None
        col = whole.column("data_version")
        return col.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)

    def insert(self, data, priorities=None, timeout: float | None = None,
               durability: str | None = None) -> InsertResult:
        """Validate and store rows, all or none. Blocks (up to ``timeout`` seconds; None:
        forever) while the rate limiter holds inserts back. Returns once the rows survive
        what ``durability`` promises (None: the table's default)."""
        prep = self.prepare_insert(data, priorities, durability)
        try:
            return self.commit_insert(prep, timeout)
        except BaseException:
            self.abandon_insert(prep)
            raise

    def commit_insert(self, prep: PreparedInsert, timeout: float | None = None) -> InsertResult:
        """Store prepared rows, waiting (this thread) up to ``timeout`` for admission;
        blocked inserts are admitted first come, first served (``turns.py``). After an
        error nothing was applied and the caller abandons the insert."""
        with Admission(self, "insert", timeout, self.turn("insert"), self._clock) as adm:
            while isinstance(outcome := self.try_insert(prep, adm.turn), Wait):
                self.wait_for_change(outcome.epoch, adm.limit(outcome))
        return outcome

    def try_insert(self, prep: PreparedInsert, turn: Turn) -> InsertResult | Wait:
        """One attempt to store prepared rows (admission.py): the result, or a ``Wait``
        while the rate limiter or earlier inserts in line hold it back. ``turn``
        (``Table.turn("insert")``) is the call's place in line, the same for all its
        attempts. Rows that are all duplicates complete the call without waiting."""
        with self._cond:
            line = self._lines["insert"]
            if (held := self._held(line, turn)) is not None:
                return held
            self._check_open()
            self._tick()
            ids, new = self._dedup(prep.keys, prep.num_rows)
            n_new = int(new.sum())
            if n_new == 0:
                self.counters["duplicates"] += prep.num_rows
                self._chunks.placement.delete([s.chunk_id for s in prep.staged])
                prep.staged.clear()
                return InsertResult(ids, 0, prep.num_rows, 0)
            self._limiter.check_insert_batch(n_new)
            if not line.first(turn):
                return Wait(f"{line.ahead_of(turn)} earlier inserts are waiting (first come, first served)",
                            self._epoch)
            if not self._limiter.can_insert(n_new):
                return Wait(f"rate limiter: {n_new} inserts must wait for samples", self._epoch)
            with self._admitted(line, turn):
                result = self._apply_insert(prep, prep.staged, ids, new, prep.durability)
            prep.staged.clear()
        if prep.durability == "fsync":
            self.storage.db.sync()  # one fsync covers every write before it: group commit
        return result

    def abandon_insert(self, prep: PreparedInsert) -> None:
        """Free the chunks of an insert that will not be committed."""
        if prep.staged:
            with self._cond:
                self._chunks.placement.delete([s.chunk_id for s in prep.staged])
                prep.staged.clear()

    def _durability(self, durability: str | None) -> str:
        if durability is None:
            return self.spec.durability
        if durability not in ("memory", "wal", "fsync"):
            raise InvalidArgument(f"table {self.name!r}: durability must be memory, wal or fsync, got {durability!r}")
        if durability != "memory" and self._journal is None:
            raise FailedPrecondition(f"table {self.name!r}: durability {durability!r} needs the SSD "
                                     f"tier; this table is memory-only (tiers = \"memory\")")
        return durability

    def _apply_insert(self, prep: PreparedInsert, staged: list[Staged], ids: np.ndarray,
                      new: np.ndarray, durability: str) -> InsertResult:
        n = prep.num_rows
        n_new = int(new.sum())
        if prep.references is not None:
            self._lineage.confirm(prep.references, self.name)
        stale = new & (prep.policy_versions < self._stale_cutoff())
        late = np.zeros(n, bool)  # members of groups that timed out
        if self._timeouts is not None:
            late = new & ~stale & self._timeouts.settled(_codes(self._groups, prep.groups, n))
        store = new & ~stale & ~late
        n_store = int(store.sum())
        if n_store > self.spec.max_size:
            raise InvalidArgument(f"table {self.name!r}: an insert of {n_store} rows exceeds "
                                  f"max_size={self.spec.max_size}; split it")
        # Each prepared batch is one chunk; rows of duplicates or stale rows are dead in
        # it from the start (a volatile table drops them first: its bytes are the budget).
        offsets = np.cumsum([0] + [b.num_rows for b in prep.batches])
        chunks: list[tuple[int, int, Staged]] = []
        unused: list[int] = []
        for s, lo, hi in zip(staged, offsets[:-1].tolist(), offsets[1:].tolist()):
            keep = store[lo:hi]
            if not keep.any():
                unused.append(s.chunk_id)
            elif keep.all() or self._journal is not None:
                chunks.append((lo, hi, s))
            else:
                chunks.append((lo, hi, Staged(s.chunk_id, s.batch.filter(pa.array(keep)))))
        nbytes = sum(s.batch.get_total_buffer_size() for _, _, s in chunks)
        # Chosen before the new rows enter: the remover never evicts a row of this insert
        # (Reverb's code inserts first, then removes; its docs say what we do).
        victims = self._victims(len(self._index) + n_store - self.spec.max_size)
        if self._journal is None:
            self._check_budget(nbytes, victims)
        chunk_of_row = np.full(n, -1, dtype=np.int64)
        row_in_chunk = np.zeros(n, dtype=np.int64)
        for lo, hi, s in chunks:
            keep = store[lo:hi]
            chunk_of_row[lo:hi][keep] = s.chunk_id
            row_in_chunk[lo:hi][keep] = np.flatnonzero(keep) if s.batch.num_rows == hi - lo \
                else np.arange(int(keep.sum()))
        # Index every new row; stale ones are removed again at once (ids stay unique).
        new_rows = np.flatnonzero(new)
        rows = dict(
            chunk=chunk_of_row[new_rows], row=row_in_chunk[new_rows],
            priority=prep.priorities[new_rows], policy_version=prep.policy_versions[new_rows],
            inserted_at=np.full(n_new, self._wall_clock()), group_size=prep.group_sizes[new_rows],
            reward=prep.rewards[new_rows])
        for name, values in (("episode", prep.episodes), ("data_version", prep.data_versions)):
            if values is not None:
                rows[name] = values[new_rows]
        groups = prep.groups.take(pa.array(new_rows)) if prep.groups is not None else None
        tasks = prep.tasks.take(pa.array(new_rows)) if prep.tasks is not None else None
        keys = [prep.keys[i] for i in new_rows.tolist()] if prep.keys is not None else None
        new_ids = np.arange(self._index.next_id, self._index.next_id + n_new, dtype=np.uint64)
        reservations = None if prep.reservations is None else prep.reservations[new_rows]
        if self._journal is not None:  # logged first: a failed write changes nothing
            self._log("insert", durability, insert_durability=durability, ids=new_ids, stored=store[new_rows],
                      **({} if reservations is None else {"reservations": reservations}),
                      keys=keys, groups=None if groups is None else groups.to_pylist(),
                      tasks=None if tasks is None else tasks.to_pylist(),
                      victims=self._index["id"][victims], **rows)
        # From here on the insert is applied whole.
        self._remove(victims, "max_size", log=False)
        self._chunks.placement.delete(unused)
        for lo, hi, s in chunks:
            self._chunks.add(s, live=int(store[lo:hi].sum()))
        ids[new_rows] = new_ids
        if reservations is not None:
            self._pacing.settle(reservations)
        self._add_items(new_ids, rows, groups, tasks, keys, store[new_rows], late[new_rows])
        if prep.references is not None:
            kept = store[new_rows]
            names = groups.to_pylist() if "group_prefix" in self._checks.names else [None] * n_new
            self._lineage.record(rows.get("episode", np.zeros(n_new, np.int64))[kept],
                                 [g for g, k in zip(names, kept.tolist()) if k], new_ids[kept], prep.references)
            self._lineage.purge(self._live, len(self._index))
        self.counters["inserted_bytes"] += nbytes
        self.counters["duplicates"] += n - n_new
        self._maybe_compact()
        self._changed()
        return InsertResult(ids, n_new, n - n_new, int((stale & new).sum()))

    def _add_items(self, ids: np.ndarray, rows: dict[str, np.ndarray], groups, tasks,
                   keys: list[str] | None, stored: np.ndarray, late: np.ndarray | None = None) -> None:
        """Index new items and offer the stored ones to the selectors (insert and replay).
        Rows not stored are stale, or ``late`` (their group timed out)."""
        n = len(ids)
        slots, _ = self._index.add(n, ids=ids, group=_codes(self._groups, groups, n),
                                   task=_codes(self._tasks, tasks, n), **rows)
        self._index["touched"][slots] = self._touch(n)
        if self._keys is not None:
            self._keys.add(slots, keys, ids)
        items = self._items(slots[stored])
        self._sampler.insert(items)
        self._remover.insert(items)
        self._allowance += self.spec.max_times_sampled * len(items)
        # Rows too stale to store never count for the rate limiter: counted as inserts no
        # sample could ever match, they would hold producers back while the sampler starves.
        self._limiter.insert(int(stored.sum()))
        if self._timeouts is not None:
            self._timeouts.arrived(self._index["group"][slots[stored]], rows["inserted_at"][stored])
        if not stored.all():  # never in a tier or a selector
            late = np.zeros(n, bool) if late is None else late
            self._forget(slots[~stored & ~late], "stale", limited=False)
            self._forget(slots[late], "group_late", limited=False)
        self._remove(self._sampler.rejected(), "zero_variance", log=False)  # replay redoes it
        self.counters["inserts"] += n

    # -- sampling ---------------------------------------------------------------------

    def sample(self, n: int, timeout: float | None = None, step: int | None = None,
               data_versions: dict | None = None) -> Rows:
        """Sample n items with the table's sampler. Blocks (up to ``timeout``; None:
        forever) until the rate limiter and the sampler can serve n; blocked samples are
        served first come, first served. With ``step``, the batch's manifest (item ids,
        policy versions) is recorded under that training step. ``data_versions``
        (``{task: (lo, hi)}``, ``"*"`` for the others; task mixing only) samples only rows
        whose data_version is in range (samplers/mixture.py). A group sampler's batch holds
        ``n / group_size`` groups: fewer rows than n when some were released partial
        (group timeouts)."""
        with Admission(self, "sample", timeout, self.turn("sample"), self._clock) as adm:
            while isinstance(outcome := self.try_sample(n, adm.turn, step, data_versions), Wait):
                self.wait_for_change(outcome.epoch, adm.limit(outcome))
        return outcome

    def try_sample(self, n: int, turn: Turn, step: int | None = None,
                   data_versions: dict | None = None) -> Rows | Wait:
        """One attempt to sample n items (admission.py): the rows (gathered after the
        lock is released), or a ``Wait`` while the rate limiter, the sampler or earlier
        samples in line hold it back (``retry_after``: when the next forming group times
        out). ``turn`` and ``data_versions`` as in ``try_insert`` and ``sample``."""
        if step is not None and step < 0:
            raise InvalidArgument(f"table {self.name!r}: step must be >= 0, got {step}")
        if n < 1:
            raise InvalidArgument(f"table {self.name!r}: batch_size must be >= 1, got {n}")
        self._check_sample_size(n)
        kw = self._version_ranges(data_versions)
        with self._cond:
            line = self._lines["sample"]
            if (held := self._held(line, turn)) is not None:
                return held
            self._check_open()
            self._tick()
            self._limiter.check_sample_batch(n)  # re-checked: other calls move the limit
            if not line.first(turn):
                return Wait(f"{line.ahead_of(turn)} earlier samples are waiting (first come, first served)",
                            self._epoch)
            if not self._limiter.can_sample(n):
                return Wait(f"rate limiter: {n} samples must wait for inserts ({len(self._index)} items)",
                            self._epoch)
            if not (self._sampler.can_sample(n, **kw) and (not self.spec.max_times_sampled or self._allowance >= n)):
                why = f"the {self.spec.sampler.type} sampler cannot serve {n} items yet ({len(self._sampler)} eligible)"
                detail = self._sampler.explain(n, **kw)
                return Wait(why + (f": {detail}" if detail else ""), self._epoch,
                            retry_after=self._next_group_timeout())
            with self._admitted(line, turn):
                rows = self._sample_now(n, step, kw)
        return self._gather(rows)

    def _version_ranges(self, data_versions: dict | None) -> dict:
        """The sampler's keyword for a data version restriction (none: {})."""
        if data_versions is None:
            return {}
        if not self.spec.sampler.mixed:
            raise InvalidArgument(f"table {self.name!r}: data_versions needs task mixing (sampler.task_weights "
                                  f"or sampler.task_quotas) and a data_version column")
        ranges = {}
        for task, bounds in data_versions.items():
            try:
                lo, hi = bounds
                ranges[str(task)] = (None if lo is None else int(lo), None if hi is None else int(hi))
            except (TypeError, ValueError):
                raise InvalidArgument(f"table {self.name!r}: data_versions[{task!r}] must be a (min, max) pair "
                                      f"of integers or None, got {bounds!r}") from None
            if None not in ranges[str(task)] and ranges[str(task)][0] > ranges[str(task)][1]:
                raise InvalidArgument(f"table {self.name!r}: data_versions[{task!r}]: min {lo} exceeds max {hi}")
        return {"versions": ranges}

    def _sample_now(self, n: int, step: int | None, kw: dict) -> "_Snapshot":
        """Draw an admitted sample of n (lock held): selection, times_sampled, removals
        under max_times_sampled, the journal record and the rows' read plan."""
        capped = self.spec.max_times_sampled > 0
        if capped and self.spec.sampler.type in _UNORDERED:
            slots, probabilities, weights, done = self._sample_capped(n, kw)
        else:
            sel = self._sampler.sample(n, self._rng, **kw)
            slots, probabilities, weights = sel.slots, sel.probabilities, sel.weights
            np.add.at(self._index["times_sampled"], slots, 1)  # slots repeat for i.i.d. samplers
            done = slots[self._index["times_sampled"][slots] >= self.spec.max_times_sampled] \
                if capped else slots[:0]
            if len(done):
                self._sampler.remove(done)
        if self.spec.sampler.type in _UNORDERED:
            order = np.lexsort((self._index["row"][slots], self._index["chunk"][slots]))
            slots, probabilities, weights = slots[order], probabilities[order], weights[order]
        self._log("sampled", ids=self._index["id"][slots], n=len(slots))
        self._sampled(len(slots))  # fewer than n: groups released partial
        self._record_staleness("sample", slots)
        if step is not None:
            self._record_manifest(step, slots)
        rows = self._snapshot(slots, probabilities=probabilities, weights=weights)
        self._remove(done, "max_times_sampled", in_sampler=False)
        self._changed()
        return rows

    # -- group timeouts (group_timeouts.py) ------------------------------------------

    def _tick(self) -> None:
        """Settle the groups whose timeout passed (lock held): journaled, then applied."""
        if self._closed:
            return
        if self._pacing is not None:
            self._expire_reservations()
        if self._retention is not None:  # the hot window (retention.py)
            left = 0
            for slots in self._retention.leaving(self._index, lambda: self._chunks.nbytes, self._wall_clock()):
                self._remove(slots, "retention")
                left += len(slots)
            if left:
                self._changed()
        if self._timeouts is None:
            return
        due = self._timeouts.due(self._wall_clock())
        if len(due) == 0:
            return
        forming = self._sampler.forming(due)  # the others completed in time, or broke
        if len(forming):
            action = self.spec.group_timeout_action
            self._log("group_timeout", groups=[self._groups.name(c) for c in forming.tolist()], action=action)
            self._settle(forming, action)
            self._changed()

    def _settle(self, codes: np.ndarray, action: str) -> None:
        """Time out forming groups (lock held; replay too): release them, their members'
        group_size corrected to what arrived, or drop their members."""
        codes, slots = self._sampler.expire(codes, release=action == "release")
        self._timeouts.settle(codes, action)
        if action == "release":
            _, group, arrived = np.unique(self._index["group"][slots], return_inverse=True, return_counts=True)
            self._index["group_size"][slots] = arrived[group]
            self.counters["group_timeouts_released"] += len(codes)
            self._remove(self._sampler.rejected(), "zero_variance", log=False)  # drop_zero_variance
        else:
            self._remove(slots, "group_timeout", log=False)
            self.counters["group_timeouts_dropped"] += len(codes)

    def _next_group_timeout(self) -> float | None:
        """Seconds until the next group timeout, if any (a waiting sample retries then)."""
        if self._timeouts is None:
            return None
        deadline = self._timeouts.next_deadline()
        return None if deadline is None else max(0.0, deadline - self._wall_clock()) + 1e-3

    # -- paced admission (pacing.py) ---------------------------------------------------

    def reserve(self, n: int, timeout: float | None = None, lease_s: float | None = None) -> Reservation:
        """Reserve admission for a rollout of ``n`` rows before starting it (paced
        tables). Blocks (up to ``timeout``; None: forever) while the pace holds it back;
        blocked reservations are granted first come, first served."""
        with Admission(self, "reserve", timeout, self.turn("reserve"), self._clock) as adm:
            while isinstance(outcome := self.try_reserve(n, adm.turn, lease_s), Wait):
                self.wait_for_change(outcome.epoch, adm.limit(outcome))
        return outcome

    def try_reserve(self, n: int, turn: Turn, lease_s: float | None = None) -> Reservation | Wait:
        """One attempt to reserve (admission.py): the reservation, or a ``Wait`` while the
        pace or earlier reservations in line hold it back (``retry_after``: when the next
        lease ends and gives its rows back)."""
        pace = self._paced()
        pace.check(n, lease_s)
        with self._cond:
            line = self._lines["reserve"]
            if (held := self._held(line, turn)) is not None:
                return held
            self._check_open()
            self._tick()
            if not line.first(turn):
                return Wait(f"{line.ahead_of(turn)} earlier reservations are waiting (first come, first served)",
                            self._epoch)
            if not pace.can_grant(n, self.policy_version):
                deadline = pace.next_deadline()
                return Wait(pace.why(n, self.policy_version), self._epoch,
                            retry_after=None if deadline is None else max(0.0, deadline - self._wall_clock()) + 1e-3)
            with self._admitted(line, turn):
                r = pace.offer(n, self.policy_version, self._wall_clock(), lease_s)
                self._log("reserve", id=r.id, n=r.count, deadline=r.deadline, version=r.policy_version)
                pace.grant(r)
                self._changed()
            return r

    def release(self, reservation_id: int) -> int:
        """Give back a reservation's rows not inserted yet (a rollout abandoned); returns
        how many. A reservation already settled, released or expired gives back 0."""
        pace = self._paced()
        rid = int(reservation_id)
        pace.check_release(rid)
        with self._cond:
            self._check_open()
            self._tick()
            if rid not in pace:
                return 0
            self._log("release", id=rid, reason="released")
            freed = pace.release(rid)
            self._changed()
            return freed

    def _expire_reservations(self) -> None:
        """Give back the unused rows of reservations whose lease ended (lock held)."""
        due = self._pacing.due(self._wall_clock())
        for rid in due:
            self._log("release", id=rid, reason="expired")
            self._pacing.release(rid, "expired")
        if due:
            self._changed()

    def _paced(self) -> Pacing:
        if self._pacing is None:
            raise FailedPrecondition(f"table {self.name!r} does not pace admission (create it with pacing = "
                                     f"{{rollouts_per_version = B}} and max_staleness)")
        return self._pacing

    def _touch(self, n: int) -> np.ndarray:
        """The next n values of the insert-or-update counter (index column "touched")."""
        out = np.arange(self._touches, self._touches + n, dtype=np.int64)
        self._touches += n
        return out

    def _sampled(self, n: int) -> None:
        if self.spec.max_times_sampled:
            self._allowance -= n
        self._limiter.sample(n)
        self.counters["samples"] += n

    def _record_staleness(self, op: str, slots: np.ndarray) -> None:
        """Count returned items by how many policy versions they are behind the table's
        (ahead of it counts as 0): one vectorised bucketing per batch, for the stats."""
        behind = np.maximum(self.policy_version - self._index["policy_version"][slots], 0)
        self._staleness[op] += np.bincount(np.searchsorted(STALENESS_BUCKETS, behind),
                                           minlength=len(STALENESS_BUCKETS) + 1)
        self.counters[f"staleness.{op}.sum"] += int(behind.sum())

    def _sample_capped(self, n: int, kw: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Sample with replacement while no item exceeds max_times_sampled, as Reverb's
        one-at-a-time sampling would: draws beyond an item's allowance are rejected, items
        that reach it leave the sampler, and the rejected draws are redrawn. Each round
        accepts at least one draw. Returns (slots, probabilities, weights, exhausted)."""
        ts, cap = self._index["times_sampled"], self.spec.max_times_sampled
        parts, exhausted, left = [], [], n
        while left:
            sel = self._sampler.sample(left, self._rng, **kw)
            keep = occurrence_rank(sel.slots) < cap - ts[sel.slots]
            taken = sel.slots[keep]
            np.add.at(ts, taken, 1)
            parts.append((taken, sel.probabilities[keep], sel.weights[keep]))
            left -= len(taken)
            done = np.unique(taken[ts[taken] >= cap])
            self._sampler.remove(done)
            exhausted.append(done)
        slots, probabilities, weights = (np.concatenate(x) for x in zip(*parts))
        return slots, probabilities, weights, np.concatenate(exhausted)

    def update_priorities(self, item_ids, priorities) -> PriorityUpdate:
        """Set the priorities of the live items among ``item_ids``, in call order (the
        last entry wins for a repeated id). Ids of items that left (or never were) are
        ignored and reported, as Reverb ignores them: a trainer updating the batch it
        sampled still updates the items that remain when some have been removed since."""
        ids = self._ids(item_ids)
        pr = self._priorities(priorities, len(ids), required=True)
        with self._cond:
            slots = self._index.lookup(ids)
            unknown = ids[slots < 0]
            _, first = np.unique(unknown, return_index=True)
            unknown = unknown[np.sort(first)]
            at = np.flatnonzero(slots >= 0)  # positions of live ids in the call
            # The last entry of each slot, applied in call order (heap ties: least
            # recently updated first, so the order within a call matters).
            _, from_end = np.unique(slots[at][::-1], return_index=True)
            at = np.sort(at[len(at) - 1 - from_end])
            slots, pr = slots[at], pr[at]
            if len(slots):
                self._log("priority", ids=self._index["id"][slots], priorities=pr)
                self._set_priorities(slots, pr)
                self._changed()
            return PriorityUpdate(len(slots), unknown)

    def _set_priorities(self, slots: np.ndarray, pr: np.ndarray) -> None:
        """Set priorities (distinct slots), in the order given: heap ties go to the least
        recently touched item."""
        self._index["priority"][slots] = pr
        self._index["touched"][slots] = self._touch(len(slots))
        self._sampler.update(slots, pr)
        self._remover.update(slots, pr)
        self.counters["priority_updates"] += len(slots)

    def set_policy_version(self, version: int) -> int:
        """Set the trainer's current policy version; with max_staleness, remove items that
        fell behind it. Versions never decrease. Returns the number removed."""
        if version < 0:
            raise InvalidArgument(f"table {self.name!r}: policy version must be >= 0, got {version}")
        with self._cond:
            if version < self.policy_version:
                raise FailedPrecondition(f"table {self.name!r}: policy version must not decrease "
                                         f"(current {self.policy_version}, got {version})")
            self._log("version", version=version)
            self.policy_version = version
            stale = np.zeros(0, dtype=np.int64)
            if self._stale_cutoff() >= 0:  # else nothing can be stale: skip the O(n) scan
                live = self._index.live_slots()
                stale = live[self._index["policy_version"][live] < self._stale_cutoff()]
                self._remove(stale, "stale")
            self._changed()
            return len(stale)

    # -- streams ----------------------------------------------------------------------

    def stream(self, group: str, n: int, timeout: float | None = None,
               visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT, start: str = "earliest") -> Rows:
        """Deliver up to n items to a consumer group, in insertion order: first redeliveries
        of expired unacked items, then unread ones. Blocks (up to ``timeout``) until at
        least one is available."""
        with Admission(self, "stream", timeout, clock=self._clock) as adm:
            while isinstance(outcome := self.try_stream(group, n, visibility_timeout, start), Wait):
                self.wait_for_change(outcome.epoch, adm.limit(outcome))
        return outcome

    def try_stream(self, group: str, n: int, visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
                   start: str = "earliest") -> Rows | Wait:
        """One attempt to deliver to a consumer group (admission.py): the rows, or a
        ``Wait`` while the group is caught up (``retry_after``: when its next unacked
        item falls due for redelivery)."""
        if n < 1:
            raise InvalidArgument(f"table {self.name!r}: batch_size must be >= 1, got {n}")
        self._check_group_name(group)
        if visibility_timeout <= 0:
            raise InvalidArgument(f"table {self.name!r}: visibility_timeout must be > 0")
        if start not in ("earliest", "latest"):
            raise InvalidArgument(f"table {self.name!r}: start must be 'earliest' or 'latest', got {start!r}")
        with self._cond:
            g = self._consumers.get(group) or self._new_group(group, start)
            self._check_open()
            now = self._clock()
            again = g.expired(now, n)
            again_slots = self._index.lookup(again)
            if (again_slots < 0).any():
                self._log("forget", group=group, ids=again[again_slots < 0])
                g.forget(again[again_slots < 0])
            again, again_slots = again[again_slots >= 0], again_slots[again_slots >= 0]
            fresh_slots = self._index.slots_from(g.position, n - len(again))
            if not len(again) and not len(fresh_slots):
                nd = g.next_deadline()
                return Wait(f"consumer group {group!r} is caught up", self._epoch,
                            retry_after=None if nd is None else max(0.0, nd - now))
            fresh = self._index["id"][fresh_slots]
            self._log("deliver", group=group, fresh=fresh, again=again,
                      deadline=time.time() + visibility_timeout)
            g.deliver(fresh, again, now + visibility_timeout)
            slots = np.concatenate([again_slots, fresh_slots])
            self.counters["stream_deliveries"] += len(slots)
            self._record_staleness("stream", slots)
            rows = self._snapshot(slots)
            if self._chunks.placement.durable:  # the chunks of the next 2n unread items
                self._read_ahead(np.unique(self._index["chunk"][self._index.slots_from(g.position, 2 * n)]).tolist())
            self._changed()
        return self._gather(rows)

    def _read_ahead(self, chunks: list[int], *, if_room: bool = False) -> None:
        """Load chunks that are not in memory into the memory cache in the background
        (lock held): a stream's next chunks, or (``if_room``) chunks a sample read from the
        SSD while the cache has room for them, so a restarted table warms up. Not when they
        would take more than half the cache: they would be evicted before they are read
        (a stream from a small cache read every chunk twice, 227 ms a batch instead of ~100)."""
        placement = self._chunks.placement
        ahead = [c for c in chunks if c in self._chunks and not placement.resident(c) and c not in self._prefetching]
        size = sum(map(self._chunks.size_of, ahead))
        if size > placement.memory.budget // 2:  # it would evict itself before it is read: read twice
            return
        if if_room and placement.memory.nbytes + size > placement.memory.budget:
            return
        if ahead:
            self._prefetching.update(ahead)
            placement.pin(ahead)
            self._prefetcher().submit(self._prefetch, ahead)

    def _prefetcher(self):
        if self._prefetch_pool is None:
            self._prefetch_pool = ThreadPoolExecutor(1, thread_name_prefix=f"prefetch-{self.name}")
        return self._prefetch_pool

    def _prefetch(self, chunks: list[int]) -> None:
        """Read chunks a stream will need next into the memory cache (a background thread;
        the chunks are pinned), so consumers of a cold stream do not wait on the disk."""
        placement = self._chunks.placement
        damaged = None
        try:
            batches = placement.get(chunks)
        except DataLoss as e:  # quarantined now: the stream's own read will not meet it
            batches, damaged = {}, e
        except ExpstoreError:  # e.g. the remote tier is down: the read itself will report it
            batches = {}
        with self._cond:
            if damaged is not None:
                self._quarantine_damage(damaged)
            for c, batch in batches.items():
                if c in self._chunks and not placement.resident(c):
                    placement.memory.put(c, batch)
                    placement.counters["prefetched"] += 1
            placement.evict()
            placement.unpin(chunks)
            self._prefetching.difference_update(chunks)

    def ack(self, group: str, item_ids) -> tuple[int, int]:
        """Ack items delivered to a group; (newly acked, already acked). An id never
        delivered to the group is NOT_FOUND and nothing is acked."""
        ids = self._ids(item_ids)
        with self._cond:
            g = self._group(group)
            g.check_ack(ids, self.name)
            self._log("ack", group=group, ids=ids)
            result = g.ack(ids)
            self._changed()
            return result

    def commit_cut(self, group: str, step: int, item_ids=(), tag: str = "") -> int:
        """A trainer's training cut, atomically: ack ``item_ids`` (what step ``step``
        consumed), remember the group's position under ``step``, and record the ids
        (with their policy versions; -1 for an item no longer in the table) as step
        ``step``'s manifest, replacing what an earlier commit of ``step`` recorded (a
        retried commit, or a step trained again after ``resume``). Returns the number
        newly acked. ``resume(group, step)`` later redelivers exactly what came after.
        A cut with no ids creates a group that has not read yet (at the earliest item),
        so that a trainer can mark step 0 before its first read."""
        ids = self._ids(item_ids)
        if step < 0:
            raise InvalidArgument(f"table {self.name!r}: step must be >= 0, got {step}")
        with self._cond:
            g = self._consumers.get(group)
            if g is None and not len(ids):
                g = self._new_group(group, "earliest")
            g = g or self._group(group)
            g.check_ack(ids, self.name)
            versions = self._versions_of(ids)
            self._log("cut", self.spec.durability, manifest=(step, ids, versions),
                      group=group, step=step, tag=tag, ids=ids)
            if self._journal is None:
                self._manifests[step] = [(ids, versions)]
            acked, _ = g.ack(ids)
            g.cut(step, tag)
            self._changed()
        if self.spec.durability == "fsync":
            self.storage.db.sync()
        return acked

    def resume(self, group: str, step: int) -> dict[str, int]:
        """Rewind a consumer group to its cut at ``step``: what was in flight then is
        delivered again first, then everything after the cut's position, acked or not
        (a trainer restarting from its step-``step`` checkpoint retrains step+1 on).
        The manifests of later steps are forgotten: those steps will be trained again."""
        with self._cond:
            g = self._group(group)
            g.check_cut(step, self.name)
            self._log("resume", drop_manifests_after=step, group=group, step=step)
            if self._journal is None:
                self._manifests = {s: m for s, m in self._manifests.items() if s <= step}
            g.resume(step)
            self._changed()
            return {"position": g.position, "inflight": len(g.inflight_ids)}

    def demote(self) -> int:
        """One pass of the store's mover over the remote tier: reach it if it was never
        reached or its last call failed (quarantining the items of chunks it turns out not
        to hold), delete the chunks freed there, then move the oldest SSD chunks down while
        the SSD is over its watermark (about 64 MiB), each move logged before the SSD copy
        is deleted. Remote I/O runs outside the table lock, the chunks pinned. Returns the
        chunks moved; raises Unavailable when the remote tier is down (the chunks stay on
        the SSD, freed ones queued: nothing is lost)."""
        placement = self._chunks.placement
        with self._cond:
            if self._closed or placement.remote is None:
                return 0
            garbage, known = placement.garbage(), placement.remote_chunks()
        lost = None
        with placement.remote_lock:
            if not placement.remote.ready:  # (re)reached: does it hold what the journal put there?
                placement.remote.probe()
                lost = placement.lost_remote(known)
            if garbage:
                placement.remote.delete(garbage)
        with self._cond:
            placement.collected(garbage)
            if lost is not None:
                self._quarantine_damage(lost)
            chosen = [] if self._closed else placement.demotion_candidates()
        if not chosen:
            return 0
        record, damaged, checksums = None, None, {}
        try:
            try:
                batches = placement.ssd.get(chosen)
            except DataLoss as e:  # the chunks stay on the SSD; the others move next pass
                damaged = e
                return len(chosen)
            with placement.remote_lock:  # DropTable's purge takes it after closing the table
                for c in chosen:
                    if self._closed:
                        return 0
                    checksums[c] = placement.remote.put(c, batches[c])
            with self._cond:
                if not self._closed:  # (a dropped table's journal is gone)
                    done = placement.demotion_record(chosen, [batches[c].num_rows for c in chosen])
                    self._log("demote", **done)
                    record = done
        finally:
            with self._cond:
                placement.demoted(chosen, record, checksums)
                if damaged is not None:
                    placement.undemotable.update(damaged.damage)
                    self._quarantine_damage(damaged)
                elif record is None:
                    placement.counters["demotion_failures"] += 1
        return len(chosen)

    def archive_pending(self) -> int:
        """Upload queued chunks' archived rows to the archive dataset, then free the
        chunks (one pass of up to 8 chunks; the store's mover calls it). Only the blocks
        holding archived rows are read; rows in damaged blocks are quarantined instead.
        Returns the chunks handled; raises Unavailable when the remote tier is down."""
        placement = self._chunks.placement
        expired = self._expire_archive()
        with self._cond:
            if self._archive is None or self._closed or not self._archive.queue:
                return expired
            chosen = self._archive.queue[:8]
            wanted = {c: self._archive.wanted(c) for c in chosen}
            plan = placement.plan(np.concatenate([np.full(len(w[0]), c, np.int64) for c, w in wanted.items()]),
                                  np.concatenate([w[0] for w in wanted.values()]))
        try:
            try:
                batches, keys, local = placement.fetch(plan)
            except DataLoss as e:
                with self._cond:
                    self._archive_damaged(e)
                return len(chosen)
            # take copies into fresh buffers: rows that came off the wire can sit unaligned in
            # their IPC buffers (take_rows may hand out slices of them), which Lance refuses
            data = take_rows(batches, keys, local, self.schema).take(np.arange(len(keys)))
            rows, at = {}, 0
            for c, (r, ids, reasons) in wanted.items():
                rows[c] = Archive.annotate(data.slice(at, len(r)), ids, reasons)
                at += len(r)
            with placement.remote_lock:
                checksums = {c: self._archive.tier.put(c, rows[c]) for c in chosen}
            with self._cond:
                self._archive.checksums.put(checksums)
                nbytes = np.array([rows[c].nbytes for c in chosen], np.int64)
                self._log("archived", chunks=np.array(chosen, dtype=np.int64), nbytes=nbytes)
                self._archive.done(chosen)
                if self._retention is not None:
                    self._retention.archived(chosen, nbytes)
                placement.delete(chosen)
                self.counters["archived_items"] += sum(r.num_rows for r in rows.values())
        finally:
            with self._cond:
                placement.unpin(plan.pinned)
        return len(chosen)

    def _expire_archive(self) -> int:
        """Delete the archive fragments past the total window (retention.py): their
        fragments first (remote I/O, outside the lock), then the record. Returns how many."""
        with self._cond:
            if self._retention is None or self._archive is None or self._closed:
                return 0
            chosen = self._retention.expired(self._wall_clock(), self._chunks.nbytes)
        if not chosen:
            return 0
        with self._chunks.placement.remote_lock:
            self._archive.tier.delete(chosen)  # a crash before the record: deleted again at the next pass
        with self._cond:
            if self._closed:  # dropped meanwhile: its journal is gone
                return 0
            self._archive.checksums.delete(chosen)
            self._log("archive_expired", chunks=np.array(chosen, np.int64))
            self.counters["archive_expired_bytes"] += self._retention.deleted(chosen)
            self.counters["archive_expired_fragments"] += len(chosen)
        return len(chosen)

    def purge(self) -> None:
        """Delete everything the table stored (DropTable of a durable table; after close).
        The remote tier goes first, every fragment of the table's datasets (those a crash
        left unrecorded too): if it is down, Unavailable leaves the table whole."""
        placement = self._chunks.placement
        with placement.remote_lock:
            for tier in self.remote_tiers():
                tier.delete(tier.chunk_ids())
        with self._cond:
            self._journal.drop()
            RemoteChecksums(self.storage.db, self.storage.table_id).drop()  # of every kind
            placement.delete(list(self._chunks._live))
            placement.ssd.delete_all()  # orphans too, without reading them: the table's family goes

    def _new_group(self, group: str, start: str) -> ConsumerGroup:
        """A consumer group reading from the earliest item or after the newest (lock held)."""
        self._check_group_name(group)
        position = 1 if start == "earliest" else self._index.next_id
        self._log("group", group=group, position=position)
        g = self._consumers[group] = ConsumerGroup(group, position)
        return g

    def _versions_of(self, ids: np.ndarray) -> np.ndarray:
        """Policy versions of items by id; -1 for an id no longer in the table."""
        slots = self._index.lookup(ids)
        versions = np.full(len(ids), -1, dtype=np.int64)
        versions[slots >= 0] = self._index["policy_version"][slots[slots >= 0]]
        return versions

    def _group(self, group: str) -> ConsumerGroup:
        g = self._consumers.get(group)
        if g is None:
            self._check_group_name(group)
            raise NotFound(f"table {self.name!r}: no consumer group {group!r}")
        return g

    def _check_group_name(self, group: str) -> None:
        try:
            names.check_consumer_group(group)
        except InvalidArgument as e:
            raise InvalidArgument(f"table {self.name!r}: {e}") from None

    def manifest(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(item ids, policy versions) sampled for training step ``step``, in order."""
        with self._cond:
            parts = self._manifests.get(step)
            if parts is None and self._journal is not None:
                parts = self._journal.manifest(step)
            if not parts:
                raise NotFound(f"table {self.name!r}: no manifest for step {step} "
                               f"(sample with step={step} to record one)")
            ids, versions = zip(*parts)
            return np.concatenate(ids), np.concatenate(versions)

    def _record_manifest(self, step: int, slots: np.ndarray) -> None:
        entry = (self._index["id"][slots].copy(), self._index["policy_version"][slots].copy())
        if self._journal is not None:
            self._journal.add_manifest(step, *entry)
        else:
            self._manifests.setdefault(step, []).append(entry)
            while len(self._manifests) > MANIFESTS_IN_MEMORY:
                del self._manifests[next(iter(self._manifests))]

    # -- reads ------------------------------------------------------------------------

    def get(self, item_ids) -> Rows:
        """Items by id, in the given order. NOT_FOUND names the first unknown id."""
        ids = self._ids(item_ids)
        with self._cond:
            self._tick()
            rows = self._snapshot(self._lookup(ids))
        return self._gather(rows)

    def scan(self, columns: Sequence[str] | None = None, *, min_policy_version: int | None = None,
             max_policy_version: int | None = None, inserted_after: float | None = None,
             inserted_before: float | None = None) -> Iterator[pa.RecordBatch]:
        """Live items for queries and audits, one record batch per chunk: the payload
        ``columns`` (None: all) plus the server's ``item_id``, ``priority``,
        ``times_sampled``, ``inserted_at`` (Unix seconds) and ``tier``. Items are pruned
        with the index before any payload is read; the chunks are pinned at the start
        (a consistent set of items) and read one at a time, so memory holds one chunk."""
        names = list(self.schema.names if columns is None else columns)
        unknown = [c for c in names if c not in self.schema.names]
        if unknown:
            raise InvalidArgument(f"table {self.name!r}: no column {unknown[0]!r} "
                                  f"(columns: {', '.join(self.schema.names)})")
        with self._cond:
            self._tick()
            ix = self._index
            slots = ix.live_slots()
            keep = np.ones(len(slots), dtype=bool)
            pv, at = ix["policy_version"][slots], ix["inserted_at"][slots]
            for bound, ok in ((min_policy_version, lambda b: pv >= b), (max_policy_version, lambda b: pv <= b),
                              (inserted_after, lambda b: at > b), (inserted_before, lambda b: at < b)):
                if bound is not None:
                    keep &= ok(bound)
            slots = slots[keep]
            slots = slots[np.lexsort((ix["row"][slots], ix["chunk"][slots]))]
            chunks = ix["chunk"][slots]
            parts = []
            for lo, hi in _chunk_runs(chunks):
                s = slots[lo:hi]
                parts.append((self._snapshot(s), ix["inserted_at"][s].copy(),
                              self._chunks.placement.where(int(chunks[lo]))))
        try:
            while parts:
                snap, inserted_at, tier = parts.pop(0)
                rows = self._gather(snap, names)
                data = rows.data
                for name, values in (("item_id", pa.array(rows.item_ids, pa.uint64())),
                                     ("priority", pa.array(rows.priorities, pa.float64())),
                                     ("times_sampled", pa.array(rows.times_sampled, pa.int64())),
                                     ("inserted_at", pa.array(inserted_at, pa.float64())),
                                     ("tier", pa.array([tier] * len(inserted_at), pa.string()))):
                    data = data.append_column(name, values)
                yield data
        finally:  # an abandoned scan unpins what it did not read
            with self._cond:
                for snap, _, _ in parts:
                    self._chunks.placement.finish(snap.plan)

    def scan_archive(self, columns: Sequence[str] | None = None) -> pa.RecordBatchReader | None:
        """The archived (removed) items, with ``_item_id`` and ``_removed``, one verified
        fragment at a time with column pushdown (no row filter: the caller filters); None
        without an archive. A damaged fragment fails the scan with DataLoss and is
        quarantined: later scans leave it out."""
        if self._archive is None:
            return None
        with self._cond:
            skip = self._quarantine.chunks_on("archive")
        with self._chunks.placement.remote_lock:
            reader = self._archive.tier.scan(None if columns is None else list(columns),
                                             checksums=self._archive.checksums, skip=skip)

        def batches():
            try:
                yield from reader
            except DataLoss as e:
                with self._cond:
                    for chunk in set(e.damage) - self._quarantine.chunks_on("archive"):
                        self._quarantine_event(Event(chunk, "archive", str(e)), np.zeros(0, np.uint64))
                raise DataLoss(f"table {self.name!r}: {e}; later scans leave the fragment out",
                               damage=e.damage) from None
        return pa.RecordBatchReader.from_batches(reader.schema, batches())

    def scan_quarantined(self, columns: Sequence[str] | None = None) -> pa.RecordBatchReader:
        """The quarantined items for queries: ``_item_id`` and the payload ``columns``
        (None: all), which are null (their stored bytes are damaged)."""
        names = list(self.schema.names if columns is None else columns)
        with self._cond:
            ids = self._quarantine.ids()
        fields = [self.schema.field(c) for c in names]
        arrays = [pa.nulls(len(ids), f.type) for f in fields] + [pa.array(ids, pa.uint64())]
        schema = pa.schema(fields + [pa.field("_item_id", pa.uint64())])
        return pa.RecordBatchReader.from_batches(schema, [pa.RecordBatch.from_arrays(arrays, schema=schema)])

    def remote_tiers(self) -> list:
        """The table's remote tiers (its chunks', its archive's), for checkpoints and
        DropTable: their state (``version``, ``hold``) only while holding ``remote_lock``."""
        tiers = [self._chunks.placement.remote, self._archive.tier if self._archive is not None else None]
        return [t for t in tiers if t is not None]

    @property
    def remote_lock(self) -> threading.Lock:
        """Held by every use of the remote tiers: while it is held, none of their datasets
        gets a commit."""
        return self._chunks.placement.remote_lock

    def __len__(self) -> int:
        return len(self._index)

    def stats(self) -> dict[str, float]:
        """Flat counters (documented in docs/stats.md)."""
        with self._cond:
            self._tick()
            s: dict[str, float] = {
                "items": len(self._index),
                **self._chunks.placement.stats(),
                **self._items_per_tier(),
                "chunks": len(self._chunks),
                "policy_version": self.policy_version,
                "sampler_eligible": len(self._sampler),
                "consumer_groups": len(self._consumers),
                "quarantined_items": len(self._quarantine),
                "quarantined_chunks": self._quarantine.chunks,
                "insert_queue": len(self._lines["insert"]),
                "sample_queue": len(self._lines["sample"]),
            }
            for k in ("inserts", "inserted_bytes", "duplicates", "samples", "stream_deliveries",
                      "priority_updates", "compactions", "compacted_rows", "removed_max_size", "removed_max_times_sampled",
                      "removed_stale", "removed_zero_variance", "insert_waits", "sample_waits",
                      "stream_waits", "insert_wait_seconds", "sample_wait_seconds",
                      "stream_wait_seconds", "compaction_failures", "removed_lost", "archived_items",
                      "removed_group_timeout", "removed_group_late", "group_timeouts_released",
                      "group_timeouts_dropped", "ingest_unchecked"):
                s[k] = self.counters[k]
            for k, v in self._limiter.state().items():
                if isinstance(v, (int, float)):
                    s[f"rate_limiter_{k}"] = float(v)
            for k, v in self._sampler.stats().items():
                s[f"sampler.{k}"] = v
            if self._retention is not None:
                s.update(self._retention.stats(), removed_retention=self.counters["removed_retention"],
                         archive_expired_fragments=self.counters["archive_expired_fragments"],
                         archive_expired_bytes=self.counters["archive_expired_bytes"])
            if self._pacing is not None:
                s.update(self._pacing.stats(self.policy_version))
                s["reserve_waits"], s["reserve_wait_seconds"] = self.counters["reserve_waits"], \
                    self.counters["reserve_wait_seconds"]
            for op, counts in self._staleness.items():
                for bound, n in zip(STALENESS_BUCKETS, np.cumsum(counts).tolist()):
                    s[f"staleness.{op}.le_{bound}"] = n
                s[f"staleness.{op}.sum"] = self.counters[f"staleness.{op}.sum"]
            for name, g in self._consumers.items():
                for k, v in g.stats().items():
                    s[f"group.{name}.{k}"] = v
                s[f"group.{name}.lag"] = self._index.count_from(g.position)
            return s

    # -- lifecycle --------------------------------------------------------------------

    def record_wait(self, op: str, seconds: float | None = None) -> None:
        """Count a call's wait (``admission.Admission`` does, for every waiter): once
        as it begins (no seconds), then with the time it took."""
        with self._cond:
            if seconds is None:
                self.counters[f"{op}_waits"] += 1
            else:
                self.counters[f"{op}_wait_seconds"] += seconds

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change (under the lock: it must not block):
        the asyncio server's waiter."""
        with self._cond:
            self._listeners.append(listener)

    def close(self) -> None:
        """Wake every waiter with UNAVAILABLE; later calls fail the same way."""
        with self._cond:
            self._closed = True
            for line in self._lines.values():
                line.closed = True
            self._changed()
        if self._prefetch_pool is not None:
            self._prefetch_pool.shutdown(wait=True)
        tiers = [self._chunks.placement.remote, self._archive.tier if self._archive is not None else None]
        for tier in tiers:
            if tier is not None:
                tier.close()  # its reader threads

    # -- damage -----------------------------------------------------------------------

    def _quarantine_damage(self, error: DataLoss) -> int:
        """Quarantine the live items stored where a read found damage (lock held): for
        each damaged chunk, the items in its damaged rows (all of them when the whole chunk
        is). Returns how many items were quarantined."""
        placement = self._chunks.placement
        total = 0
        for chunk, ranges in error.damage.items():
            tier = placement.home(chunk) if placement.durable else "memory"
            total += self._quarantine_items(chunk, ranges, tier, str(error))
        if total:
            self._changed()
        return total

    def _quarantine_items(self, chunk: int, ranges: list[tuple[int, int]] | None, tier: str, reason: str) -> int:
        ix = self._index
        live = ix.live_slots()
        slots = live[ix["chunk"][live] == chunk]
        if ranges is not None:
            rows = ix["row"][slots]
            inside = np.zeros(len(slots), dtype=bool)
            for lo, hi in ranges:
                inside |= (rows >= lo) & (rows < hi)
            slots = slots[inside]
        if len(slots) == 0:
            return 0
        self._quarantine_event(Event(chunk, tier, reason), ix["id"][slots].copy())
        self._remove(slots, "quarantined", log=False)
        return len(slots)

    def _quarantine_event(self, event: Event, ids: np.ndarray) -> None:
        """Journal and remember one damage event (the caller removes its live items)."""
        self._log("quarantine", ids=ids, chunk=event.chunk, tier=event.tier, reason=event.reason)
        self._quarantine.add(event, ids)
        log.error("table %r: chunk %d on the %s tier is damaged; %d items quarantined: %s",
                  self.name, event.chunk, event.tier, len(ids), event.reason)

    def _archive_damaged(self, error: DataLoss) -> None:
        """Chunks waiting for the archive could not be read whole (lock held): their rows
        in damaged blocks cannot be archived and are quarantined (the items had already
        left the table); the chunks' other archived rows are archived on the next pass."""
        for chunk, ranges in error.damage.items():
            ids = self._archive.drop_rows(chunk, ranges)
            self._quarantine_event(Event(chunk, self._chunks.placement.home(chunk), str(error)), ids)
            if chunk not in self._archive:  # nothing left to archive: free the chunk
                self._log("archived", chunks=np.array([chunk], dtype=np.int64))
                self._archive.done([chunk])
                if self._retention is not None:
                    self._retention.archived([chunk], None)
                self._chunks.placement.delete([chunk])

    # -- internals --------------------------------------------------------------------

    def _snapshot(self, slots: np.ndarray, probabilities=None, weights=None) -> "_Snapshot":
        """Per-row facts and a read plan (resident batches, other chunks pinned), taken
        under the lock."""
        ix = self._index
        released = None if self._timeouts is None else self._timeouts.released(ix["group"][slots])
        return _Snapshot(
            plan=self._chunks.placement.plan(ix["chunk"][slots], ix["row"][slots]),
            schema=self.schema, item_ids=ix["id"][slots], priorities=ix["priority"][slots],
            times_sampled=ix["times_sampled"][slots], policy_versions=ix["policy_version"][slots],
            probabilities=probabilities, weights=weights, released=released,
            group_sizes=None if released is None else ix["group_size"][slots])

    def _gather(self, snap: "_Snapshot", columns: list[str] | None = None) -> Rows:
        """Read and copy the rows (``columns`` of them) out of their chunks (no lock held:
        chunks are immutable and the plan pinned those not in memory), then unpin."""
        try:
            try:
                batches, keys, rows = self._chunks.placement.fetch(snap.plan)
            except DataLoss as e:
                with self._cond:
                    n = self._quarantine_damage(e)
                raise DataLoss(f"table {self.name!r}: {e}; {n} items stored there are quarantined: later "
                               f"calls do not return them", damage=e.damage) from None
            schema = self.schema
            if columns is not None:  # select first: only these columns are copied
                batches = {k: b.select(columns) for k, b in batches.items()}
                schema = pa.schema([self.schema.field(c) for c in columns])
            data = take_rows(batches, keys, rows, schema)
            if snap.released is not None:
                data = _with_released(data, snap.released, snap.group_sizes)
        finally:
            if snap.plan.pinned:
                with self._cond:
                    self._chunks.placement.finish(snap.plan)
                    self._read_ahead([c for c in snap.plan.pinned if c not in snap.plan.fetched], if_room=True)
        return Rows(data=data, item_ids=snap.item_ids, priorities=snap.priorities,
                    times_sampled=snap.times_sampled, policy_versions=snap.policy_versions,
                    probabilities=snap.probabilities, weights=snap.weights)

    def _log(self, kind: str, durability: str = "wal", **fields) -> None:
        """Append a change to the journal (durable tables; not while replaying it).
        ``Journal.append`` takes manifest edits that go in the same write."""
        if self._journal is not None and not self._replaying:
            self._journal.append(kind, durability, **fields)

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        slots = self._index.lookup(ids)
        if (slots < 0).any():
            for item_id in ids[slots < 0].tolist():
                event = self._quarantine.event_of(item_id)
                if event is not None:
                    raise DataLoss(f"table {self.name!r}: item {item_id} is quarantined: its chunk "
                                   f"{event.chunk} on the {event.tier} tier is damaged ({event.reason})")
            missing = int(ids[slots < 0][0])
            raise NotFound(f"table {self.name!r}: no item with id {missing} "
                           f"({int((slots < 0).sum())} of {len(ids)} ids unknown or removed)")
        return slots

    def _items(self, slots: np.ndarray) -> Items:
        c = self._index.cols
        return Items(slots=slots, ids=c["id"][slots], priorities=c["priority"][slots],
                     groups=c["group"][slots], group_sizes=c["group_size"][slots],
                     tasks=c["task"][slots], rewards=c["reward"][slots], data_versions=c["data_version"][slots])

    def _victims(self, k: int) -> np.ndarray:
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        return self._remover.sample(k, self._rng).slots

    def _check_budget(self, nbytes: int, victims: np.ndarray) -> None:
        """RESOURCE_EXHAUSTED unless ``nbytes`` more fit, counting what the victims free."""
        if nbytes == 0:
            return
        freed = 0
        if len(victims):
            chunks, counts = np.unique(self._index["chunk"][victims], return_counts=True)
            freed = self._chunks.freed_by(chunks.tolist(), counts.tolist())
        tier = self._chunks.placement.memory
        if tier.nbytes - freed + nbytes > tier.budget:
            raise ResourceExhausted(
                f"table {self.name!r}: the memory tier is full ({tier.nbytes} of "
                f"{tier.budget} bytes; this insert needs {nbytes}); raise memory_bytes "
                f"or lower max_size, or use a durable table (tiers = \"ssd\")")

    def _remove(self, slots: np.ndarray, reason: str, *, in_sampler: bool = True, log: bool = True) -> None:
        """Remove live items from selectors, tiers and the index (``in_sampler=False``:
        the sampler has already let them go; ``log=False``: the journal record that
        caused it implies the removal)."""
        if len(slots) == 0:
            return
        if log:
            self._log("remove", ids=self._index["id"][slots], reason=reason)
        if in_sampler:
            self._sampler.remove(slots)
        self._remover.remove(slots)
        if self.spec.max_times_sampled:
            self._allowance -= int((self.spec.max_times_sampled - self._index["times_sampled"][slots]).sum())
        if self._archive is not None and reason not in ("lost", "quarantined"):
            ix = self._index
            self._archive.removed(ix["chunk"][slots], ix["row"][slots], ix["id"][slots], reason)
            if self._retention is not None:  # the total window counts from the rows' inserted_at
                self._retention.removed(ix["chunk"][slots], ix["inserted_at"][slots])
        if not self._replaying:  # a restore adopts the chunks once replay is done
            chunks, counts = np.unique(self._index["chunk"][slots], return_counts=True)
            self._free(self._chunks.release(chunks.tolist(), counts.tolist()))
        self._forget(slots, reason)
        self._maybe_compact()

    def _free(self, chunks: list[int]) -> None:
        """Delete chunks no live item references, or queue them for the archive."""
        if self._archive is not None:
            chunks = self._archive.freed(chunks)
        self._chunks.placement.delete(chunks)

    def _maybe_compact(self) -> None:
        """Rewrite mostly-dead or small chunks into one (``ChunkStore.compaction_candidates``).

        Removers other than fifo, and max_times_sampled under random sampling, leave
        chunks with a few live rows that pin all their bytes (up to 256x the payload);
        small inserts leave thousands of tiny chunks that make every sample slow. A pass
        copies at most ~32 MiB of live rows under the lock: a bounded pause, repeated by
        later calls if needed.
        """
        if self._replaying or self._archive is not None:  # archived rows must outlive compaction
            return
        chosen = self._chunks.compaction_candidates()
        if not chosen:
            return
        ix = self._index
        slots = ix.live_slots()
        slots = slots[np.isin(ix["chunk"][slots], chosen)]
        slots = slots[np.lexsort((ix["row"][slots], ix["chunk"][slots]))]
        rows = take_rows(self._chunks.get(chosen), ix["chunk"][slots], ix["row"][slots], self.schema)
        try:
            staged = self._chunks.stage(rows, "wal")
            self._log("compact", ids=ix["id"][slots], chunk=staged.chunk_id)
        except ExpstoreError:  # e.g. a full disk: compaction can wait, the table goes on
            self.counters["compaction_failures"] += 1
            return
        ix["chunk"][slots] = self._chunks.replace(chosen, staged)
        ix["row"][slots] = np.arange(len(slots))
        self.counters["compactions"] += 1
        self.counters["compacted_rows"] += len(slots)

    def _forget(self, slots: np.ndarray, reason: str, *, limited: bool = True) -> None:
        """Drop items from the index and the key map (remembering keys for dedup)."""
        if limited:
            self._limiter.delete(len(slots))
        if self._keys is not None:
            self._keys.remove(slots, self._index["id"][slots], remember=reason != "quarantined")
        self._index.remove(slots)
        self.counters[f"removed_{reason}"] += len(slots)

    def _dedup(self, keys: list[str] | None, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, new): the stored id of rows whose key is known; new marks the others."""
        if keys is None:
            return np.zeros(n, dtype=np.uint64), np.ones(n, dtype=bool)
        known = self._keys.lookup(keys)
        return known, known == 0

    def _stale_cutoff(self) -> int:
        if self.spec.max_staleness is None or self._pacing is not None:  # paced: nothing is late
            return -1
        return self.policy_version - self.spec.max_staleness

    def _priorities(self, priorities, n: int, *, required: bool = False) -> np.ndarray:
        """Validated float64 priorities, one per row; None/empty means 1.0 each unless
        ``required`` (updates must say what to set)."""
        if not required and (priorities is None or np.size(priorities) == 0):
            return np.ones(n, dtype=np.float64)
        try:
            pr = np.asarray(priorities, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidArgument(f"table {self.name!r}: priorities must be numbers") from None
        if pr.ndim != 1:
            raise InvalidArgument(f"table {self.name!r}: priorities must be a list, one per row")
        if len(pr) != n:
            raise InvalidArgument(f"table {self.name!r}: {len(pr)} priorities for {n} rows")
        bad = ~np.isfinite(pr) | (pr < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidArgument(f"table {self.name!r}: row {i}, column 'priority': must be a "
                                  f"finite number >= 0, got {pr[i]}")
        return pr

    def _ids(self, item_ids) -> np.ndarray:
        """Item ids as uint64; ids are positive integers, anything else is INVALID_ARGUMENT."""
        ids = np.asarray(item_ids)
        if ids.size == 0:
            return np.zeros(0, dtype=np.uint64)
        if ids.dtype.kind not in "ui":  # e.g. a list mixing numpy uint64 and int
            try:
                ids = np.array([operator.index(x) for x in item_ids], dtype=object)
            except TypeError:
                ids = None
        if ids is None or ids.ndim != 1 or ids.min() < 1 or ids.max() >= 2**64:
            raise InvalidArgument(f"table {self.name!r}: item ids must be a list of positive integers")
        return ids.astype(np.uint64)

    def _check_keys(self, keys: list) -> None:
        for i, k in enumerate(keys):
            if k is None:
                raise InvalidArgument(f"table {self.name!r}: row {i}, column {self.spec.key!r}: "
                                      f"the key column must not be null")
        if len(set(keys)) != len(keys):
            seen: dict[str, int] = {}
            for i, k in enumerate(keys):
                if k in seen:
                    raise InvalidArgument(f"table {self.name!r}: row {i}, column {self.spec.key!r}: "
                                          f"duplicate of row {seen[k]}")
                seen[k] = i

    def _check_sample_size(self, n: int) -> None:
        if n > self.spec.max_size:
            raise InvalidArgument(f"table {self.name!r}: batch_size {n} exceeds max_size {self.spec.max_size}")
        sampler = self.spec.sampler
        if sampler.type == "group" and n % sampler.group_size:
            raise InvalidArgument(f"table {self.name!r}: batch_size {n} is not a multiple of "
                                  f"group_size {sampler.group_size}")

    def _check_group_sizes(self, group_sizes: np.ndarray) -> None:
        if self.spec.sampler.type != "group":
            return
        want = self.spec.sampler.group_size
        bad = (group_sizes != 0) & (group_sizes != want)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidArgument(f"table {self.name!r}: row {i}, column 'group_size': "
                                  f"{int(group_sizes[i])} differs from the sampler's group_size {want}")

    def turn(self, op: str, origin: Hashable | None = None) -> Turn:
        """A place in line for one ``"insert"`` or ``"sample"`` call: pass it to every
        attempt (``try_insert``, ``try_sample``), and to ``leave`` when the call ends,
        however it ends (``admission.Admission`` does). ``origin``: the client connection,
        whose calls reach the table in the order they are handed to ``expect``."""
        if op not in self._lines:
            raise InvalidArgument(f"table {self.name!r}: no line for {op!r} calls")
        return Turn(op, origin)

    def expect(self, turn: Turn) -> None:
        """Register a turn as its first attempt is handed to an engine thread, in the
        order of its origin's calls (see turns.py). Never takes the table's lock: safe on
        the server's event loop."""
        self._lines[turn.op].expect(turn)

    def leave(self, turn: Turn) -> None:
        """End a call's turn (idempotent; an attempt still running for it then never
        joins the line); the call behind it, if any, is woken."""
        with self._cond:
            if self._lines[turn.op].leave(turn):
                self._wake()

    def wait_for_change(self, epoch: int, limit: float | None) -> None:
        """The in-process waiter (admission.py): block this thread until the table has
        changed since ``epoch`` (a ``Wait``'s), or for ``limit`` seconds (None: no limit)."""
        with self._cond:
            if self._epoch == epoch:
                self._cond.wait(limit)

    def _held(self, line: Line, turn: Turn) -> Wait | None:
        """A ``Wait`` if an earlier call of the turn's connection was handed to an engine
        thread before it and has not reached the lock yet (lock held): the attempt must
        not overtake it. The earlier call wakes it as it passes (or leaves)."""
        held, released = line.reach(turn)
        if released:
            self._wake()  # a held call of its connection may go on
        if held:
            return Wait(f"an earlier {turn.op} of this connection has not reached the table", self._epoch)
        return None

    @contextmanager
    def _admitted(self, line: Line, turn: Turn) -> Iterator[None]:
        """Leave the line as the call is admitted (lock held). The call's own change
        notification wakes the next in line; if the call fails instead, wake it here."""
        head_changed = line.leave(turn)
        try:
            yield
        except BaseException:
            if head_changed:
                self._wake()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable(f"table {self.name!r} is closed")

    def _changed(self) -> None:
        if self._journal is not None and self._journal.wants_snapshot():
            self._write_snapshot()
        self._wake()

    def _wake(self) -> None:
        """Wake every waiter, in-process threads and ``subscribe`` listeners alike."""
        self._epoch += 1
        self._cond.notify_all()
        for listener in self._listeners:
            listener()

    def _items_per_tier(self) -> dict[str, int]:
        placement = self._chunks.placement
        chunks, counts = np.unique(self._index["chunk"][self._index.live_slots()], return_counts=True)
        out = {"items_memory": 0, "items_ssd": 0, "items_remote": 0}
        if placement.durable:
            for c, k in zip(chunks.tolist(), counts.tolist()):
                out["items_" + placement.where(c)] += k
        else:
            out["items_memory"] = len(self._index)
        return out

    # -- persistence ------------------------------------------------------------------

    def _write_snapshot(self) -> None:
        """The whole state as one journal snapshot (index columns of live items in id
        order, keys, codebooks, consumer groups, rate limiter); older records are dropped."""
        ix = self._index
        live = ix.live_slots()
        fields = {f"col_{name}": ix[name][live] for name in COLUMNS}
        fields.update(
            keys=self._keys.keys_of(live) if self._keys is not None else None,
            group_names=list(self._groups._names), task_names=list(self._tasks._names),
            next_id=ix.next_id, policy_version=self.policy_version, touches=self._touches,
            limiter=self._limiter.state(),
            consumers=[g.to_dict(self._clock()) for g in self._consumers.values()],
            **self._quarantine.to_fields(), **self._chunks.placement.state())
        if self._timeouts is not None:
            fields["group_timeouts"] = self._timeouts.state(self._groups.name)
        if self._pacing is not None:
            fields["pacing"] = self._pacing.state()
        if self._retention is not None:
            fields["retention"] = self._retention.state()
        if self._keys is not None:
            fields["removed_keys"], fields["removed_ids"] = self._keys.removed()
        self._journal.write_snapshot(fields)

    def restore(self) -> dict[str, int]:
        """Rebuild a durable table from its journal after a restart: the latest snapshot,
        then every record after it, then the chunks the items reference (from the SSD, or
        the remote tier where the journal's demotions put them: no remote I/O). Items
        whose chunk is in no tier are dropped and counted if they were acknowledged at
        durability ``memory`` before a crash; if they were acknowledged at ``wal`` or
        ``fsync``, DataLoss is raised and nothing is dropped. Returns what was restored."""
        with self._cond:
            snapshot, records = self._journal.load()
            self._replaying = True
            try:
                if snapshot is not None:
                    self._load_snapshot(snapshot)
                n = 0
                for kind, fields in records:
                    getattr(self, f"_replay_{kind}")(fields)
                    n += 1
            finally:
                self._replaying = False
            lost = self._adopt_chunks()
            if self._checks is not None:
                self._rebuild_lineage()
            if self._chunks.placement.legacy:  # record the demotions: the next start needs no listing
                self._write_snapshot()
            self.counters.clear()  # stats count what this process did; replay is not that
            return {"items": len(self._index), "records": n, "lost": lost, "quarantined": len(self._quarantine)}

    def _load_snapshot(self, s: dict) -> None:
        for name in s["group_names"]:
            self._groups._code(name)
        for name in s["task_names"]:
            self._tasks._code(name)
        ids = s["col_id"]
        s.setdefault("col_touched", ids.astype(np.int64))  # snapshots before it: insertion order
        for name in ("episode", "data_version"):  # snapshots before them: none
            s.setdefault(f"col_{name}", np.zeros(len(ids), np.int64))
        rows = {name: s[f"col_{name}"] for name in COLUMNS if name not in ("id", "group", "task")}
        slots, _ = self._index.add(len(ids), ids=ids, group=s["col_group"], task=s["col_task"], **rows)
        if len(ids) == 0:
            self._index.next_id = max(self._index.next_id, s["next_id"])
        if self._keys is not None:
            self._keys.add(slots, s["keys"], ids)
            self._keys.restore_removed(s["removed_keys"], s["removed_ids"])
        # Selectors take the items in the order they were last inserted or updated (the
        # heaps' tie order), then the counter goes on from there.
        touched = s["col_touched"]
        items = self._items(slots[np.argsort(touched, kind="stable")])
        self._sampler.insert(items)
        self._remover.insert(items)
        self._touches = int(s.get("touches", touched.max() + 1 if len(touched) else 0))
        cap = self.spec.max_times_sampled
        self._allowance = int((cap - s["col_times_sampled"]).sum()) if cap else 0
        self._index.next_id = max(self._index.next_id, s["next_id"])
        self.policy_version = s["policy_version"]
        self._limiter.restore(s["limiter"])
        now = self._clock()
        self._consumers = {d["name"]: ConsumerGroup.from_dict(d, now) for d in s["consumers"]}
        self._quarantine.restore(s)
        self._chunks.placement.load_state(s)
        if self._pacing is not None and s.get("pacing") is not None:
            self._pacing.load(s["pacing"])
        if self._retention is not None and s.get("retention") is not None:
            self._retention.load(s["retention"])
        if self._timeouts is not None and s.get("group_timeouts") is not None:
            self._timeouts.load(s["group_timeouts"], self._groups.find)
            self._rerelease(slots)

    def _rerelease(self, slots: np.ndarray) -> None:
        """After a snapshot load, make the groups released before it eligible again (their
        members were re-inserted as forming), unless one of them left since the release
        (the group broke: never eligible again)."""
        ix = self._index
        forming = self._sampler.forming(self._timeouts.codes(group_timeouts.RELEASED))
        members = slots[np.isin(ix["group"][slots], forming)]
        if len(members) == 0:
            return
        codes, first, arrived = np.unique(ix["group"][members], return_index=True, return_counts=True)
        whole = codes[arrived == ix["group_size"][members][first]]
        self._sampler.expire(whole, release=True)
        self._remove(self._sampler.rejected(), "zero_variance", log=False)

    def _rebuild_lineage(self) -> None:
        """The ingest checks' references from the live items (after a restore)."""
        ix = self._index
        live = ix.live_slots()
        live = live[np.argsort(ix["id"][live], kind="stable")]
        groups = [None] * len(live)
        if "group_prefix" in self._checks.names:
            groups = [self._groups.name(c) if c >= 0 else None for c in ix["group"][live].tolist()]
        self._lineage.rebuild(ix["id"][live], ix["episode"][live], groups)

    def _live_slots_of(self, ids: np.ndarray) -> np.ndarray:
        slots = self._index.lookup(ids)
        return slots[slots >= 0]

    def _replay_insert(self, f: dict) -> None:
        self._remove(self._live_slots_of(f["victims"]), "max_size")
        rows = {name: f[name] for name in ("chunk", "row", "priority", "policy_version",
                                           "inserted_at", "group_size", "reward")}
        for name in ("episode", "data_version"):  # records before them have none
            if name in f:
                rows[name] = f[name]
        self._add_items(f["ids"], rows, f["groups"], f["tasks"], f["keys"], f["stored"])
        if "reservations" in f:
            self._pacing.settle(f["reservations"])
        self._chunks.placement.replay_written(f["chunk"], f.get("insert_durability"))

    def _replay_remove(self, f: dict) -> None:
        self._remove(self._live_slots_of(f["ids"]), f["reason"])

    def _replay_sampled(self, f: dict) -> None:
        slots = self._index.lookup(f["ids"])
        np.add.at(self._index["times_sampled"], slots[slots >= 0], 1)
        self._sampled(int(f["n"]))

    def _replay_priority(self, f: dict) -> None:
        slots = self._index.lookup(f["ids"])
        self._set_priorities(slots[slots >= 0], f["priorities"][slots >= 0])

    def _replay_group_timeout(self, f: dict) -> None:
        self._settle(np.array([self._groups.find(g) for g in f["groups"]], np.int64), f["action"])

    def _replay_reserve(self, f: dict) -> None:
        self._pacing.grant(Reservation(int(f["id"]), int(f["n"]), float(f["deadline"]), int(f["version"])))

    def _replay_release(self, f: dict) -> None:
        self._pacing.release(int(f["id"]), f["reason"])

    def _replay_version(self, f: dict) -> None:
        self.policy_version = int(f["version"])

    def _replay_compact(self, f: dict) -> None:
        slots = self._index.lookup(f["ids"])
        ok = slots >= 0
        self._index["chunk"][slots[ok]] = int(f["chunk"])
        self._index["row"][slots[ok]] = np.flatnonzero(ok)
        self._chunks.placement.replay_written([int(f["chunk"])], "wal")

    def _replay_demote(self, f: dict) -> None:
        self._chunks.placement.replay_demoted(f["chunks"], f["rows"], f["nbytes"])

    def _replay_group(self, f: dict) -> None:
        self._consumers[f["group"]] = ConsumerGroup(f["group"], int(f["position"]))

    def _replay_forget(self, f: dict) -> None:
        self._consumers[f["group"]].forget(f["ids"])

    def _replay_deliver(self, f: dict) -> None:
        deadline = float(f["deadline"]) - time.time() + self._clock()
        self._consumers[f["group"]].deliver(f["fresh"].copy(), f["again"], deadline)

    def _replay_ack(self, f: dict) -> None:
        self._consumers[f["group"]].ack(f["ids"])

    def _replay_cut(self, f: dict) -> None:
        g = self._consumers[f["group"]]
        g.ack(f["ids"])
        g.cut(int(f["step"]), f["tag"])

    def _replay_archived(self, f: dict) -> None:
        self._archive.done(f["chunks"].tolist())
        if self._retention is not None:
            self._retention.archived(f["chunks"].tolist(), f.get("nbytes"))

    def _replay_archive_expired(self, f: dict) -> None:
        self._retention.deleted(f["chunks"].tolist())

    def _replay_resume(self, f: dict) -> None:
        self._consumers[f["group"]].resume(int(f["step"]))

    def _replay_quarantine(self, f: dict) -> None:
        self._quarantine.add(Event(int(f["chunk"]), f["tier"], f["reason"]), f["ids"])
        if self._archive is not None:  # removed items' rows it will not archive
            self._archive.drop_ids(int(f["chunk"]), f["ids"])
        self._remove(self._live_slots_of(f["ids"]), "quarantined")

    def _adopt_chunks(self) -> int:
        """Hand the chunks the restored items reference to the chunk store; drop items
        whose chunk is gone (written without the write-ahead log; DataLoss if it was
        acknowledged at wal or fsync), quarantine those whose chunk is damaged (its SSD
        metadata fails its checksum, or its remote fragment is unreadable), and delete
        chunks no item references (a crash between writing a chunk and logging its
        insert, or between a removal and the chunk's delete; the mover deletes those on
        the remote tier)."""
        ix, placement = self._index, self._chunks.placement
        for checksums in (placement.checksums, self._archive.checksums if self._archive is not None else None):
            if checksums is not None:
                checksums.load()
        live = ix.live_slots()
        chunks = np.unique(ix["chunk"][live])
        missing, damaged = placement.adopt(chunks.tolist())
        durable = [] if placement.legacy else sorted(set(missing) - set(placement.volatile(missing)))
        if durable:
            n = int(np.isin(ix["chunk"][live], durable).sum())
            shown = ", ".join(map(str, durable[:5])) + (", ..." if len(durable) > 5 else "")
            raise DataLoss(f"table {self.name!r}: {n} items acknowledged at durability 'wal' or 'fsync' "
                           f"reference {len(durable)} chunks that are in no tier (chunk ids {shown}): not on "
                           f"the SSD, and the journal records no move to the remote tier; nothing was dropped")
        lost = 0
        if missing or damaged:
            self._replaying = True  # no chunk bookkeeping yet
            gone = live[np.isin(ix["chunk"][live], missing)]
            lost = len(gone)
            self._remove(gone, "lost")
            quarantined = {}
            for c in damaged:
                slots = live[ix["chunk"][live] == c]
                quarantined[c] = ix["id"][slots].copy()
                self._remove(slots, "quarantined")
            self._replaying = False
            for c, why in damaged.items():  # journaled, so that they stay quarantined
                self._quarantine_event(Event(c, self._damaged_tier(c), why), quarantined[c])
            live = ix.live_slots()
        chunks, counts = np.unique(ix["chunk"][live], return_counts=True)
        if placement.unverified():
            log.warning("table %r: %d remote chunks have no checksums (demoted before they were kept): "
                        "their reads are not verified", self.name, len(placement.unverified()))
        max_row = np.zeros(0, np.int64)
        if len(chunks):
            order = np.argsort(ix["chunk"][live], kind="stable")
            starts = np.searchsorted(ix["chunk"][live][order], chunks)
            max_row = np.maximum.reduceat(ix["row"][live][order], starts)
        ssd = placement.ssd
        for c, k, r in zip(chunks.tolist(), counts.tolist(), max_row.tolist()):
            if c in ssd:
                rows, nbytes = int(ssd._offsets[c][-1]), ssd.size_of(c)
            else:
                rows, nbytes = placement.remote_size(c)
                rows = max(rows, r + 1)
            self._chunks.adopt(c, rows, k, nbytes)
        referenced = set(chunks.tolist())
        if self._archive is not None:  # freed before the crash, not yet archived
            pending = [c for c in self._archive.pending() if c not in referenced]
            missing, damaged = placement.adopt(pending)
            for c in missing:
                log.warning("table %r: chunk %d waiting for the archive is in no tier; its %d removed "
                            "items are not archived", self.name, c, len(self._archive.drop_rows(c, None)))
            for c, why in damaged.items():
                self._quarantine_event(Event(c, self._damaged_tier(c), why), self._archive.drop_rows(c, None))
            pending = [c for c in pending if c in self._archive]
            self._archive.freed(pending)
            referenced.update(pending)
        try:
            stored = ssd.stored_chunks()
            top = max(stored, default=-1)
        except DataLoss as e:  # orphans stay until a start can list the chunks
            log.warning("table %r: cannot list its SSD chunks, unreferenced ones are kept: %s", self.name, e)
            stored = []
            try:
                top = ssd.last_chunk_id()
                top = -1 if top is None else top
            except DataLoss:
                top = max(referenced, default=-1) + (1 << 24)  # past any id the damaged range may hold
        orphans = [c for c in stored if c not in referenced]
        placement.delete(orphans + [c for c in placement.remote_chunks() if c not in referenced])
        placement.reserve_ids(max([*referenced, top], default=-1) + 1)
        return lost

    def _damaged_tier(self, chunk: int) -> str:
        """Where a chunk found damaged at restore lives: a remote one has checksums (its
        record goes: the chunk is unreferenced from now on)."""
        checksums = self._chunks.placement.checksums
        if checksums is not None and chunk in checksums:
            checksums.delete([chunk])
            return "remote"
        return "ssd"


def _codes(book: Codebook, values: pa.ChunkedArray | list | None, n: int) -> np.ndarray:
    """Codebook codes of group or task strings (an Arrow column, or a list from the
    journal); -1 for each of n items when the table has none."""
    if values is None:
        return np.full(n, -1, np.int64)
    return book.encode(pa.array(values, pa.string()) if isinstance(values, list) else values)


def _with_released(data: pa.RecordBatch, released: np.ndarray, sizes: np.ndarray) -> pa.RecordBatch:
    """Rows read back from a table with group timeouts: ``group_released_partial`` filled
    in, and ``group_size`` corrected to what arrived for rows of released groups (of
    the columns ``data`` has)."""
    names = data.schema.names
    if group_timeouts.COLUMN in names:
        i = names.index(group_timeouts.COLUMN)
        data = data.set_column(i, data.schema.field(i), pa.array(released, pa.bool_()))
    if "group_size" in names and released.any():
        i = names.index("group_size")
        stored = data.column(i).to_numpy(zero_copy_only=False)
        values = np.where(released, sizes, np.nan_to_num(stored.astype(np.float64), nan=-1)).astype(np.int64)
        mask = ~released & data.column(i).is_null().to_numpy(zero_copy_only=False)
        data = data.set_column(i, data.schema.field(i), pa.array(values, pa.int32(), mask=mask))
    return data


def _chunk_runs(chunks: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of equal values in a sorted array."""
    starts = np.flatnonzero(np.r_[True, chunks[1:] != chunks[:-1]]) if len(chunks) else np.zeros(0, np.int64)
    ends = np.append(starts[1:], len(chunks))
    return list(zip(starts.tolist(), ends.tolist()))


def occurrence_rank(values: np.ndarray) -> np.ndarray:
    """For each entry, how many equal entries come before it: [5, 3, 5, 5] -> [0, 0, 1, 2]."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.ones(len(values), dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(values)), 0))
    rank = np.empty(len(values), dtype=np.int64)
    rank[order] = np.arange(len(values)) - first
    return rank


@dataclass(frozen=True)
class _Snapshot:
    plan: ReadPlan
    schema: pa.Schema
    item_ids: np.ndarray
    priorities: np.ndarray
    times_sampled: np.ndarray
    policy_versions: np.ndarray
    probabilities: np.ndarray | None
    weights: np.ndarray | None
    released: np.ndarray | None = None  # bool per row: its group was released partial
    group_sizes: np.ndarray | None = None  # the index's group_size per row (corrected on release)
