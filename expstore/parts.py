"""A table's parts, built from its spec: the factory ``Parts.build`` (Reverb's Python
``Table`` is handed its sampler, remover and rate limiter the same way).

``Table`` (table.py) owns the lock, admission and the order of operations; each part
does one job and holds no lock of its own: the item index, the sampler and remover
(selectors, samplers/), the rate limiter (arithmetic), the chunk store over the tiers'
placement, the archive, the quarantine, the key registry for dedup, the group timeouts,
the ingest checks and their lineage, the consumer groups, the pace of admission, the
retention windows, and a durable table's journal.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

from .archive import ARCHIVE_SUFFIX, Archive
from .chunks import ChunkStore
from .errors import FailedPrecondition
from .group_timeouts import GroupTimeouts
from .index import ItemIndex
from .ingest_checks import Checks, Lineage
from .journal import Journal
from .keys import KeyRegistry
from .pacing import Pacing
from .placement import Placement
from .quarantine import Quarantine
from .ratelimit import RateLimiter
from .retention import Retention
from .samplers import make_remover, make_sampler
from .samplers.base import Codebook, Selector
from .spec import TableSpec
from .streams import Consumers
from .tiers.checksums import ARCHIVE, RemoteChecksums
from .tiers.memory import MemoryTier
from .tiers.rocks import Database, RocksTier


@dataclass(frozen=True)
class Backing:
    """Where a durable table keeps its data: the server's RocksDB under ``table_id``, the
    remote tier factory (``remote(table_name)``) when the table uses one, and the thread
    that writes journal snapshots (None: the table's own calls write them)."""

    db: Database
    table_id: int
    remote: Callable[[str], object] | None = None
    snapshots: Executor | None = None


@dataclass
class Parts:
    index: ItemIndex
    tasks: Codebook  # task strings <-> codes, shared with the sampler
    groups: Codebook  # group_id strings <-> codes
    sampler: Selector
    remover: Selector
    limiter: RateLimiter
    chunks: ChunkStore  # refcounts over the placement of chunks in the tiers
    consumers: Consumers
    quarantine: Quarantine
    lineage: Lineage
    keys: KeyRegistry | None = None  # with a key column: dedup
    archive: Archive | None = None  # archive = true
    timeouts: GroupTimeouts | None = None  # group_timeout_s
    checks: Checks | None = None  # ingest_checks
    journal: Journal | None = None  # durable tables
    pacing: Pacing | None = None  # pacing: reservations before rollouts
    retention: Retention | None = None  # retention windows
    backing: Backing | None = None  # durable tables

    @property
    def placement(self) -> Placement:
        return self.chunks.placement

    @classmethod
    def build(cls, spec: TableSpec, backing: Backing | None = None,
              clock: Callable[[], float] = time.monotonic, counters: Counter | None = None) -> "Parts":
        """The parts a resolved spec describes; ``backing`` for a durable table;
        ``counters``, the table's, where parts count events for its stats."""
        durable = spec.tiers != "memory"
        remote = spec.tiers == "remote"
        if remote and backing.remote is None:
            raise FailedPrecondition(f"table {spec.name!r}: tiers = \"remote\" needs the server's "
                                     f"remote tier to be configured ([remote] uri)")
        backing = backing if durable else None
        tasks = Codebook()
        chunks = ChunkStore(Placement(
            MemoryTier(spec.memory_bytes),
            RocksTier(backing.db, backing.table_id) if durable else None,
            backing.remote(spec.name) if remote else None,
            ssd_budget=spec.ssd_bytes,
            checksums=RemoteChecksums(backing.db, backing.table_id) if remote else None,
            share_prefixes=spec.share_prefixes))
        return cls(
            index=ItemIndex(), tasks=tasks, groups=Codebook(),
            sampler=make_sampler(spec.sampler, tasks), remover=make_remover(spec.remover),
            limiter=RateLimiter.from_spec(spec.rate_limiter), chunks=chunks, consumers=Consumers(clock),
            quarantine=Quarantine(), lineage=Lineage(),
            keys=KeyRegistry(spec.dedup_window) if spec.key is not None else None,
            archive=Archive(backing.remote(spec.name + ARCHIVE_SUFFIX),
                            RemoteChecksums(backing.db, backing.table_id, ARCHIVE)) if spec.archive else None,
            timeouts=GroupTimeouts(spec.group_timeout_s, spec.group_timeout_action)
            if spec.group_timeout_s is not None else None,
            checks=Checks(spec.ingest_checks, spec.name) if spec.ingest_checks else None,
            journal=Journal(backing.db, backing.table_id, backing.snapshots) if durable else None,
            pacing=Pacing(spec.pacing.rollouts_per_version, spec.max_staleness, spec.pacing.lease_s,
                          spec.name, counters) if spec.pacing is not None else None,
            retention=Retention(spec.hot_retention_s, spec.hot_retention_bytes, spec.retention_s,
                                spec.retention_bytes) if spec.retains else None,
            backing=backing)
