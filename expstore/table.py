"""A table: item index + payload tier + sampler + remover + rate limiter + consumer groups.

Concurrency model: one ``threading.Condition`` per table guards all of its state. Every
public method takes it for a short, non-blocking critical section of numpy work; payload
rows are gathered from the (immutable) chunk batches *after* releasing it, and validation
of inserted data happens *before* taking it. Blocking calls wait on the condition with a
deadline (the table owns waiting; the rate limiter is arithmetic). Callers that cannot
block a thread (the asyncio server) call with ``timeout=0`` and wait for ``subscribe``
notifications instead; a ``DeadlineExceeded`` then means "would block".

Bounds: ``max_size`` bounds items (the remover makes room); the memory tier's budget
bounds bytes (an insert that cannot fit is refused whole with RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import operator
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa

from . import schema as protocol
from .errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound,
                     ResourceExhausted, Unavailable)
from .chunks import ChunkStore
from .gather import take_rows
from .index import ItemIndex
from .keys import KeyRegistry
from .ratelimit import RateLimiter
from .samplers import make_remover, make_sampler
from .samplers.base import Codebook, Items
from .spec import TableSpec
from .streams import ConsumerGroup
from .tiers.memory import MemoryTier

DEFAULT_VISIBILITY_TIMEOUT = 60.0
# Samplers whose selections are i.i.d.: their rows may be returned in storage order.
_UNORDERED = ("uniform", "prioritized")


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
class Rows:
    """Rows out of a table (Sample, Stream, Get) with their per-row facts, row-aligned."""

    data: pa.RecordBatch
    item_ids: np.ndarray
    priorities: np.ndarray
    times_sampled: np.ndarray
    policy_versions: np.ndarray
    probabilities: np.ndarray | None = None
    weights: np.ndarray | None = None


class Table:
    def __init__(self, spec: TableSpec, *, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.name = spec.name
        self.schema = protocol.table_schema(spec.kind, spec.schema, table=spec.name)
        self._trajectory = spec.kind == "trajectory"
        self._clock = clock
        self._rng = np.random.default_rng(seed)
        self._cond = threading.Condition()
        self._listeners: list[Callable[[], None]] = []
        self._closed = False

        self._index = ItemIndex()
        self._chunks = ChunkStore(MemoryTier(spec.memory_bytes))
        self._keys = KeyRegistry(spec.dedup_window) if spec.key is not None else None
        self._tasks, self._groups = Codebook(), Codebook()
        self._sampler = make_sampler(spec.sampler, self._tasks)
        self._remover = make_remover(spec.remover)
        self._limiter = RateLimiter.from_spec(spec.rate_limiter)
        self._consumers: dict[str, ConsumerGroup] = {}

        # Samples the live items may still take under max_times_sampled (sum of allowances).
        self._allowance = 0
        self.policy_version = 0
        self.counters: Counter[str] = Counter()

    # -- inserts ----------------------------------------------------------------------

    def prepare_insert(self, data: Sequence[pa.RecordBatch | pa.Table] | pa.RecordBatch | pa.Table,
                       priorities: np.ndarray | Sequence[float] | None = None) -> PreparedInsert:
        """Conform and validate rows (no lock held). Raises InvalidArgument naming the
        table, row and column of the first problem; nothing is applied then."""
        parts = [data] if isinstance(data, (pa.RecordBatch, pa.Table)) else list(data)
        if not parts:
            raise InvalidArgument(f"table {self.name!r}: insert of no rows")
        batches: list[pa.RecordBatch] = []
        offset = 0
        for part in parts:
            t = protocol.conform(part, self.schema, table=self.name)
            if self._trajectory:
                protocol.validate_trajectories(t, table=self.name, row_offset=offset)
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
            return PreparedInsert(
                batches=batches, keys=keys, priorities=pr,
                policy_versions=whole.column("policy_version").to_numpy().astype(np.int64),
                groups=groups, group_sizes=group_sizes, tasks=whole.column("task"),
                rewards=whole.column("reward").cast(pa.float64()).fill_null(np.nan).to_numpy())
        return PreparedInsert(
            batches=batches, keys=keys, priorities=pr, policy_versions=np.zeros(n, np.int64),
            groups=None, group_sizes=np.zeros(n, np.int64), tasks=None,
            rewards=np.full(n, np.nan))

    def insert(self, data, priorities=None, timeout: float | None = None) -> InsertResult:
        """Validate and store rows, all or none. Blocks (up to ``timeout`` seconds; None:
        forever) while the rate limiter holds inserts back."""
        return self.commit_insert(self.prepare_insert(data, priorities), timeout)

    def commit_insert(self, prep: PreparedInsert, timeout: float | None = None) -> InsertResult:
        deadline = self._deadline(timeout)
        with self._cond:
            while True:
                self._check_open()
                ids, new = self._dedup(prep.keys, prep.num_rows)
                n_new = int(new.sum())
                if n_new == 0:
                    self.counters["duplicates"] += prep.num_rows
                    return InsertResult(ids, 0, prep.num_rows, 0)
                self._limiter.check_insert_batch(n_new)
                if self._limiter.can_insert(n_new):
                    break
                self._wait(deadline, "insert", f"rate limiter: {n_new} inserts must wait for samples")
            return self._apply_insert(prep, ids, new)

    def _apply_insert(self, prep: PreparedInsert, ids: np.ndarray, new: np.ndarray) -> InsertResult:
        n = prep.num_rows
        n_new = int(new.sum())
        stale = new & (prep.policy_versions < self._stale_cutoff())
        store = new & ~stale
        n_store = int(store.sum())
        if n_store > self.spec.max_size:
            raise InvalidArgument(f"table {self.name!r}: an insert of {n_store} rows exceeds "
                                  f"max_size={self.spec.max_size}; split it")
        # Chunks to store: rows of duplicates or stale rows are dropped from them first.
        offsets = np.cumsum([0] + [b.num_rows for b in prep.batches])
        chunks: list[tuple[int, int, pa.RecordBatch]] = []
        for b, lo, hi in zip(prep.batches, offsets[:-1].tolist(), offsets[1:].tolist()):
            keep = store[lo:hi]
            if keep.any():
                chunks.append((lo, hi, b if keep.all() else b.filter(pa.array(keep))))
        nbytes = sum(b.get_total_buffer_size() for _, _, b in chunks)
        victims = self._victims(len(self._index) + n_store - self.spec.max_size)
        self._check_budget(nbytes, victims)
        # Nothing has changed so far; from here on the insert is applied whole.
        self._remove(victims, "max_size")
        chunk_of_row = np.full(n, -1, dtype=np.int64)
        row_in_chunk = np.zeros(n, dtype=np.int64)
        for lo, hi, b in chunks:
            chunk = self._chunks.add(b)
            keep = store[lo:hi]
            chunk_of_row[lo:hi][keep] = chunk
            row_in_chunk[lo:hi][keep] = np.arange(b.num_rows)
        # Index every new row; stale ones are removed again at once (ids stay unique).
        new_rows = np.flatnonzero(new)
        groups = self._groups.encode(prep.groups.take(pa.array(new_rows))) if prep.groups is not None \
            else np.full(n_new, -1, np.int64)
        tasks = self._tasks.encode(prep.tasks.take(pa.array(new_rows))) if prep.tasks is not None \
            else np.full(n_new, -1, np.int64)
        slots, new_ids = self._index.add(
            n_new, chunk=chunk_of_row[new_rows], row=row_in_chunk[new_rows],
            priority=prep.priorities[new_rows], policy_version=prep.policy_versions[new_rows],
            inserted_at=time.time(), group=groups, group_size=prep.group_sizes[new_rows],
            task=tasks, reward=prep.rewards[new_rows])
        ids[new_rows] = new_ids
        if self._keys is not None:
            self._keys.add(slots, [prep.keys[i] for i in new_rows.tolist()], new_ids)
        stored = store[new_rows]
        items = self._items(slots[stored])
        self._sampler.insert(items)
        self._remover.insert(items)
        self._allowance += self.spec.max_times_sampled * len(items)
        self._limiter.insert(n_new)
        n_stale = n_new - n_store
        if n_stale:
            self._forget(slots[~stored], "stale")  # never stored in a tier or a selector
        self._remove(self._sampler.rejected(), "zero_variance")
        self.counters["inserts"] += n_new
        self.counters["inserted_bytes"] += nbytes
        self.counters["duplicates"] += n - n_new
        self._maybe_compact()
        self._changed()
        return InsertResult(ids, n_new, n - n_new, n_stale)

    # -- sampling ---------------------------------------------------------------------

    def sample(self, n: int, timeout: float | None = None) -> Rows:
        """Sample n items with the table's sampler. Blocks (up to ``timeout``) until the
        rate limiter and the sampler can serve n."""
        if n < 1:
            raise InvalidArgument(f"table {self.name!r}: batch_size must be >= 1, got {n}")
        self._check_sample_size(n)
        deadline = self._deadline(timeout)
        with self._cond:
            while True:
                self._check_open()
                self._limiter.check_sample_batch(n)  # re-checked: other calls move the limit
                if self._limiter.can_sample(n):
                    if self._sampler.can_sample(n) and (not self.spec.max_times_sampled or self._allowance >= n):
                        break
                    why = f"the {self.spec.sampler.type} sampler cannot serve {n} items yet " \
                          f"({len(self._sampler)} eligible)"
                else:
                    why = f"rate limiter: {n} samples must wait for inserts ({len(self._index)} items)"
                self._wait(deadline, "sample", why)
            capped = self.spec.max_times_sampled > 0
            if capped and self.spec.sampler.type in _UNORDERED:
                slots, probabilities, weights, done = self._sample_capped(n)
            else:
                sel = self._sampler.sample(n, self._rng)
                slots, probabilities, weights = sel.slots, sel.probabilities, sel.weights
                np.add.at(self._index["times_sampled"], slots, 1)  # slots repeat for i.i.d. samplers
                done = slots[self._index["times_sampled"][slots] >= self.spec.max_times_sampled] \
                    if capped else slots[:0]
                self._sampler.remove(done)
            if self.spec.sampler.type in _UNORDERED:
                order = np.lexsort((self._index["row"][slots], self._index["chunk"][slots]))
                slots, probabilities, weights = slots[order], probabilities[order], weights[order]
            if capped:
                self._allowance -= n
            self._limiter.sample(n)
            self.counters["samples"] += n
            rows = self._snapshot(slots, probabilities=probabilities, weights=weights)
            self._remove(done, "max_times_sampled", in_sampler=False)
            self._changed()
        return rows.gather()

    def _sample_capped(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Sample with replacement while no item exceeds max_times_sampled, as Reverb's
        one-at-a-time sampling would: draws beyond an item's allowance are rejected, items
        that reach it leave the sampler, and the rejected draws are redrawn. Each round
        accepts at least one draw. Returns (slots, probabilities, weights, exhausted)."""
        ts, cap = self._index["times_sampled"], self.spec.max_times_sampled
        parts, exhausted, left = [], [], n
        while left:
            sel = self._sampler.sample(left, self._rng)
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

    def update_priorities(self, item_ids, priorities) -> int:
        ids = self._ids(item_ids)
        pr = self._priorities(priorities, len(ids), required=True)
        with self._cond:
            slots = self._lookup(ids)
            # Later entries win for repeated ids.
            slots, last = np.unique(slots[::-1], return_index=True)
            pr = pr[::-1][last]
            self._index["priority"][slots] = pr
            self._sampler.update(slots, pr)
            self._remover.update(slots, pr)
            self.counters["priority_updates"] += len(slots)
            self._changed()
            return len(slots)

    def set_policy_version(self, version: int) -> int:
        """Set the trainer's current policy version; with max_staleness, remove items that
        fell behind it. Versions never decrease. Returns the number removed."""
        if version < 0:
            raise InvalidArgument(f"table {self.name!r}: policy version must be >= 0, got {version}")
        with self._cond:
            if version < self.policy_version:
                raise FailedPrecondition(f"table {self.name!r}: policy version must not decrease "
                                         f"(current {self.policy_version}, got {version})")
            self.policy_version = version
            stale = np.zeros(0, dtype=np.int64)
            if self.spec.max_staleness is not None:  # else nothing can be stale: skip the O(n) scan
                live = self._index.live_slots()
                stale = live[self._index["policy_version"][live] < self._stale_cutoff()]
                self._remove(stale, "stale")
            self._changed()
            return len(stale)

    # -- streams ----------------------------------------------------------------------

    def stream(self, group: str, n: int, timeout: float | None = None,
               visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT, start: str = "earliest") -> Rows:
        """Deliver up to n items to a consumer group, in insertion order: first redeliveries
        of expired unacked items, then unread ones. Blocks until at least one is available."""
        if n < 1:
            raise InvalidArgument(f"table {self.name!r}: batch_size must be >= 1, got {n}")
        if not group:
            raise InvalidArgument(f"table {self.name!r}: a stream needs a consumer group name")
        if visibility_timeout <= 0:
            raise InvalidArgument(f"table {self.name!r}: visibility_timeout must be > 0")
        if start not in ("earliest", "latest"):
            raise InvalidArgument(f"table {self.name!r}: start must be 'earliest' or 'latest', got {start!r}")
        deadline = self._deadline(timeout)
        with self._cond:
            g = self._consumers.get(group)
            if g is None:
                g = self._consumers[group] = ConsumerGroup(
                    group, 1 if start == "earliest" else self._index.next_id)
            while True:
                self._check_open()
                now = self._clock()
                again = g.expired(now, n)
                again_slots = self._index.lookup(again)
                g.forget(again[again_slots < 0])
                again, again_slots = again[again_slots >= 0], again_slots[again_slots >= 0]
                fresh_slots = self._index.slots_from(g.position, n - len(again))
                if len(again) or len(fresh_slots):
                    break
                nd = g.next_deadline()
                self._wait(deadline, "stream", f"consumer group {group!r} is caught up",
                           retry_after=None if nd is None else max(0.0, nd - now))
            g.deliver(self._index["id"][fresh_slots], again, now + visibility_timeout)
            slots = np.concatenate([again_slots, fresh_slots])
            self.counters["stream_deliveries"] += len(slots)
            rows = self._snapshot(slots)
            self._changed()
        return rows.gather()

    def ack(self, group: str, item_ids) -> tuple[int, int]:
        """Ack items delivered to a group; (newly acked, already acked). An id never
        delivered to the group is NOT_FOUND and nothing is acked."""
        ids = self._ids(item_ids)
        with self._cond:
            g = self._consumers.get(group)
            if g is None:
                raise NotFound(f"table {self.name!r}: no consumer group {group!r}")
            g.check_ack(ids, self.name)
            result = g.ack(ids)
            self._changed()
            return result

    # -- reads ------------------------------------------------------------------------

    def get(self, item_ids) -> Rows:
        """Items by id, in the given order. NOT_FOUND names the first unknown id."""
        ids = self._ids(item_ids)
        with self._cond:
            rows = self._snapshot(self._lookup(ids))
        return rows.gather()

    def __len__(self) -> int:
        return len(self._index)

    def stats(self) -> dict[str, float]:
        """Flat counters (documented in docs/stats.md)."""
        with self._cond:
            s: dict[str, float] = {
                "items": len(self._index),
                "memory_bytes": self._chunks.tier.nbytes,
                "memory_budget_bytes": self._chunks.tier.budget,
                "chunks": len(self._chunks),
                "policy_version": self.policy_version,
                "sampler_eligible": len(self._sampler),
                "consumer_groups": len(self._consumers),
            }
            for k in ("inserts", "inserted_bytes", "duplicates", "samples", "stream_deliveries",
                      "priority_updates", "compactions", "compacted_rows", "removed_max_size", "removed_max_times_sampled",
                      "removed_stale", "removed_zero_variance", "insert_waits", "sample_waits",
                      "stream_waits", "insert_wait_seconds", "sample_wait_seconds",
                      "stream_wait_seconds"):
                s[k] = self.counters[k]
            for k, v in self._limiter.state().items():
                if isinstance(v, (int, float)):
                    s[f"rate_limiter_{k}"] = float(v)
            for k, v in self._sampler.stats().items():
                s[f"sampler.{k}"] = v
            for name, g in self._consumers.items():
                for k, v in g.stats().items():
                    s[f"group.{name}.{k}"] = v
            return s

    # -- lifecycle --------------------------------------------------------------------

    def record_wait(self, op: str, seconds: float | None = None) -> None:
        """Count a wait done outside the table (the asyncio server waits for
        notifications between ``timeout=0`` attempts) in the same stats as in-table
        waits: call it as the wait begins (no seconds), then with the time it took."""
        with self._cond:
            if seconds is None:
                self.counters[f"{op}_waits"] += 1
            else:
                self.counters[f"{op}_wait_seconds"] += seconds

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change (under the lock: it must not block)."""
        with self._cond:
            self._listeners.append(listener)

    def close(self) -> None:
        """Wake every waiter with UNAVAILABLE; later calls fail the same way."""
        with self._cond:
            self._closed = True
            self._changed()

    # -- internals --------------------------------------------------------------------

    def _snapshot(self, slots: np.ndarray, probabilities=None, weights=None) -> "_Snapshot":
        """Per-row facts and chunk references, taken under the lock."""
        ix = self._index
        chunks = ix["chunk"][slots]
        return _Snapshot(
            batches=self._chunks.get(np.unique(chunks).tolist()), chunks=chunks, rows=ix["row"][slots],
            schema=self.schema, item_ids=ix["id"][slots], priorities=ix["priority"][slots],
            times_sampled=ix["times_sampled"][slots], policy_versions=ix["policy_version"][slots],
            probabilities=probabilities, weights=weights)

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        slots = self._index.lookup(ids)
        if (slots < 0).any():
            missing = int(ids[slots < 0][0])
            raise NotFound(f"table {self.name!r}: no item with id {missing} "
                           f"({int((slots < 0).sum())} of {len(ids)} ids unknown or removed)")
        return slots

    def _items(self, slots: np.ndarray) -> Items:
        c = self._index.cols
        return Items(slots=slots, ids=c["id"][slots], priorities=c["priority"][slots],
                     groups=c["group"][slots], group_sizes=c["group_size"][slots],
                     tasks=c["task"][slots], rewards=c["reward"][slots])

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
        tier = self._chunks.tier
        if tier.nbytes - freed + nbytes > tier.budget:
            raise ResourceExhausted(
                f"table {self.name!r}: the memory tier is full ({tier.nbytes} of "
                f"{tier.budget} bytes; this insert needs {nbytes}); raise memory_bytes "
                f"or lower max_size")

    def _remove(self, slots: np.ndarray, reason: str, *, in_sampler: bool = True) -> None:
        """Remove live items from selectors, tiers and the index (``in_sampler=False``:
        the sampler has already let them go)."""
        if len(slots) == 0:
            return
        if in_sampler:
            self._sampler.remove(slots)
        self._remover.remove(slots)
        if self.spec.max_times_sampled:
            self._allowance -= int((self.spec.max_times_sampled - self._index["times_sampled"][slots]).sum())
        chunks, counts = np.unique(self._index["chunk"][slots], return_counts=True)
        self._chunks.release(chunks.tolist(), counts.tolist())
        self._forget(slots, reason)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Rewrite mostly-dead or small chunks into one (``ChunkStore.compaction_candidates``).

        Removers other than fifo, and max_times_sampled under random sampling, leave
        chunks with a few live rows that pin all their bytes (up to 256x the payload);
        small inserts leave thousands of tiny chunks that make every sample slow. A pass
        copies at most ~32 MiB of live rows under the lock: a bounded pause, repeated by
        later calls if needed.
        """
        chosen = self._chunks.compaction_candidates()
        if not chosen:
            return
        ix = self._index
        slots = ix.live_slots()
        slots = slots[np.isin(ix["chunk"][slots], chosen)]
        slots = slots[np.lexsort((ix["row"][slots], ix["chunk"][slots]))]
        rows = take_rows(self._chunks.get(chosen), ix["chunk"][slots], ix["row"][slots], self.schema)
        ix["chunk"][slots] = self._chunks.replace(chosen, rows)
        ix["row"][slots] = np.arange(len(slots))
        self.counters["compactions"] += 1
        self.counters["compacted_rows"] += len(slots)

    def _forget(self, slots: np.ndarray, reason: str) -> None:
        """Drop items from the index and the key map (remembering keys for dedup)."""
        self._limiter.delete(len(slots))
        if self._keys is not None:
            self._keys.remove(slots, self._index["id"][slots])
        self._index.remove(slots)
        self.counters[f"removed_{reason}"] += len(slots)

    def _dedup(self, keys: list[str] | None, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, new): the stored id of rows whose key is known; new marks the others."""
        if keys is None:
            return np.zeros(n, dtype=np.uint64), np.ones(n, dtype=bool)
        known = self._keys.lookup(keys)
        return known, known == 0

    def _stale_cutoff(self) -> int:
        if self.spec.max_staleness is None:
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

    def _deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else self._clock() + max(0.0, timeout)

    def _wait(self, deadline: float | None, op: str, why: str, retry_after: float | None = None) -> None:
        """Wait for a change (lock held) or raise DeadlineExceeded carrying ``why``."""
        now = self._clock()
        if deadline is not None and now >= deadline:
            raise DeadlineExceeded(f"table {self.name!r}: {why}", retry_after=retry_after)
        limit = None if deadline is None else deadline - now
        if retry_after is not None:
            limit = retry_after if limit is None else min(limit, retry_after)
        self.counters[f"{op}_waits"] += 1  # counted as the wait begins, so it is observable
        self._cond.wait(limit)
        self.counters[f"{op}_wait_seconds"] += self._clock() - now

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable(f"table {self.name!r} is closed")

    def _changed(self) -> None:
        self._cond.notify_all()
        for listener in self._listeners:
            listener()


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
    batches: dict[int, pa.RecordBatch]
    chunks: np.ndarray
    rows: np.ndarray
    schema: pa.Schema
    item_ids: np.ndarray
    priorities: np.ndarray
    times_sampled: np.ndarray
    policy_versions: np.ndarray
    probabilities: np.ndarray | None
    weights: np.ndarray | None

    def gather(self) -> Rows:
        """Copy the rows out of their chunks (no lock needed: chunks are immutable)."""
        return Rows(data=take_rows(self.batches, self.chunks, self.rows, self.schema),
                    item_ids=self.item_ids, priorities=self.priorities,
                    times_sampled=self.times_sampled, policy_versions=self.policy_versions,
                    probabilities=self.probabilities, weights=self.weights)
