"""Moving a table's chunks between tiers: demotion to the remote tier, the archive's
uploads (and scans), read-ahead into the memory cache, compaction of mostly-dead chunks,
and the purge of DropTable.

``Placement`` (placement.py) decides where a chunk lives and plans reads under the table
lock; this module does the slow part, the I/O between tiers, *outside* it. Each pass
takes the table lock (``Table.lock``) to choose its chunks and pin them, does the I/O
unlocked, then takes the lock again to journal the move (``Table.journal``) before
applying it. The store's mover thread calls ``demote`` and ``archive_pending``; the table
calls ``read_ahead`` for streams and for samples that read from the SSD, on one
background thread per table. Damage met on the way is handed to the table
(``Table.quarantine_damage``), which quarantines the items stored there.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa

from .archive import Archive
from .chunks import ChunkStore
from .errors import DataLoss, ExpstoreError
from .gather import take_rows
from .placement import Staged
from .prefixes import whole_rows
from .records import ArchiveExpired, Archived, Compacted, Demoted

if TYPE_CHECKING:
    from .table import Table

log = logging.getLogger("expstore.table")


class Mover:
    MAX_BACKOFF = 1024  # after failed compaction passes, the starts skipped, doubling up to this

    def __init__(self, table: "Table", chunks: ChunkStore, archive: Archive | None) -> None:
        self.table = table
        self.chunks = chunks
        self.placement = chunks.placement
        self.archive = archive
        self._pool: ThreadPoolExecutor | None = None
        self._prefetching: set[int] = set()  # chunks being read ahead
        self._compacting = False  # a compaction pass is under way (one at a time)
        self._backoff = 0  # starts skipped after the last failed pass (0: it succeeded)
        self._skips = 0  # starts still to skip

    def demote(self) -> int:
        """One pass over the remote tier: reach it if it was never reached or its last
        call failed (quarantining the items of chunks it turns out not to hold), delete
        the chunks freed there, then move the oldest SSD chunks down while the SSD is over
        its watermark (about 64 MiB), each move logged before the SSD copy is deleted.
        Remote I/O runs outside the table lock, the chunks pinned. Returns the chunks
        moved; raises Unavailable when the remote tier is down (the chunks stay on the
        SSD, freed ones queued: nothing is lost)."""
        table, placement = self.table, self.placement
        with table.lock:
            if table.closed or placement.remote is None:
                return 0
            garbage, known = placement.garbage(), placement.remote_chunks()
        lost = None
        with placement.remote_lock:
            if not placement.remote.ready:  # (re)reached: does it hold what the journal put there?
                placement.remote.probe()
                lost = placement.lost_remote(known)
            if garbage:
                placement.remote.delete(garbage)
        with table.lock:
            placement.collected(garbage)
            if lost is not None:
                table.quarantine_damage(lost)
            chosen = [] if table.closed else placement.demotion_candidates()
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
                    if table.closed:
                        return 0
                    checksums[c] = placement.remote.put(c, whole_rows(batches[c]))
            with table.lock:
                if not table.closed:  # (a dropped table's journal is gone)
                    done = placement.demotion_record(chosen, [batches[c].num_rows for c in chosen])
                    table.journal(Demoted(**done))
                    record = done
        finally:
            with table.lock:
                placement.demoted(chosen, record, checksums)
                if damaged is not None:
                    placement.undemotable.update(damaged.damage)
                    table.quarantine_damage(damaged)
                elif record is None:
                    placement.counters["demotion_failures"] += 1
        return len(chosen)

    def archive_pending(self) -> int:
        """Upload queued chunks' archived rows to the archive dataset, then free the
        chunks (one pass of up to 8 chunks). Only the blocks holding archived rows are
        read; rows in damaged blocks are quarantined instead. Returns the chunks handled;
        raises Unavailable when the remote tier is down."""
        table, placement, archive = self.table, self.placement, self.archive
        expired = self.expire_archive()
        with table.lock:
            if archive is None or table.closed or not archive.queue:
                return expired
            chosen = archive.queue[:8]
            wanted = {c: archive.wanted(c) for c in chosen}
            plan = placement.plan(np.concatenate([np.full(len(w[0]), c, np.int64) for c, w in wanted.items()]),
                                  np.concatenate([w[0] for w in wanted.values()]))
        try:
            try:
                batches, keys, local = placement.fetch(plan)
            except DataLoss as e:
                with table.lock:
                    self.archive_damaged(e)
                return len(chosen)
            # take copies into fresh buffers: rows that came off the wire can sit unaligned in
            # their IPC buffers (take_rows may hand out slices of them), which Lance refuses
            data = take_rows(batches, keys, local, table.schema).take(np.arange(len(keys)))
            rows, at = {}, 0
            for c, (r, ids, reasons) in wanted.items():
                rows[c] = Archive.annotate(data.slice(at, len(r)), ids, reasons)
                at += len(r)
            with placement.remote_lock:
                checksums = {c: archive.tier.put(c, rows[c]) for c in chosen}
            with table.lock:
                archive.checksums.put(checksums)
                nbytes = np.array([rows[c].nbytes for c in chosen], np.int64)
                table.journal(Archived(chunks=np.array(chosen, dtype=np.int64), nbytes=nbytes))
                archive.done(chosen)
                if table.parts.retention is not None:
                    table.parts.retention.archived(chosen, nbytes)
                placement.delete(chosen)
                table.counters["archived_items"] += sum(r.num_rows for r in rows.values())
        finally:
            with table.lock:
                placement.unpin(plan.pinned)
        return len(chosen)

    def expire_archive(self) -> int:
        """Delete the archive fragments past the total window (retention.py): their
        fragments first (remote I/O, outside the lock), then the record. Returns how many."""
        table, retention = self.table, self.table.parts.retention
        with table.lock:
            if retention is None or self.archive is None or table.closed:
                return 0
            chosen = retention.expired(table.wall_clock(), self.chunks.nbytes)
        if not chosen:
            return 0
        with self.placement.remote_lock:
            self.archive.tier.delete(chosen)  # a crash before the record: deleted again at the next pass
        with table.lock:
            if table.closed:  # dropped meanwhile: its journal is gone
                return 0
            self.archive.checksums.delete(chosen)
            table.journal(ArchiveExpired(chunks=np.array(chosen, np.int64)))
            table.counters["archive_expired_bytes"] += retention.deleted(chosen)
            table.counters["archive_expired_fragments"] += len(chosen)
        return len(chosen)

    def archive_damaged(self, error: DataLoss) -> None:
        """Chunks waiting for the archive could not be read whole (lock held): their rows
        in damaged blocks cannot be archived and are quarantined (the items had already
        left the table); the chunks' other archived rows are archived on the next pass."""
        for chunk, ranges in error.damage.items():
            ids = self.archive.drop_rows(chunk, ranges)
            self.table.quarantine_event(chunk, self.placement.home(chunk), str(error), ids)
            if chunk not in self.archive:  # nothing left to archive: free the chunk
                self.table.journal(Archived(chunks=np.array([chunk], dtype=np.int64)))
                self.archive.done([chunk])
                if self.table.parts.retention is not None:
                    self.table.parts.retention.archived([chunk], None)
                self.placement.delete([chunk])

    def compact(self) -> Future | None:
        """Start a pass that rewrites mostly-dead or small chunks into one (lock held;
        ``ChunkStore.compaction_candidates`` chooses them), unless one is under way;
        returns it, if started.

        Removers other than fifo, and max_times_sampled under random sampling, leave
        chunks with a few live rows that pin all their bytes (up to 256x the payload);
        small inserts leave thousands of tiny chunks that make every sample slow. A pass
        copies at most ~32 MiB of live rows. Only the choice is made here: the copy and
        the write of the new chunk run on the table's background thread without the lock
        (``_compact``), so the table's samples and other calls go on meanwhile. Under the
        lock, merging 8 MiB of 256-row chunks of 300 B rows held every call of the table
        for ~40 ms, of 8-row chunks 125-280 ms (about one insert in a hundred). The insert
        that starts a pass waits for it outside the lock (``Table.try_insert``), so that
        the producer's next insert does not run beside it: on 2 cores, inserts of 300 B
        running beside passes cost ~10% more CPU each (the pass too: GIL and caches), and
        a server inserted ~9% fewer of them a second.
        """
        table = self.table
        if table.replaying or table.closed or self.archive is not None or self._compacting:
            return None  # (archived rows must outlive compaction; a closed table's thread is stopping)
        chosen = self.chunks.compaction_candidates()
        if not chosen:
            return None
        if self._skips:  # the last pass failed: a full disk, or a bug that would fail every pass
            self._skips -= 1
            return None
        ix = table.parts.index
        slots = ix.live_slots()
        slots = slots[np.isin(ix["chunk"][slots], chosen)]
        slots = slots[np.lexsort((ix["row"][slots], ix["chunk"][slots]))]
        work = _Compaction(chosen, self.chunks.get(chosen), ix["chunk"][slots], ix["row"][slots],
                           ix["id"][slots], table.schema)
        self.placement.pin(chosen)  # their batches are read, and their ids re-pointed, after the lock
        self._compacting = True
        return self.pool().submit(self._compact, work)

    def _compact(self, work: "_Compaction") -> None:
        """The background part of a compaction pass: copy the rows out of their chunks and
        stage the new chunk (no lock), then commit it (``_commit_compaction``)."""
        staged = None
        try:
            rows = take_rows(work.batches, work.chunks, work.rows, work.schema)
            staged = self.chunks.stage(rows, "wal")
        except ExpstoreError as e:  # e.g. a full disk: compaction can wait, the table goes on
            log.warning("table %r: a compaction pass could not write its chunk: %s", self.table.name, e)
        except Exception:  # nobody reads a background pass's future: this is the only trace
            log.exception("table %r: a compaction pass failed; its chunks are kept as they were",
                          self.table.name)
        finally:
            with self.table.lock:
                try:
                    failed = not self._commit_compaction(work, staged)
                finally:
                    self.placement.unpin(work.chosen)
                    self._compacting = False
                if failed:
                    self._back_off()
                else:
                    self._backoff = 0
                    self.compact()  # small chunks that arrived meanwhile
            # The old batches go now, a few at a time, letting other threads have the GIL in
            # between: freeing 3,500 of them (8-row chunks) takes ~50 ms, and in one call
            # it would hold the GIL throughout.
            while work.batches:
                for _ in range(min(64, len(work.batches))):
                    work.batches.popitem()
                time.sleep(0)

    def _commit_compaction(self, work: "_Compaction", staged: Staged | None) -> bool:
        """Re-point the items still live to the new chunk and free the old ones (lock
        held); False where the pass failed. Items that left while the rows were copied
        stay in the new chunk as dead rows; the journal's ``Compacted`` record lists every
        row, so a replay places the survivors by their position as here."""
        table = self.table
        if staged is None:
            return False
        ix = table.parts.index
        slots = ix.lookup(work.ids)  # ids are never reused: a live id is still in its chunk and row
        live = slots >= 0
        if table.closed or not live.any():
            self.placement.delete([staged.chunk_id])
            return True
        try:
            table.journal(Compacted(ids=work.ids, chunk=staged.chunk_id))
        except ExpstoreError as e:
            log.warning("table %r: a compaction pass could not journal its chunk: %s", table.name, e)
            self.placement.delete([staged.chunk_id])
            return False
        slots = slots[live]
        ix["chunk"][slots] = self.chunks.replace([c for c in work.chosen if c in self.chunks], staged,
                                                 live=len(slots))
        ix["row"][slots] = np.flatnonzero(live)
        table.counters["compactions"] += 1
        table.counters["compacted_rows"] += len(slots)
        return True

    def _back_off(self) -> None:
        """After a failed pass, skip the next starts: 1, then twice as many after each
        failure in a row, up to ``MAX_BACKOFF``. A pass copies up to ~32 MiB of rows before
        it writes; retried at every insert, a disk that stays full or a bug that fails
        every pass would cost each insert that copy (and a log line)."""
        self.table.counters["compaction_failures"] += 1
        self._backoff = min(self.MAX_BACKOFF, 2 * self._backoff or 1)
        self._skips = self._backoff

    def scan_archive(self, columns: Sequence[str] | None = None) -> pa.RecordBatchReader | None:
        """The archived (removed) items, with ``_item_id`` and ``_removed``, one verified
        fragment at a time with column pushdown (no row filter: the caller filters); None
        without an archive. A damaged fragment fails the scan with DataLoss and is
        quarantined: later scans leave it out."""
        if self.archive is None:
            return None
        with self.table.lock:
            skip = self.table.parts.quarantine.chunks_on("archive")
        with self.placement.remote_lock:
            reader = self.archive.tier.scan(None if columns is None else list(columns),
                                            checksums=self.archive.checksums, skip=skip)

        def batches():
            try:
                yield from reader
            except DataLoss as e:
                with self.table.lock:
                    for chunk in set(e.damage) - self.table.parts.quarantine.chunks_on("archive"):
                        self.table.quarantine_event(chunk, "archive", str(e), np.zeros(0, np.uint64))
                raise DataLoss(f"table {self.table.name!r}: {e}; later scans leave the fragment out",
                               damage=e.damage) from None
        return pa.RecordBatchReader.from_batches(reader.schema, batches())

    def read_ahead(self, chunks: list[int], *, if_room: bool = False) -> None:
        """Load chunks that are not in memory into the memory cache in the background
        (lock held): a stream's next chunks, or (``if_room``) chunks a sample read from the
        SSD while the cache has room for them, so a restarted table warms up. Not when they
        would take more than half the cache: they would be evicted before they are read
        (a stream from a small cache read every chunk twice, 227 ms a batch instead of ~100)."""
        placement = self.placement
        ahead = [c for c in chunks if c in self.chunks and not placement.resident(c) and c not in self._prefetching]
        size = sum(map(self.chunks.size_of, ahead))
        if size > placement.memory.budget // 2:  # it would evict itself before it is read: read twice
            return
        if if_room and placement.memory.nbytes + size > placement.memory.budget:
            return
        if ahead:
            self._prefetching.update(ahead)
            placement.pin(ahead)
            self.pool().submit(self._prefetch, ahead)

    def pool(self) -> ThreadPoolExecutor:
        """The table's background thread: read-ahead and compaction (started on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"background-{self.table.name}")
        return self._pool

    def wait_for_background(self) -> None:
        """Return once every read-ahead and compaction pass started so far has run (its
        one thread runs them in order; a pass may start another when it ends)."""
        while True:
            self.pool().submit(lambda: None).result()
            with self.table.lock:
                if not self._compacting:
                    return

    def _prefetch(self, chunks: list[int]) -> None:
        """Read chunks a stream will need next into the memory cache (the read-ahead
        thread; the chunks are pinned), so consumers of a cold stream do not wait on the disk."""
        placement = self.placement
        damaged = None
        try:
            batches = placement.get(chunks)
        except DataLoss as e:  # quarantined now: the stream's own read will not meet it
            batches, damaged = {}, e
        except ExpstoreError:  # e.g. the remote tier is down: the read itself will report it
            batches = {}
        with self.table.lock:
            if damaged is not None:
                self.table.quarantine_damage(damaged)
            for c, batch in batches.items():
                if c in self.chunks and not placement.resident(c):
                    placement.memory.put(c, batch)
                    placement.counters["prefetched"] += 1
            placement.evict()
            placement.unpin(chunks)
            self._prefetching.difference_update(chunks)

    def remote_tiers(self) -> list:
        """The table's remote tiers (its chunks', its archive's)."""
        tiers = [self.placement.remote, self.archive.tier if self.archive is not None else None]
        return [t for t in tiers if t is not None]

    def close(self) -> None:
        """Stop the background thread (after the passes it has been given) and the remote
        tiers' reader threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for tier in self.remote_tiers():
            tier.close()

    def purge(self) -> None:
        """Delete the remote datasets (every fragment, those a crash left unrecorded too),
        then the journal and every chunk of the table on the SSD (the table is closed).
        If the remote tier is down, Unavailable leaves the table whole."""
        with self.placement.remote_lock:
            for tier in self.remote_tiers():
                tier.delete(tier.chunk_ids())
        with self.table.lock:
            self.table.drop_journal()
            self.placement.delete(self.chunks.ids())
            self.placement.ssd.delete_all()  # orphans too, without reading them: the table's family goes


@dataclass(frozen=True)
class _Compaction:
    """What a compaction pass copies, taken under the lock: the chosen chunks (pinned)
    and their batches, and their live items' chunk, row and id in (chunk, row) order."""

    chosen: list[int]
    batches: dict[int, pa.RecordBatch]
    chunks: np.ndarray
    rows: np.ndarray
    ids: np.ndarray
    schema: pa.Schema
