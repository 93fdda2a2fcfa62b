"""Where a table's chunks live: memory, SSD (RocksDB), remote (fsspec + Lance).

Durable tables write every chunk through to the SSD tier before it is acknowledged, so
the memory tier is a cache: over its budget it drops the oldest resident chunks, which
costs no write. Over the SSD budget, the oldest chunks move to the remote tier (a
background mover, ``demotion_candidates`` / ``demoted``). The remote tier is never
touched under the table lock: chunks freed there are queued (``garbage``) for the mover to
delete, and what the remote tier holds is known from the table's journal (``state``,
``replay_demoted``), so a restart needs no listing and starts while the tier is down.
Reads are planned under the table lock and done outside it: ``plan`` takes the resident batches and *pins* the rest,
``fetch`` reads SSD blocks in one multi-get and remote chunks as whole fragments, and
``finish`` unpins them (promoting fetched remote chunks into memory). A chunk freed while
pinned is deleted when its last reader finishes. Volatile tables (memory only) keep the
issue-2 contract: the memory budget is a hard limit. Not thread-safe: the table holds
its lock around every method but ``stage`` and ``fetch``.

With ``share_prefixes`` a chunk is stored as ``prefixes.share`` makes it (each distinct
prompt prefix of its rows once) in memory and on the SSD; ``fetch`` and ``get`` hand out
batches in that form, which ``gather.take_rows`` turns back into whole rows. The remote
tier holds whole rows (``prefixes.whole_rows`` as a chunk is demoted).

Every read from the SSD or remote tier is verified (RocksDB's block checksums and our
block CRCs; the remote chunks' per-column checksums in ``checksums``, recorded when they
are demoted): damage raises DataLoss with the chunks and rows it found, which the table
quarantines. A chunk with a damaged SSD block cannot move to the remote tier whole: it
stays on the SSD (``undemotable``) with its healthy items.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from . import prefixes
from .errors import DataLoss, NotFound
from .tiers.checksums import RemoteChecksums
from .tiers.base import UNBOUNDED
from .tiers.memory import MemoryTier
from .tiers.rocks import Layout, RocksTier


@dataclass
class Staged:
    """A chunk written to the SSD tier outside the lock, not yet part of the table."""

    chunk_id: int
    batch: pa.RecordBatch
    layout: Layout | None = None  # how the SSD tier stored it
    volatile: bool = False  # written without the write-ahead log (durability "memory")


@dataclass
class ReadPlan:
    chunks: np.ndarray
    rows: np.ndarray
    resident: dict[int, pa.RecordBatch]
    pinned: list[int] = field(default_factory=list)
    fetched: dict[int, pa.RecordBatch] = field(default_factory=dict)  # remote chunks read


class Placement:
    """Where a table's chunks live (see the module docstring). A ``Tier`` itself
    (tiers/base.py), so that the conformance suite runs against what the engine really
    calls on the tiers: ``put`` is ``stage`` then ``add`` under the caller's chunk id."""

    name = "placement"

    def __init__(self, memory: MemoryTier, ssd: RocksTier | None = None, remote=None,
                 ssd_budget: int = 1 << 62, first_chunk: int = 0, checksums: RemoteChecksums | None = None,
                 share_prefixes: bool = False) -> None:
        self.memory, self.ssd, self.remote = memory, ssd, remote
        self.share_prefixes = share_prefixes  # chunks store their rows' prompt prefixes once
        self.checksums = checksums  # of the remote chunks (with a remote tier)
        self.undemotable: set[int] = set()  # chunks with a damaged SSD block
        self.ssd_budget = ssd_budget
        self._next_chunk = first_chunk
        self._id_lock = threading.Lock()  # ids are allocated outside the table lock
        self._remote: dict[int, tuple[int, int]] = {}  # chunk -> (rows, Arrow bytes) on the remote tier
        self._remote_nbytes = 0
        self._garbage: set[int] = set()  # freed remote chunks, for the mover to delete
        self._volatile: set[int] = set()  # chunks written at durability "memory"
        self.legacy = False  # restored from a journal that did not record demotions
        self.remote_lock = threading.Lock()  # the remote tier is used outside the table lock
        self._pins: Counter[int] = Counter()
        self._doomed: set[int] = set()
        self.counters: Counter[str] = Counter()

    @property
    def durable(self) -> bool:
        return self.ssd is not None

    def reserve_ids(self, first: int) -> None:
        """New chunk ids start at ``first`` or later (after a restart)."""
        with self._id_lock:
            self._next_chunk = max(self._next_chunk, first)

    def _new_id(self) -> int:
        with self._id_lock:
            self._next_chunk += 1
            return self._next_chunk - 1

    # -- writes -------------------------------------------------------------------------

    def stage(self, batch: pa.RecordBatch, durability: str) -> Staged:
        """Allocate a chunk id and write the chunk to the SSD tier (no lock needed)."""
        return self._write(self._new_id(), batch, durability)

    def _write(self, chunk_id: int, batch: pa.RecordBatch, durability: str) -> Staged:
        if self.share_prefixes:
            batch = prefixes.share(batch)
        staged = Staged(chunk_id, batch, volatile=durability == "memory")
        if self.ssd is not None:
            staged.layout = self.ssd.write(staged.chunk_id, batch, durability)
        return staged

    def add(self, staged: Staged) -> None:
        self.memory.put(staged.chunk_id, staged.batch)
        if self.ssd is not None:
            self.ssd.commit_put(staged.chunk_id, staged.layout)
            if staged.volatile:
                self._volatile.add(staged.chunk_id)
            self.evict()

    # -- the Tier interface (tiers/base.py) ----------------------------------------------

    @property
    def nbytes(self) -> int:
        """Arrow bytes of the chunks placed: in memory for a volatile table; on the SSD and
        remote tiers for a durable one (its memory tier is their cache)."""
        return self.memory.nbytes if self.ssd is None else self.ssd.nbytes + self._remote_nbytes

    @property
    def budget(self) -> int:
        """A volatile table's memory budget; a durable table's bytes are unbounded (the SSD
        budget is the watermark above which chunks move to the remote tier)."""
        return self.memory.budget if self.ssd is None else UNBOUNDED

    def __len__(self) -> int:
        return len(self.memory) if self.ssd is None else len(self.ssd) + len(self._remote)

    def size_of(self, chunk_id: int) -> int:
        if self.ssd is None:
            return self.memory.size_of(chunk_id)
        return self._remote[chunk_id][1] if chunk_id in self._remote else self.ssd.size_of(chunk_id)

    def put(self, chunk_id: int, batch: pa.RecordBatch, durability: str = "wal") -> None:
        """Place a chunk under the caller's id, as an insert does (``stage``, then ``add``)."""
        self.reserve_ids(chunk_id + 1)
        self.add(self._write(chunk_id, batch, "memory" if self.ssd is None else durability))

    # -- restart ------------------------------------------------------------------------

    def state(self) -> dict[str, np.ndarray | int]:
        """What a journal snapshot keeps of the placement: the chunks on the remote tier
        (with rows and Arrow bytes), those queued for deletion there, the chunks written
        without the write-ahead log, and an id above every chunk allocated so far."""
        with self._id_lock:
            next_chunk = self._next_chunk
        remote = sorted(self._remote)
        return {"remote_chunks": np.array(remote, np.int64),
                "remote_rows": np.array([self._remote[c][0] for c in remote], np.int64),
                "remote_nbytes": np.array([self._remote[c][1] for c in remote], np.int64),
                "remote_garbage": np.array(sorted(self._garbage), np.int64),
                "volatile_chunks": np.array(sorted(self._volatile), np.int64),
                "next_chunk": next_chunk}

    def load_state(self, s: dict) -> None:
        """Restore ``state`` from a snapshot (one written before ``state`` existed marks
        the placement ``legacy``)."""
        if "next_chunk" not in s:
            self.legacy = True
            return
        self.replay_demoted(s["remote_chunks"], s["remote_rows"], s["remote_nbytes"])
        self._garbage.update(s["remote_garbage"].tolist())
        self._volatile.update(s["volatile_chunks"].tolist())
        self.reserve_ids(int(s["next_chunk"]))

    def replay_written(self, chunk_ids, durability: str | None) -> None:
        """A journal record wrote ``chunk_ids`` at ``durability`` (None: a record from
        before durabilities were recorded, which marks the placement ``legacy``)."""
        ids = [c for c in np.asarray(chunk_ids, np.int64).tolist() if c >= 0]
        if durability is None:
            self.legacy = True
        elif durability == "memory":
            self._volatile.update(ids)
        if ids:
            self.reserve_ids(max(ids) + 1)

    def replay_demoted(self, chunk_ids, rows, nbytes) -> None:
        """A journal record moved ``chunk_ids`` to the remote tier."""
        for c, r, b in zip(np.asarray(chunk_ids).tolist(), np.asarray(rows).tolist(), np.asarray(nbytes).tolist()):
            self._track_remote(c, r, b)
            self._volatile.discard(c)
        if len(chunk_ids):
            self.reserve_ids(int(max(chunk_ids)) + 1)

    def adopt(self, chunk_ids: list[int]) -> tuple[list[int], dict[int, str]]:
        """After a restart (and the replay of the journal): take over the chunks the index
        references from the SSD tier, or the remote tier where the journal put them (a
        chunk on both, after a crash between a demotion's record and its SSD delete, is
        read from the SSD and its remote copy deleted). Returns the ids found in neither
        and the damaged ones, id -> why (SSD metadata that fails its checksum). No remote
        I/O, but for a ``legacy`` journal, whose demotions are known only by listing the
        remote tier (then a chunk with checksums but no readable fragment is damaged)."""
        damaged: dict[int, str] = {}
        missing = self.ssd.load(chunk_ids, damaged) if self.ssd is not None else list(chunk_ids)
        self._forget_remote([c for c in chunk_ids if c in self._remote and c not in missing and c not in damaged])
        moved = [c for c in damaged if c in self._remote]  # a damaged SSD copy: the remote one serves
        for c in moved:
            del damaged[c]
        if moved:
            self.ssd.delete(moved)
        missing = [c for c in missing if c not in self._remote]
        if missing and self.legacy and self.remote is not None:
            listed = set(self.remote.chunk_ids())
            for c in [c for c in missing if c in listed]:
                self._track_remote(c, 0, self.remote.size_of(c))
            self.reserve_ids(max(listed, default=-1) + 1)
            missing = [c for c in missing if c not in listed]
            unreadable = "; ".join(f"fragment {f}: {why}" for f, why in self.remote.unreadable.items())
            for c in missing:
                if self.checksums is not None and c in self.checksums:
                    damaged[c] = (f"remote tier {self.remote.uri}: chunk {c} has no readable fragment"
                                  + (f" (undecodable: {unreadable})" if unreadable else ""))
            missing = [c for c in missing if c not in damaged]
        return missing, damaged

    def volatile(self, chunk_ids: list[int]) -> list[int]:
        """The chunks among ``chunk_ids`` written without the write-ahead log."""
        return [c for c in chunk_ids if c in self._volatile]

    def remote_chunks(self) -> list[int]:
        """Chunks on the remote tier (not those queued for deletion)."""
        return list(self._remote)

    def remote_size(self, chunk_id: int) -> tuple[int, int]:
        """(rows, Arrow bytes) of a chunk on the remote tier; rows 0 if unknown (legacy)."""
        return self._remote[chunk_id]

    def _track_remote(self, chunk_id: int, rows: int, nbytes: int) -> None:
        if chunk_id not in self._remote:
            self._remote[chunk_id] = (rows, nbytes)
            self._remote_nbytes += nbytes

    def unverified(self) -> list[int]:
        """Remote chunks without recorded checksums (demoted by a version that kept none):
        read as they are."""
        if self.checksums is None:
            return []
        return [c for c in self._remote if c not in self.checksums]

    def pin(self, chunk_ids: list[int]) -> None:
        """Keep chunks readable outside the table lock until ``unpin``."""
        self._pins.update(chunk_ids)

    def pinned(self) -> list[int]:
        """The chunks pinned now (by ``pin`` and by reads in progress)."""
        return sorted(self._pins)

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
        self._volatile.difference_update(chunk_ids)
        self._forget_remote([c for c in chunk_ids if c in self._remote])
        self.undemotable.difference_update(chunk_ids)

    def _forget_remote(self, chunk_ids: list[int]) -> None:
        """Chunks the table no longer reads from the remote tier: queued for deletion there."""
        for c in chunk_ids:
            self._remote_nbytes -= self._remote.pop(c)[1]
        if chunk_ids:
            self._garbage.update(chunk_ids)
            self.checksums.delete(chunk_ids)

    def garbage(self) -> list[int]:
        """Chunks freed on the remote tier, to delete there (outside the table lock)."""
        return sorted(self._garbage)

    def collected(self, chunk_ids: list[int]) -> None:
        """The mover deleted ``chunk_ids`` from the remote tier."""
        self._garbage.difference_update(chunk_ids)

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
        return "remote" if chunk_id in self._remote else "ssd"

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
        remote = [c for c in plan.pinned if c in self._remote]
        if remote:
            with self.remote_lock:
                plan.fetched = self._get_remote(remote)
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
        """Whole chunks, read under the caller's lock (compaction of resident chunks).
        NotFound names a chunk the placement does not hold."""
        out = {c: self.memory.get_one(c) for c in chunk_ids if c in self.memory}
        rest = [c for c in chunk_ids if c not in out]
        remote = [c for c in rest if c in self._remote]
        if remote:
            with self.remote_lock:
                out.update(self._get_remote(remote))
        ssd = [c for c in rest if c not in self._remote]
        if ssd:
            out.update(self.ssd.get(ssd) if self.ssd is not None else self.memory.get(ssd))
        return out

    def _get_remote(self, chunk_ids: list[int]) -> dict[int, pa.RecordBatch]:
        """Read chunks the journal put on the remote tier (remote_lock held): one the tier
        does not hold is lost (``lost_remote``)."""
        try:
            return self.remote.get(chunk_ids, self.checksums)
        except NotFound:
            raise self.lost_remote(chunk_ids) from None

    def lost_remote(self, chunk_ids: list[int]) -> DataLoss | None:
        """DataLoss naming the chunks among ``chunk_ids`` (put on the remote tier, as the
        journal says) that the reachable tier does not hold, for the table to quarantine
        their items; None if it holds them all (remote_lock held)."""
        gone = [c for c in chunk_ids if c not in self.remote]
        if not gone:
            return None
        undecodable = "; ".join(f"fragment {f}: {why}" for f, why in self.remote.unreadable.items())
        return DataLoss(f"remote tier {self.remote.uri}: chunk{'s' if len(gone) > 1 else ''} "
                        f"{', '.join(map(str, gone))} moved there {'have' if len(gone) > 1 else 'has'} no readable "
                        f"fragment" + (f" (undecodable: {undecodable})" if undecodable else ""),
                        damage={c: None for c in gone})

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

    def demotion_record(self, chunk_ids: list[int], rows: list[int]) -> dict[str, np.ndarray]:
        """The journal fields of a demotion: what a restart needs to account for the
        chunks without asking the remote tier (``replay_demoted``)."""
        return {"chunks": np.array(chunk_ids, np.int64), "rows": np.array(rows, np.int64),
                "nbytes": np.array([self.ssd.size_of(c) for c in chunk_ids], np.int64)}

    def demoted(self, chunk_ids: list[int], record: dict[str, np.ndarray] | None,
                checksums: dict[int, np.ndarray] | None = None) -> None:
        """The mover wrote ``chunk_ids`` to the remote tier, with their ``checksums``, and
        logged ``record``; or failed to (None): the chunks stay on the SSD. The SSD copies
        go last, after the checksums are recorded."""
        if record is not None:
            self.checksums.put(checksums or {})
            self.replay_demoted(record["chunks"], record["rows"], record["nbytes"])
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
            s.update(remote_bytes=self._remote_nbytes, remote_chunks=len(self._remote))
        for k in ("evictions", "promotions", "prefetched", "demotions", "demotion_failures"):
            s[k] = self.counters[k]
        return s
