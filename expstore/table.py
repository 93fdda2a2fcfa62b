"""A table: item index + payload tier + sampler + remover + rate limiter + consumer groups.

The table is a composition: ``Parts.build`` (parts.py) hands it its parts from the spec,
and it owns the lock, admission and the order of each operation (validate, journal,
apply, read). Beside it: gate.py holds the lock, the change notifications and the lines
of blocked calls, intake.py checks what a call brings, reads.py plans and reads rows (and
scans), stats.py gathers the stats, streams.py serves consumer groups, reservations.py
paced admission, group_timeouts.py fires group timeouts, quarantine.py takes damaged
items out, removals.py takes items out (every way they leave) and makes room for
inserts, movement.py moves chunks between tiers, records.py types the journal's records
(and replays each) and recovery.py rebuilds the table from them.

Concurrency model: one ``threading.Condition`` per table (``Gate.lock``) guards all of its state. Every
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

import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from . import ingest_checks, recovery
from . import schema as protocol
from .admission import Admission, Wait
from .errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from .intake import Intake, PreparedInsert, rows_in_chunks
from .movement import Mover
from .parts import Backing, Parts
from .gate import Gate
from .group_timeouts import GroupTimer
from .quarantine import Quarantine, Quarantiner
from .reads import PlannedRows, Reader, Rows
from .removals import Removals
from .pacing import Reservation
from .records import Inserted, PrioritySet, Record, Sampled, VersionSet
from .reservations import Reservations
from .samplers.base import Codebook, Items
from .samplers.capped import sample_capped
from .stats import STALENESS_BUCKETS, Staleness, table_stats  # noqa: F401 (STALENESS_BUCKETS: users import it from here)
from .spec import TableSpec
from .streams import DEFAULT_VISIBILITY_TIMEOUT, Streams
from .tiers.checksums import RemoteChecksums
from .turns import Turn


@dataclass(frozen=True)
class InsertResult:
    item_ids: np.ndarray  # uint64, one per row (the stored id for duplicates)
    num_inserted: int
    num_duplicates: int
    num_stale: int
    # Per row (bool): a new item (stale ones included), and a stale one; what a caller
    # that committed several calls' rows at once needs to answer each (server coalescing).
    inserted: np.ndarray | None = field(default=None, compare=False)
    stale: np.ndarray | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PriorityUpdate:
    num_updated: int  # distinct live items whose priority was set
    unknown_item_ids: np.ndarray  # uint64: ids naming no live item, once each, in call order; ignored


class Table:
    def __init__(self, spec: TableSpec, *, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic, storage: Backing | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        """A table of the parts ``spec`` describes (``Parts.build``); ``storage`` where a
        durable one keeps its data. ``clock`` times waits and deadlines of calls;
        ``wall_clock`` stamps ``inserted_at`` and times group timeouts (it must survive a
        restart)."""
        spec = spec.resolved(durable=storage is not None)
        self.spec = spec
        self.name = spec.name
        self.schema = protocol.table_schema(spec.kind, spec.schema, table=spec.name, added=spec.engine_columns())
        self._trajectory = spec.kind == "trajectory"
        self._clock = clock
        self._wall_clock = wall_clock
        self._rng = np.random.default_rng(seed)
        self._gate = gate = Gate(spec.name)  # the lock, change notifications, lines of blocked calls

        self.storage = storage if spec.tiers != "memory" else None
        self.replaying = False  # replaying the journal: journal off, chunks adopted after
        self.counters: Counter[str] = Counter()
        self._parts = parts = Parts.build(spec, storage, clock, self.counters)
        self._index, self._chunks, self._consumers = parts.index, parts.chunks, parts.consumers
        self._sampler, self._remover, self._limiter = parts.sampler, parts.remover, parts.limiter
        self._tasks, self._groups, self._keys = parts.tasks, parts.groups, parts.keys
        self._archive, self._quarantine, self._journal = parts.archive, parts.quarantine, parts.journal
        self._timeouts, self._checks, self._lineage = parts.timeouts, parts.checks, parts.lineage
        self._pacing, self._retention = parts.pacing, parts.retention
        self._mover = Mover(self, parts.chunks, parts.archive)
        self._streams = Streams(self, parts.consumers)
        self._reader = Reader(self, parts.index, parts.chunks.placement, parts.timeouts)
        self._intake = Intake(spec, self.schema, parts.checks, durable=parts.journal is not None,
                              server_filled=parts.timeouts is not None,
                              versioned="data_version" in self.schema.names and spec.sampler.mixed,
                              pace=parts.pacing, group_size=parts.sampler.group_size)
        self._reservations = Reservations(self, gate, parts.pacing, clock)
        self._group_timer = GroupTimer(self, parts, spec.group_timeout_action, self.counters)
        self._quarantiner = Quarantiner(self, parts.index, parts.chunks.placement, parts.quarantine)
        self._removals = Removals(self, parts, self._mover, self._rng, self.counters)
        self._touches = 0  # inserts and priority updates so far: the index's "touched" column
        self.policy_version = 0
        self._staleness = Staleness(self.counters)  # of the items sample and stream return

    # -- inserts ----------------------------------------------------------------------

    def prepare_insert(self, data: Sequence[pa.RecordBatch | pa.Table] | pa.RecordBatch | pa.Table,
                       priorities: np.ndarray | Sequence[float] | None = None,
                       durability: str | None = None) -> PreparedInsert:
        """Conform and validate rows, and write their chunks to the SSD tier (no lock
        held). Raises InvalidArgument naming the table, row and column of the first
        problem; nothing is applied then. A prepared insert is committed (perhaps after
        retries) or abandoned."""
        prep, whole = self._intake.prepare(data, priorities, durability)
        if self._trajectory and self._checks is not None:
            prep.references = ingest_checks.check_against_stored(self, whole, prep.episodes)
        try:
            for b in prep.batches:  # the SSD writes, outside the lock
                prep.staged.append(self._chunks.stage(b, prep.durability))
        except BaseException:
            self.abandon_insert(prep)
            raise
        return prep

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
        with self.lock:
            line = self._gate.lines["insert"]
            if (held := self._gate.held(line, turn)) is not None:
                return held
            self.check_open()
            self.tick()
            ids, new = self._dedup(prep.keys, prep.num_rows)
            n_new = int(new.sum())
            if n_new == 0:
                self.counters["duplicates"] += prep.num_rows
                self._chunks.placement.delete([s.chunk_id for s in prep.staged])
                prep.staged.clear()
                none = np.zeros(prep.num_rows, bool)
                return InsertResult(ids, 0, prep.num_rows, 0, none, none)
            self._limiter.check_insert_batch(n_new)
            if not line.first(turn):
                return Wait(f"{line.ahead_of(turn)} earlier inserts are waiting (first come, first served)",
                            self.epoch)
            if not self._limiter.can_insert(n_new):
                return Wait(f"rate limiter: {n_new} inserts must wait for samples", self.epoch)
            with self._gate.admitted(line, turn):
                result, compaction = self._apply_insert(prep, ids, new, prep.durability)
            prep.staged.clear()
        if prep.durability == "fsync":
            self.storage.db.sync()  # one fsync covers every write before it: group commit
        if compaction is not None:  # the insert that starts a compaction pass waits for it (Mover.compact)
            futures.wait([compaction])
        return result

    def abandon_insert(self, prep: PreparedInsert) -> None:
        """Free the chunks of an insert that will not be committed."""
        if prep.staged:
            with self.lock:
                self._chunks.placement.delete([s.chunk_id for s in prep.staged])
                prep.staged.clear()

    def _apply_insert(self, prep: PreparedInsert, ids: np.ndarray, new: np.ndarray,
                      durability: str) -> tuple[InsertResult, futures.Future | None]:
        """Commit a prepared insert (lock held): its result, and the compaction pass it
        started, if any."""
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
        chunks, unused = prep.chunks(store, keep_dead_rows=self._journal is not None)
        nbytes = sum(s.batch.get_total_buffer_size() for _, _, s in chunks)
        # Chosen before the new rows enter: the remover never evicts a row of this insert
        # (Reverb's code inserts first, then removes; its docs say what we do).
        victims = self._removals.victims(len(self._index) + n_store - self.spec.max_size)
        if self._journal is None:
            self._removals.check_budget(nbytes, victims)
        chunk_of_row, row_in_chunk = rows_in_chunks(chunks, store)
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
        groups, tasks, keys = prep.groups, prep.tasks, prep.keys
        if n_new < n:  # (as a rule every row is new: no copies then)
            groups = groups.take(pa.array(new_rows)) if groups is not None else None
            tasks = tasks.take(pa.array(new_rows)) if tasks is not None else None
            keys = [keys[i] for i in new_rows.tolist()] if keys is not None else None
        new_ids = np.arange(self._index.next_id, self._index.next_id + n_new, dtype=np.uint64)
        reservations = None if prep.reservations is None else prep.reservations[new_rows]
        if self._journal is not None:  # logged first: a failed write changes nothing
            self.journal(Inserted(
                insert_durability=durability, ids=new_ids, stored=store[new_rows], keys=keys,
                groups=_labels(groups), tasks=_labels(tasks), reservations=reservations,
                victims=self._index["id"][victims], **rows),
                durability)
        # From here on the insert is applied whole.
        self.remove_slots(victims, "max_size", log=False)
        self._chunks.placement.delete(unused)
        for lo, hi, s in chunks:
            self._chunks.add(s, live=int(store[lo:hi].sum()))
        ids[new_rows] = new_ids
        if reservations is not None:
            self._pacing.settle(reservations)
        self.add_items(new_ids, rows, groups, tasks, keys, store[new_rows], late[new_rows])
        if prep.references is not None:
            kept = store[new_rows]
            names = groups.to_pylist() if "group_prefix" in self._checks.names else [None] * n_new
            self._lineage.record(rows.get("episode", np.zeros(n_new, np.int64))[kept],
                                 [g for g, k in zip(names, kept.tolist()) if k], new_ids[kept], prep.references)
            self._lineage.purge(self._index.is_live, len(self._index))
        self.counters["inserted_bytes"] += nbytes
        self.counters["duplicates"] += n - n_new
        compaction = self._mover.compact()
        self.changed()
        return InsertResult(ids, n_new, n - n_new, int((stale & new).sum()), new, stale & new), compaction

    def add_items(self, ids: np.ndarray, rows: dict[str, np.ndarray], groups, tasks,
                   keys: list[str] | None, stored: np.ndarray, late: np.ndarray | None = None) -> None:
        """Index new items and offer the stored ones to the selectors (insert and replay).
        Rows not stored are stale, or ``late`` (their group timed out)."""
        n = len(ids)
        slots, _ = self._index.add(n, ids=ids, group=_codes(self._groups, groups, n),
                                   task=_codes(self._tasks, tasks, n), **rows)
        self._index["touched"][slots] = self._touch(n)
        if self._keys is not None:
            self._keys.add(slots, keys, ids)
        items = self.items(slots[stored])
        self._sampler.insert(items)
        self._remover.insert(items)
        self._removals.added(len(items))
        # Rows too stale to store never count for the rate limiter: counted as inserts no
        # sample could ever match, they would hold producers back while the sampler starves.
        self._limiter.insert(int(stored.sum()))
        if self._timeouts is not None:
            self._timeouts.arrived(self._index["group"][slots[stored]], rows["inserted_at"][stored])
        if not stored.all():  # never in a tier or a selector
            late = np.zeros(n, bool) if late is None else late
            self._removals.forget(slots[~stored & ~late], "stale", limited=False)
            self._removals.forget(slots[late], "group_late", limited=False)
        self.remove_slots(self._sampler.rejected(), "zero_variance", log=False)  # replay redoes it
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
        self._intake.sample_size(n, self._sampler.unit)
        kw = self._intake.version_ranges(data_versions)
        with self.lock:
            line = self._gate.lines["sample"]
            if (held := self._gate.held(line, turn)) is not None:
                return held
            self.check_open()
            self.tick()
            self._limiter.check_sample_batch(n)  # re-checked: other calls move the limit
            if (ahead := self._gate.ahead(line, turn)) is not None:
                return ahead
            if not self._limiter.can_sample(n):
                return Wait(f"rate limiter: {n} samples must wait for inserts ({len(self._index)} items)",
                            self.epoch)
            if not (self._sampler.can_sample(n, **kw) and self._removals.can_sample(n)):
                why = f"the {self.spec.sampler.type} sampler cannot serve {n} items yet ({len(self._sampler)} eligible)"
                detail = self._sampler.explain(n, **kw)
                return Wait(why + (f": {detail}" if detail else ""), self.epoch,
                            retry_after=self._group_timer.retry_after())
            with self._gate.admitted(line, turn):
                rows = self._sample_now(n, step, kw)
        return self.read(rows)

    def _sample_now(self, n: int, step: int | None, kw: dict) -> PlannedRows:
        """Draw an admitted sample of n (lock held): selection, times_sampled, removals
        under max_times_sampled, the journal record and the rows' read plan."""
        capped = self.spec.max_times_sampled > 0
        if capped and self._sampler.with_replacement:
            slots, probabilities, weights, done = sample_capped(
                self._sampler, self._index["times_sampled"], self.spec.max_times_sampled, n, self._rng, **kw)
        else:
            sel = self._sampler.sample(n, self._rng, **kw)
            slots, probabilities, weights = sel.slots, sel.probabilities, sel.weights
            np.add.at(self._index["times_sampled"], slots, 1)  # slots repeat for i.i.d. samplers
            done = slots[self._index["times_sampled"][slots] >= self.spec.max_times_sampled] \
                if capped else slots[:0]
            if len(done):
                self._sampler.remove(done)
        if self._sampler.with_replacement:  # i.i.d. draws: return them in storage order
            order = np.lexsort((self._index["row"][slots], self._index["chunk"][slots]))
            slots, probabilities, weights = slots[order], probabilities[order], weights[order]
        self.journal(Sampled(ids=self._index["id"][slots], n=len(slots)))
        self.count_samples(len(slots))  # fewer than n: groups released partial
        self.record_staleness("sample", slots)
        if step is not None:
            self._streams.record_manifest(step, slots)
        rows = self.plan_read(slots, probabilities=probabilities, weights=weights)
        self.remove_slots(done, "max_times_sampled", in_sampler=False)
        self.changed()
        return rows

    # -- what falls due by the wall clock ---------------------------------------------

    def tick(self) -> None:
        """Settle what fell due before a call reads the table (lock held): leases that
        ended (reservations.py), rows leaving the hot window (retention.py), groups whose
        timeout passed (group_timeouts.py). Lazy, so that no timer thread is needed."""
        if self._gate.closed:
            return
        self._reservations.expire()
        if self._retention is not None:
            left = 0
            for slots in self._retention.leaving(self._index, lambda: self._chunks.nbytes, self._wall_clock()):
                self.remove_slots(slots, "retention")
                left += len(slots)
            if left:
                self.changed()
        self._group_timer.tick()

    # -- paced admission (reservations.py) ---------------------------------------------

    def reserve(self, n: int, timeout: float | None = None, lease_s: float | None = None) -> Reservation:
        """Reserve admission for a rollout of ``n`` rows before starting it (paced
        tables). Blocks (up to ``timeout``; None: forever) while the pace holds it back;
        blocked reservations are granted first come, first served."""
        return self._reservations.reserve(n, timeout, lease_s)

    def try_reserve(self, n: int, turn: Turn, lease_s: float | None = None) -> Reservation | Wait:
        """One attempt to reserve (admission.py): the reservation, or a ``Wait`` while the
        pace or earlier reservations in line hold it back (``retry_after``: when the next
        lease ends and gives its rows back)."""
        return self._reservations.try_reserve(n, turn, lease_s)

    def release(self, reservation_id: int) -> int:
        """Give back a reservation's rows not inserted yet (a rollout abandoned); returns
        how many. A reservation already settled, released or expired gives back 0."""
        return self._reservations.release(reservation_id)

    def _touch(self, n: int) -> np.ndarray:
        """The next n values of the insert-or-update counter (index column "touched")."""
        out = np.arange(self._touches, self._touches + n, dtype=np.int64)
        self._touches += n
        return out

    def count_samples(self, n: int) -> None:
        """A sample returned n rows (a live one, or its replay): the allowance under
        max_times_sampled, the rate limiter and the stats count them."""
        self._removals.sampled(n)
        self._limiter.sample(n)
        self.counters["samples"] += n

    def record_staleness(self, op: str, slots: np.ndarray) -> None:
        """Count returned items by how many policy versions they are behind the table's."""
        self._staleness.record(op, np.maximum(self.policy_version - self._index["policy_version"][slots], 0))

    def update_priorities(self, item_ids, priorities) -> PriorityUpdate:
        """Set the priorities of the live items among ``item_ids``, in call order (the
        last entry wins for a repeated id). Ids of items that left (or never were) are
        ignored and reported, as Reverb ignores them: a trainer updating the batch it
        sampled still updates the items that remain when some have been removed since."""
        ids = self._intake.item_ids(item_ids)
        pr = self._intake.priorities(priorities, len(ids), required=True)
        with self.lock:
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
                self.journal(PrioritySet(ids=self._index["id"][slots], priorities=pr))
                self.set_priorities(slots, pr)
                self.changed()
            return PriorityUpdate(len(slots), unknown)

    def set_priorities(self, slots: np.ndarray, pr: np.ndarray) -> None:
        """Set priorities (distinct slots; lock held; ``update_priorities`` and its
        replay), in the order given: heap ties go to the least recently touched item."""
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
        with self.lock:
            if version < self.policy_version:
                raise FailedPrecondition(f"table {self.name!r}: policy version must not decrease "
                                         f"(current {self.policy_version}, got {version})")
            self.journal(VersionSet(version=version))
            self.policy_version = version
            stale = np.zeros(0, dtype=np.int64)
            if self._stale_cutoff() >= 0:  # else nothing can be stale: skip the O(n) scan
                live = self._index.live_slots()
                stale = live[self._index["policy_version"][live] < self._stale_cutoff()]
                self.remove_slots(stale, "stale")
            self.changed()
            return len(stale)

    # -- streams ----------------------------------------------------------------------

    def stream(self, group: str, n: int, timeout: float | None = None,
               visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT, start: str = "earliest") -> Rows:
        """Deliver up to n items to a consumer group, in insertion order: first redeliveries
        of expired unacked items, then unread ones. Blocks (up to ``timeout``) until at
        least one is available."""
        return self._streams.stream(group, n, timeout, visibility_timeout, start)

    def try_stream(self, group: str, n: int, visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
                   start: str = "earliest") -> Rows | Wait:
        """One attempt to deliver to a consumer group (admission.py): the rows, or a
        ``Wait`` while the group is caught up (``retry_after``: when its next unacked
        item falls due for redelivery)."""
        return self._streams.try_stream(group, n, visibility_timeout, start)

    def ack(self, group: str, item_ids) -> tuple[int, int]:
        """Ack items delivered to a group; (newly acked, already acked). An id never
        delivered to the group is NOT_FOUND and nothing is acked."""
        return self._streams.ack(group, self._intake.item_ids(item_ids))

    def nack(self, group: str, item_ids) -> int:
        """Hand items delivered to a group back to it, unprocessed: they are due again
        now, and the group's next reads deliver them first (oldest first) rather than
        after their visibility timeout. Returns how many were in flight (an acked one
        stays acked). An id never delivered to the group is NOT_FOUND and nothing changes."""
        return self._streams.nack(group, self._intake.item_ids(item_ids))

    def commit_cut(self, group: str, step: int, item_ids=(), tag: str = "") -> int:
        """A trainer's training cut, atomically: ack ``item_ids`` (what step ``step``
        consumed), remember the group's position under ``step``, and record the ids
        (with their policy versions; -1 for an item no longer in the table) as step
        ``step``'s manifest, replacing what an earlier commit of ``step`` recorded (a
        retried commit, or a step trained again after ``resume``). Returns the number
        newly acked. ``resume(group, step)`` later redelivers exactly what came after.
        A cut with no ids creates a group that has not read yet (at the earliest item),
        so that a trainer can mark step 0 before its first read."""
        return self._streams.commit_cut(group, step, self._intake.item_ids(item_ids), tag)

    def resume(self, group: str, step: int) -> dict[str, int]:
        """Rewind a consumer group to its cut at ``step``: what was in flight then is
        delivered again first, then everything after the cut's position, acked or not
        (a trainer restarting from its step-``step`` checkpoint retrains step+1 on).
        The manifests of later steps are forgotten: those steps will be trained again."""
        return self._streams.resume(group, step)

    def manifest(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(item ids, policy versions) sampled for training step ``step``, in order."""
        return self._streams.manifest(step)

    def wait_for_background(self) -> None:
        """Return once the read-ahead and compaction passes started so far have run
        (``Mover.wait_for_background``): what a test or an operator reading the memory
        cache's contents or the table's chunks waits for."""
        self._mover.wait_for_background()

    def demote(self) -> int:
        """One pass of the store's mover over the remote tier (``Mover.demote``)."""
        return self._mover.demote()

    def archive_pending(self) -> int:
        """One pass of the store's mover over the archive queue (``Mover.archive_pending``)."""
        return self._mover.archive_pending()

    def purge(self) -> None:
        """Delete everything the table stored (DropTable of a durable table; after close).
        The remote tier goes first, every fragment of the table's datasets (those a crash
        left unrecorded too): if it is down, Unavailable leaves the table whole."""
        self._mover.purge()

    # -- reads ------------------------------------------------------------------------

    def get(self, item_ids) -> Rows:
        """Items by id, in the given order. NOT_FOUND names the first unknown id."""
        ids = self._intake.item_ids(item_ids)
        with self.lock:
            self.tick()
            rows = self.plan_read(self._lookup(ids))
        return self.read(rows)

    def scan(self, columns: Sequence[str] | None = None, *, min_policy_version: int | None = None,
             max_policy_version: int | None = None, inserted_after: float | None = None,
             inserted_before: float | None = None) -> Iterator[pa.RecordBatch]:
        """Live items for queries and audits, one record batch per chunk: the payload
        ``columns`` (None: all) plus the server's ``item_id``, ``priority``,
        ``times_sampled``, ``inserted_at`` (Unix seconds) and ``tier``. Items are pruned
        with the index before any payload is read; the chunks are pinned at the start
        (a consistent set of items) and read one at a time, so memory holds one chunk."""
        return self._reader.scan(self.schema.names, columns, policy_versions=(min_policy_version, max_policy_version),
                                 inserted=(inserted_after, inserted_before))

    def scan_archive(self, columns: Sequence[str] | None = None) -> pa.RecordBatchReader | None:
        """The archived (removed) items (``Mover.scan_archive``); None without an archive."""
        return self._mover.scan_archive(columns)

    def scan_quarantined(self, columns: Sequence[str] | None = None) -> pa.RecordBatchReader:
        """The quarantined items for queries: ``_item_id`` and the payload ``columns``
        (None: all), which are null (their stored bytes are damaged)."""
        with self.lock:
            ids = self._quarantine.ids()
        fields = [self.schema.field(c) for c in (self.schema.names if columns is None else columns)]
        return Quarantine.as_rows(ids, fields)

    def remote_tiers(self) -> list:
        """The table's remote tiers (its chunks', its archive's), for checkpoints and
        DropTable: their state (``version``, ``hold``) only while holding ``remote_lock``."""
        return self._mover.remote_tiers()

    @property
    def remote_lock(self) -> threading.Lock:
        """Held by every use of the remote tiers: while it is held, none of their datasets
        gets a commit."""
        return self._chunks.placement.remote_lock

    def __len__(self) -> int:
        return len(self._index)

    def stats(self) -> dict[str, float]:
        """Flat counters (documented in docs/stats.md)."""
        with self.lock:
            self.tick()
            return table_stats(self._parts, self.counters, self._staleness, self.policy_version,
                               self._gate.waiting("insert", "sample"))

    # -- lifecycle --------------------------------------------------------------------

    def record_wait(self, op: str, seconds: float | None = None) -> None:
        """Count a call's wait (``admission.Admission`` does, for every waiter): once
        as it begins (no seconds), then with the time it took."""
        with self.lock:
            if seconds is None:
                self.counters[f"{op}_waits"] += 1
            else:
                self.counters[f"{op}_wait_seconds"] += seconds

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change (under the lock: it must not block):
        the asyncio server's waiter."""
        self._gate.subscribe(listener)

    def close(self) -> None:
        """Wake every waiter with UNAVAILABLE; later calls fail the same way."""
        with self.lock:
            self._gate.close()
            self.changed()
        self._mover.close()  # the read-ahead thread, the remote tiers' reader threads

    # -- damage (quarantine.py) --------------------------------------------------------

    def quarantine_damage(self, error: DataLoss) -> int:
        """Quarantine the live items stored where a read found damage (lock held;
        ``Quarantiner.damage``). Returns how many items were quarantined."""
        return self._quarantiner.damage(error)

    def quarantine_event(self, chunk: int, tier: str, reason: str, ids: np.ndarray) -> None:
        """Journal and remember one damage event (lock held; the caller removes its live items)."""
        self._quarantiner.event(chunk, tier, reason, ids)

    # -- internals --------------------------------------------------------------------

    def plan_read(self, slots: np.ndarray, probabilities=None, weights=None) -> PlannedRows:
        """The rows' facts and read plan (lock held; ``Reader.plan``), read after it."""
        return self._reader.plan(slots, probabilities, weights)

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        slots = self._index.lookup(ids)
        if (slots < 0).any():
            self._quarantiner.check_not_quarantined(ids[slots < 0])
            missing = int(ids[slots < 0][0])
            raise NotFound(f"table {self.name!r}: no item with id {missing} "
                           f"({int((slots < 0).sum())} of {len(ids)} ids unknown or removed)")
        return slots

    def remove_slots(self, slots: np.ndarray, reason: str, *, in_sampler: bool = True, log: bool = True) -> None:
        """Remove live items (lock held; ``Removals.remove``, which says what the flags mean)."""
        self._removals.remove(slots, reason, in_sampler=in_sampler, log=log)

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

    def turn(self, op: str, origin: Hashable | None = None) -> Turn:
        """A place in line for one ``"insert"``, ``"sample"`` or ``"reserve"`` call: pass
        it to every attempt (``try_insert``, ...), and to ``leave`` when the call ends,
        however it ends (``admission.Admission`` does). ``origin``: the client connection,
        whose calls reach the table in the order they are handed to ``expect``."""
        return self._gate.turn(op, origin)

    def expect(self, turn: Turn) -> None:
        """Register a turn as its first attempt is handed to an engine thread (gate.py;
        never takes the table's lock: safe on the server's event loop)."""
        self._gate.expect(turn)

    def in_line(self, op: str) -> int:
        """The ``"insert"`` or ``"sample"`` calls waiting in line (no lock: a glance)."""
        return self._gate.waiting(op)[op]

    def leave(self, turn: Turn) -> None:
        """End a call's turn (idempotent); the call behind it, if any, is woken."""
        self._gate.leave(turn)

    def wait_for_change(self, epoch: int, limit: float | None) -> None:
        """The in-process waiter (admission.py): block this thread until the table has
        changed since ``epoch`` (a ``Wait``'s), or for ``limit`` seconds (None: no limit)."""
        self._gate.wait_for_change(epoch, limit)

    def check_open(self) -> None:
        self._gate.check_open()

    def changed(self) -> None:
        """Wake waiters after a change (lock held); write a snapshot when it is due."""
        if self._journal is not None and self._journal.wants_snapshot():
            self._journal.snapshot(recovery.snapshot_fields(self))
        self._gate.wake()

    # -- for the table's parts (recovery.py, records.py, movement.py) ------------------

    @property
    def parts(self) -> Parts:
        return self._parts

    @property
    def lock(self) -> threading.Condition:
        """The table's one lock (see the module docstring)."""
        return self._gate.lock

    @property
    def closed(self) -> bool:
        return self._gate.closed

    @property
    def touches(self) -> int:
        """Inserts and priority updates so far (the next "touched" value)."""
        return self._touches

    @property
    def allowance(self) -> int:
        """Samples the live items may still take under ``max_times_sampled`` (0 without it)."""
        return self._removals.allowance

    def restore_counts(self, *, touches: int, allowance: int) -> None:
        """Set the counters a snapshot holds (recovery)."""
        self._touches = touches
        self._removals.allowance = allowance

    def items(self, slots: np.ndarray) -> Items:
        """The selectors' view of items (their index columns)."""
        c = self._index.cols
        return Items(slots=slots, ids=c["id"][slots], priorities=c["priority"][slots],
                     groups=c["group"][slots], group_sizes=c["group_size"][slots],
                     tasks=c["task"][slots], rewards=c["reward"][slots], data_versions=c["data_version"][slots])

    def journal(self, record: Record, durability: str = "wal", **extras) -> None:
        """Append a change to the journal (durable tables; not while replaying it).
        ``extras``: manifest edits that go in the same write (``Journal.append``)."""
        if self._journal is not None and not self.replaying:
            self._journal.append(record.kind, durability, **extras, **record.fields())

    def drop_journal(self) -> None:
        """Delete the table's journal and the checksums of its remote chunks (DropTable)."""
        self._journal.drop()
        RemoteChecksums(self.storage.db, self.storage.table_id).drop()  # of every kind

    def settle_groups(self, names: list[str], action: str) -> None:
        """Time out the forming groups named (replay; ``GroupTimer.settle_named``)."""
        self._group_timer.settle_named(names, action)

    def wall_clock(self) -> float:
        """The clock of ``inserted_at``, group timeouts, leases and retention windows."""
        return self._wall_clock()

    @property
    def epoch(self) -> int:
        """Changes so far (a ``Wait`` carries it; lock held)."""
        return self._gate.epoch

    def read(self, planned: PlannedRows, columns: list[str] | None = None) -> Rows:
        """The rows of a plan (``columns``: None, all), read with no lock held (``Reader.gather``)."""
        return self._reader.gather(planned, columns)

    def read_ahead(self, chunks: list[int], *, if_room: bool = False) -> None:
        """Read chunks into the memory cache in the background (lock held; ``Mover.read_ahead``)."""
        self._mover.read_ahead(chunks, if_room=if_room)

    def restore(self) -> dict[str, int]:
        """Rebuild a durable table from its journal after a restart (recovery.py)."""
        with self.lock:
            return recovery.restore(self)


def _labels(values: pa.ChunkedArray | None) -> pa.ChunkedArray | None:
    """Group or task strings as the journal keeps them: the Arrow column (packed as it is),
    or None where no row has one (replayed as none, as ``_codes`` reads it)."""
    return None if values is None or values.null_count == len(values) else values


def _codes(book: Codebook, values: pa.ChunkedArray | list | None, n: int) -> np.ndarray:
    """Codebook codes of group or task strings (an Arrow column, or a list from the
    journal); -1 for each of n items when the table has none."""
    if values is None:
        return np.full(n, -1, np.int64)
    return book.encode(pa.array(values, pa.string()) if isinstance(values, list) else values)
