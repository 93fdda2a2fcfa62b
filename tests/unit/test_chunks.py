"""ChunkStore refcounts and dead-byte accounting."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from expstore.chunks import ChunkStore
from expstore.placement import Placement
from expstore.tiers.memory import MemoryTier


def batch(n: int) -> pa.RecordBatch:
    return pa.record_batch({"x": pa.array(np.arange(n, dtype=np.int64))})


def test_chunks_are_freed_with_their_last_item_and_dead_bytes_return_to_zero():
    store = ChunkStore(Placement(MemoryTier(1 << 30)))
    a, b = store.add(batch(100)), store.add(batch(100))
    size = store.size_of(a)
    assert store.release([a, b], [30, 100]) == [b]  # b is freed, a keeps 70 live rows
    store.placement.delete([b])
    assert len(store) == 1 and store.placement.memory.nbytes == size
    assert store.dead_bytes == pytest.approx(0.3 * size)
    assert store.freed_by([a], [70]) == size and store.freed_by([a], [69]) == 0
    store.placement.delete(store.release([a], [70]))
    assert len(store) == 0 and store.placement.memory.nbytes == 0 and store.dead_bytes == pytest.approx(0)


def test_compaction_picks_the_deadest_chunks_once_a_quarter_is_dead(monkeypatch):
    monkeypatch.setattr(ChunkStore, "COMPACT_MIN_BYTES", 0)
    store = ChunkStore(Placement(MemoryTier(1 << 30)))
    chunks = [store.add(batch(100)) for _ in range(4)]
    store.release([chunks[0]], [20])  # 20% of one chunk dead: 5% of the tier
    assert store.compaction_candidates() == []
    store.release(chunks[1:], [90, 60, 95])  # live fractions 0.8, 0.1, 0.4, 0.05
    assert store.compaction_candidates() == [chunks[3], chunks[1], chunks[2]]
    monkeypatch.setattr(ChunkStore, "COMPACT_MIN_BYTES", 1 << 40)
    assert store.compaction_candidates() == []  # below COMPACT_MIN_BYTES
    new = store.replace([chunks[3], chunks[1]], batch(15))
    assert len(store) == 3 and store.get([new])[new].num_rows == 15
    size = store.size_of(chunks[0])
    assert store.dead_bytes == pytest.approx(0.2 * size + 0.6 * size)


def test_small_chunks_are_merged_oldest_first_once_enough_accumulate(monkeypatch):
    size = batch(100).get_total_buffer_size()
    monkeypatch.setattr(ChunkStore, "SMALL_CHUNK_BYTES", 2 * size)
    monkeypatch.setattr(ChunkStore, "MERGE_BYTES", 3 * size)
    store = ChunkStore(Placement(MemoryTier(1 << 30)))
    store.add(batch(100))
    assert store.compaction_candidates() == []  # one small chunk: nothing to merge
    more = [store.add(batch(100)) for _ in range(3)]
    assert store.compaction_candidates() == [0, more[0], more[1]]
    merged = store.replace([0, more[0], more[1]], batch(300))  # not small itself
    assert store.compaction_candidates() == [] and len(store) == 2
    assert store.get([merged])[merged].num_rows == 300


def test_small_chunks_that_left_memory_are_walked_once_and_never_merged(monkeypatch):
    """A table whose memory cache holds less than MERGE_BYTES: its small chunks go to disk
    before enough accumulate. Each is looked at once, then forgotten: inserts do not walk
    every small chunk the table ever wrote."""
    size = batch(100).get_total_buffer_size()
    monkeypatch.setattr(ChunkStore, "SMALL_CHUNK_BYTES", 2 * size)
    monkeypatch.setattr(ChunkStore, "MERGE_BYTES", 3 * size)
    store = ChunkStore(Placement(MemoryTier(1 << 30)))
    on_disk, asked = set(), []

    def resident(chunk: int) -> bool:
        asked.append(chunk)
        return chunk not in on_disk

    monkeypatch.setattr(store.placement, "resident", resident)
    first = [store.add(batch(100)) for _ in range(10)]
    on_disk.update(first)  # the cache dropped them
    asked.clear()
    assert store.compaction_candidates() == []
    assert sorted(asked) == first
    asked.clear()
    assert store.compaction_candidates() == [] and asked == []  # not again
    fresh = [store.add(batch(100)) for _ in range(3)]
    asked.clear()
    assert store.compaction_candidates() == fresh  # enough resident ones: merged as before
    assert asked == fresh
