"""A table's stats: the flat counters and gauges of ``Table.stats`` (documented in
docs/stats.md), gathered from its parts under the table lock."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .parts import Parts

# Upper bounds (policy versions behind the table's) of the staleness counts in stats.
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)

# Counters of what this process did (a restore starts them at zero), reported as they are.
COUNTERS = ("inserts", "inserted_bytes", "duplicates", "samples", "stream_deliveries",
            "priority_updates", "compactions", "compacted_rows", "removed_max_size", "removed_max_times_sampled",
            "removed_stale", "removed_zero_variance", "insert_waits", "sample_waits",
            "stream_waits", "insert_wait_seconds", "sample_wait_seconds",
            "stream_wait_seconds", "compaction_failures", "removed_lost", "archived_items",
            "removed_group_timeout", "removed_group_late", "group_timeouts_released",
            "group_timeouts_dropped", "ingest_unchecked")


class Staleness:
    """Items returned by sample and stream, counted by how many policy versions they are
    behind the table's (ahead of it counts as 0), per bucket (the last: beyond them all)."""

    def __init__(self, counters: Counter) -> None:
        self.counters = counters  # the table's: the sums go there
        self._counts = {op: np.zeros(len(STALENESS_BUCKETS) + 1, np.int64) for op in ("sample", "stream")}

    def record(self, op: str, behind: np.ndarray) -> None:
        """One vectorised bucketing per batch."""
        self._counts[op] += np.bincount(np.searchsorted(STALENESS_BUCKETS, behind),
                                        minlength=len(STALENESS_BUCKETS) + 1)
        self.counters[f"staleness.{op}.sum"] += int(behind.sum())

    def stats(self) -> dict[str, float]:
        s = {}
        for op, counts in self._counts.items():
            for bound, n in zip(STALENESS_BUCKETS, np.cumsum(counts).tolist()):
                s[f"staleness.{op}.le_{bound}"] = n
            s[f"staleness.{op}.sum"] = self.counters[f"staleness.{op}.sum"]
        return s


def table_stats(parts: "Parts", counters: Counter, staleness: Staleness, policy_version: int,
                queues: dict[str, int]) -> dict[str, float]:
    """The stats of a table (lock held); ``queues``: calls waiting per line."""
    index, placement = parts.index, parts.chunks.placement
    s: dict[str, float] = {
        "items": len(index),
        **placement.stats(),
        **_items_per_tier(parts),
        "chunks": len(parts.chunks),
        "policy_version": policy_version,
        "sampler_eligible": len(parts.sampler),
        "consumer_groups": len(parts.consumers),
        "quarantined_items": len(parts.quarantine),
        "quarantined_chunks": parts.quarantine.chunks,
        **{f"{op}_queue": n for op, n in queues.items()},
    }
    for k in COUNTERS:
        s[k] = counters[k]
    for k, v in parts.limiter.state().items():
        if isinstance(v, (int, float)):
            s[f"rate_limiter_{k}"] = float(v)
    for k, v in parts.sampler.stats().items():
        s[f"sampler.{k}"] = v
    if parts.retention is not None:
        s.update(parts.retention.stats(), removed_retention=counters["removed_retention"],
                 archive_expired_fragments=counters["archive_expired_fragments"],
                 archive_expired_bytes=counters["archive_expired_bytes"])
    if parts.pacing is not None:
        s.update(parts.pacing.stats(policy_version))
        s["reserve_waits"], s["reserve_wait_seconds"] = counters["reserve_waits"], counters["reserve_wait_seconds"]
    s.update(staleness.stats())
    for name, g in parts.consumers.items():
        for k, v in g.stats().items():
            s[f"group.{name}.{k}"] = v
        s[f"group.{name}.lag"] = index.count_from(g.position)
    return s


def _items_per_tier(parts: "Parts") -> dict[str, int]:
    index, placement = parts.index, parts.chunks.placement
    chunks, counts = np.unique(index["chunk"][index.live_slots()], return_counts=True)
    out = {"items_memory": 0, "items_ssd": 0, "items_remote": 0}
    if placement.durable:
        for c, k in zip(chunks.tolist(), counts.tolist()):
            out["items_" + placement.where(c)] += k
    else:
        out["items_memory"] = len(index)
    return out
