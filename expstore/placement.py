"""Where a table's chunks live: memory, SSD (RocksDB), remote (fsspec + Lance).

Durable tables write every chunk through to the SSD tier before it is acknowledged, so
the memory tier is a cache: over its budget it drops the oldest resident chunks, which
costs no write. Over the SSD budget, the oldest chunks move to the remote tier (a
background mover, ``demotion_candidates`` / ``demoted``). Reads are planned under the
table lock and done outside it: ``plan`` takes the resident batches and *pins* the rest,
``fetch`` reads SSD blocks in one multi-get and remote chunks as whole fragments, and
``finish`` unpins them (promoting fetched remote chunks into memory). A chunk freed while
pinned is deleted when its last reader finishes. Volatile tables (memory only) keep the
issue-2 contract: the memory budget is a hard limit. Not thread-safe: the table holds
its lock around every method but ``stage`` and ``fetch``.

Every read from the SSD or remote tier is verified (RocksDB's block checksums and our
block CRCs; the remote chunks' per-column checksums in ``checksums``, recorded when they
are demoted): damage raises DataLoss with the chunks and rows it found, which the table
quarantines. A chunk with a damaged SSD block cannot move to the remote tier whole: it
stays on the SSD (``undemotable``) with its healthy items.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from .tiers.checksums import RemoteChecksums
from .tiers.memory import MemoryTier
from .tiers.rocks import RocksTier

_KEY_SHIFT = 20  # SSD block keys are chunk << 20 | block; whole chunks are keyed -1 - chunk


@dataclass
class Staged:
    """A chunk written to the SSD tier outside the lock, not yet part of the table."""

    chunk_id: int
    batch: pa.RecordBatch
    offsets: np.ndarray | None = None
    stored_bytes: int = 0


@dataclass
class ReadPlan:
    chunks: np.ndarray
    rows: np.ndarray
    resident: dict[int, pa.RecordBatch]
    pinned: list[int] = field(default_factory=list)
    fetched: dict[int, pa.RecordBatch] = field(default_factory=dict)  # remote chunks read


class Placement:
    def __init__(self, memory: MemoryTier, ssd: RocksTier | None = None, remote=None,
                 ssd_budget: int = 1 << 62, first_chunk: int = 0, checksums: RemoteChecksums | None = None) -> None:
        self.memory, self.ssd, self.remote = memory, ssd, remote
        self.checksums = checksums  # of the remote chunks (with a remote tier)
        self.undemotable: set[int] = set()  # chunks with a damaged SSD block
        self.ssd_budget = ssd_budget
        self._ids = itertools.count(first_chunk)
        self._remote_chunks: set[int] = set()
        self.remote_lock = threading.Lock()  # the remote tier is used outside the table lock
        self._pins: Counter[int] = Counter()
        self._doomed: set[int] = set()
        self.counters: Counter[str] = Counter()

    @property
    def durable(self) -> bool:
        return self.ssd is not None

    def reserve_ids(self, first: int) -> None:
        """New chunk ids start at ``first`` or later (after a restart)."""
        if self.remote is not None:
            first = max([first, *(c + 1 for c in self.remote.chunk_ids())])
        self._ids = itertools.count(first)

    # -- writes -------------------------------------------------------------------------

    def stage(self, batch: pa.RecordBatch, durability: str) -> Staged:
        """Allocate a chunk id and write the chunk to the SSD tier (no lock needed)."""
        staged = Staged(next(self._ids), batch)
        if self.ssd is not None:
            self.ssd.db.check_free_space()
            wb, staged.offsets, staged.stored_bytes = self.ssd.encode(staged.chunk_id, batch)
            self.ssd.db.write(wb, durability)
        return staged

    def add(self, staged: Staged) -> None:
        self.memory.put(staged.chunk_id, staged.batch)
        if self.ssd is not None:
            self.ssd.commit_put(staged.chunk_id, staged.offsets, staged.stored_bytes,
                                staged.batch.get_total_buffer_size(), staged.batch.schema)
            self.evict()

    def adopt(self, chunk_ids: list[int]) -> tuple[list[int], dict[int, str]]:
        """After a restart: take over the chunks the index references. Returns the ids
        found in no tier (inserted with durability ``memory`` before a crash) and the
        damaged ones, id -> why: SSD metadata that fails its checksum, or a remote chunk
        whose checksums are recorded but whose fragment is gone or does not decode."""
        damaged: dict[int, str] = {}
        missing = self.ssd.load(chunk_ids, damaged) if self.ssd is not None else list(chunk_ids)
        if missing and self.remote is not None:
            known = set(self.remote.chunk_ids())
            on_remote = [c for c in missing if c in known]
            self._remote_chunks.update(on_remote)
            missing = sorted(set(missing) - set(on_remote))
            unreadable = "; ".join(f"fragment {f}: {why}" for f, why in self.remote.unreadable.items())
            for c in missing:
                if self.checksums is not None and c in self.checksums:
                    damaged[c] = (f"remote tier {self.remote.uri}: chunk {c} has no readable fragment"
                                  + (f" (undecodable: {unreadable})" if unreadable else ""))
            missing = [c for c in missing if c not in damaged]
        return missing, damaged

    def unverified(self) -> list[int]:
        """Remote chunks without recorded checksums (demoted by a version that kept none):
        read as they are."""
        if self.checksums is None:
            return []
        return [c for c in self._remote_chunks if c not in self.checksums]

    def pin(self, chunk_ids: list[int]) -> None:
        """Keep chunks readable outside the table lock until ``unpin``."""
        self._pins.update(chunk_ids)

    def unpin(self, chunk_ids: list[int]) -> None:
        self._pins.subtract(chunk_ids)
        done = [c for c in set(chunk_ids) if self._pins[c] <= 0]
        for c in done:
            del self._pins[c]
        freed = [c for c in done if c in self._doomed]
        self._doomed.difference_update(freed)
        self._delete(freed)

    def delete(self, chunk_ids: list[int]) -> None:
        busy = [c for c in chunk_ids if self._pins[c]]
        self._doomed.update(busy)
        self._delete([c for c in chunk_ids if not self._pins[c]])

    def _delete(self, chunk_ids: list[int]) -> None:
        if not chunk_ids:
            return
        self.memory.delete(chunk_ids)
        if self.ssd is not None:  # staged chunks are on disk before the tier knows them
            self.ssd.delete(chunk_ids)
        remote = [c for c in chunk_ids if c in self._remote_chunks]
        if remote:
            self._remote_chunks.difference_update(remote)
            with self.remote_lock:
                self.remote.delete(remote)
            self.checksums.delete(remote)
        self.undemotable.difference_update(chunk_ids)

    def evict(self) -> None:
        """Drop the oldest resident chunks while memory is over budget (durable tables:
        they are on the SSD or remote tier too)."""
        while self.memory.nbytes > self.memory.budget and len(self.memory):
            self.memory.delete([self.memory.oldest()])
            self.counters["evictions"] += 1

    # -- reads --------------------------------------------------------------------------

    def resident(self, chunk_id: int) -> bool:
        return chunk_id in self.memory

    def where(self, chunk_id: int) -> str:
        """The fastest tier holding a chunk."""
        return "memory" if chunk_id in self.memory else self.home(chunk_id)

    def home(self, chunk_id: int) -> str:
        """The durable tier holding a chunk: ssd or remote."""
        return "remote" if chunk_id in self._remote_chunks else "ssd"

    def plan(self, chunks: np.ndarray, rows: np.ndarray) -> ReadPlan:
        unique = np.unique(chunks).tolist()
        resident = {c: self.memory.get_one(c) for c in unique if c in self.memory}
        pinned = [c for c in unique if c not in resident]
        self._pins.update(pinned)
        return ReadPlan(chunks, rows, resident, pinned)

    def fetch(self, plan: ReadPlan) -> tuple[dict[int, pa.RecordBatch], np.ndarray, np.ndarray]:
        """Read what the plan pinned (no lock held): (batches by key, key per row, row in
        its batch), the arguments of ``take_rows``."""
        keys = -1 - plan.chunks.astype(np.int64)
        rows = plan.rows.copy()
        batches = {-1 - c: b for c, b in plan.resident.items()}
        if not plan.pinned:
            return batches, keys, rows
        remote = [c for c in plan.pinned if c in self._remote_chunks]
        if remote:
            with self.remote_lock:
                plan.fetched = self.remote.get(remote, self.checksums)
            batches.update({-1 - c: b for c, b in plan.fetched.items()})
        on_ssd = np.isin(plan.chunks, [c for c in plan.pinned if c not in plan.fetched])
        if on_ssd.any():
            blocks, block_keys, local = self.ssd.get_rows(plan.chunks[on_ssd], plan.rows[on_ssd])
            batches.update(blocks)
            keys[on_ssd], rows[on_ssd] = block_keys, local
        return batches, keys, rows

    def finish(self, plan: ReadPlan) -> None:
        """Unpin; promote fetched remote chunks that are still live into memory."""
        for c, batch in plan.fetched.items():
            if c not in self._doomed and c not in self.memory:
                self.memory.put(c, batch)
                self.counters["promotions"] += 1
        self.unpin(plan.pinned)
        if plan.fetched:
            self.evict()

    def get(self, chunk_ids: list[int]) -> dict[int, pa.RecordBatch]:
        """Whole chunks, read under the caller's lock (compaction of resident chunks)."""
        out = {c: self.memory.get_one(c) for c in chunk_ids if c in self.memory}
        rest = [c for c in chunk_ids if c not in out]
        remote = [c for c in rest if c in self._remote_chunks]
        if remote:
            with self.remote_lock:
                out.update(self.remote.get(remote, self.checksums))
        ssd = [c for c in rest if c not in self._remote_chunks]
        if ssd:
            out.update(self.ssd.get(ssd))
        return out

    # -- demotion to the remote tier ----------------------------------------------------

    def demotion_candidates(self, limit_bytes: int = 64 << 20) -> list[int]:
        """The oldest SSD chunks (about ``limit_bytes`` stored) while the SSD tier is over
        its budget, pinned until ``demoted`` is called."""
        if self.remote is None or self.ssd is None or self.ssd.stored_nbytes <= self.ssd_budget:
            return []
        over = self.ssd.stored_nbytes - self.ssd_budget
        chosen, total = [], 0
        for c in self.ssd.oldest():
            if self._pins[c] or c in self._doomed or c in self.undemotable:
                continue
            chosen.append(c)
            total += self.ssd.stored_size_of(c)
            if total >= min(over, limit_bytes):
                break
        self._pins.update(chosen)
        return chosen

    def demoted(self, chunk_ids: list[int], ok: bool, checksums: dict[int, np.ndarray] | None = None) -> None:
        """The mover wrote ``chunk_ids`` to the remote tier (ok), with their ``checksums``
        (recorded before the SSD copies go), or failed to."""
        if ok:
            self.checksums.put(checksums or {})
            self._remote_chunks.update(chunk_ids)
            self.ssd.delete(chunk_ids)
            self.counters["demotions"] += len(chunk_ids)
        self.unpin(chunk_ids)

    # -- accounting ---------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        s = {"memory_bytes": self.memory.nbytes, "memory_budget_bytes": self.memory.budget,
             "memory_chunks": len(self.memory)}
        if self.ssd is not None:
            s.update(ssd_bytes=self.ssd.stored_nbytes, ssd_arrow_bytes=self.ssd.nbytes,
                     ssd_budget_bytes=self.ssd_budget, ssd_chunks=len(self.ssd))
        if self.remote is not None:
            s.update(remote_bytes=self.remote.nbytes, remote_chunks=len(self._remote_chunks))
        for k in ("evictions", "promotions", "prefetched", "demotions", "demotion_failures"):
            s[k] = self.counters[k]
        return s
