"""How items leave a table, and the room an insert needs.

Every way out (the remover making room under ``max_size``, ``max_times_sampled``,
staleness, retention windows, group timeouts, zero variance, quarantine, a replayed
removal) goes through ``Removals.remove``, so that each removal is journaled once, let go
by the selectors, counted by the rate limiter, queued for the archive, and its chunks
released (deleted once no live item references them) in the same order everywhere.

Apart from ``Table`` because it is one job with its own state: the samples the live
items may still take under ``max_times_sampled`` (``allowance``), which inserts add to,
samples spend and removals give back; a sample that would need more waits. Like every
part it holds no lock: each method runs with the table's lock held.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from .errors import ResourceExhausted
from .records import Removed

if TYPE_CHECKING:
    from .movement import Mover
    from .parts import Parts
    from .table import Table


class Removals:
    def __init__(self, table: "Table", parts: "Parts", mover: "Mover", rng: np.random.Generator,
                 counters: Counter) -> None:
        """``rng``: the table's (victims are drawn from the same stream as samples, so a
        seeded table stays reproducible)."""
        self.table, self.parts, self.mover, self.rng, self.counters = table, parts, mover, rng, counters
        self.cap = table.spec.max_times_sampled  # 0: no cap
        self.allowance = 0  # samples the live items may still take under the cap

    # -- the allowance under max_times_sampled ----------------------------------------

    def added(self, n: int) -> None:
        """n items entered the selectors: each may be sampled ``cap`` times."""
        self.allowance += self.cap * n

    def sampled(self, n: int) -> None:
        """A sample returned n rows."""
        if self.cap:
            self.allowance -= n

    def can_sample(self, n: int) -> bool:
        """Whether the live items may still take n samples (always, without a cap)."""
        return not self.cap or self.allowance >= n

    # -- making room for an insert ------------------------------------------------------

    def victims(self, k: int) -> np.ndarray:
        """The k items the remover lets go to make room (none for k <= 0)."""
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        return self.parts.remover.sample(k, self.rng).slots

    def check_budget(self, nbytes: int, victims: np.ndarray) -> None:
        """RESOURCE_EXHAUSTED unless ``nbytes`` more fit in the memory tier, counting
        what the victims free (a volatile table's byte bound)."""
        if nbytes == 0:
            return
        freed = 0
        chunks = self.parts.chunks
        if len(victims):
            ids, counts = np.unique(self.parts.index["chunk"][victims], return_counts=True)
            freed = chunks.freed_by(ids.tolist(), counts.tolist())
        tier = chunks.placement.memory
        if tier.nbytes - freed + nbytes > tier.budget:
            raise ResourceExhausted(
                f"table {self.table.name!r}: the memory tier is full ({tier.nbytes} of "
                f"{tier.budget} bytes; this insert needs {nbytes}); raise memory_bytes "
                f"or lower max_size, or use a durable table (tiers = \"ssd\")")

    # -- removing ----------------------------------------------------------------------

    def remove(self, slots: np.ndarray, reason: str, *, in_sampler: bool = True, log: bool = True) -> None:
        """Remove live items from selectors, tiers and the index (``in_sampler=False``:
        the sampler has already let them go; ``log=False``: the journal record that
        caused it implies the removal)."""
        if len(slots) == 0:
            return
        p, ix = self.parts, self.parts.index
        if log:
            self.table.journal(Removed(ids=ix["id"][slots], reason=reason))
        if in_sampler:
            p.sampler.remove(slots)
        p.remover.remove(slots)
        if self.cap:
            self.allowance -= int((self.cap - ix["times_sampled"][slots]).sum())
        if p.archive is not None and reason not in ("lost", "quarantined"):
            p.archive.removed(ix["chunk"][slots], ix["row"][slots], ix["id"][slots], reason)
            if p.retention is not None:  # the total window counts from the rows' inserted_at
                p.retention.removed(ix["chunk"][slots], ix["inserted_at"][slots])
        if not self.table.replaying:  # a restore adopts the chunks once replay is done
            chunks, counts = np.unique(ix["chunk"][slots], return_counts=True)
            self._free(p.chunks.release(chunks.tolist(), counts.tolist()))
        self.forget(slots, reason)
        self.mover.compact()

    def forget(self, slots: np.ndarray, reason: str, *, limited: bool = True) -> None:
        """Drop items from the index and the key map (remembering keys for dedup);
        ``limited=False``: the rate limiter never counted them (stale or late rows)."""
        p = self.parts
        if limited:
            p.limiter.delete(len(slots))
        if p.keys is not None:
            p.keys.remove(slots, p.index["id"][slots], remember=reason != "quarantined")
        p.index.remove(slots)
        self.counters[f"removed_{reason}"] += len(slots)

    def _free(self, chunks: list[int]) -> None:
        """Delete chunks no live item references, or queue them for the archive."""
        if self.parts.archive is not None:
            chunks = self.parts.archive.freed(chunks)
        self.parts.chunks.placement.delete(chunks)
