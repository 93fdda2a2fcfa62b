"""Table inserts: all or nothing, idempotency, max_size and removers, the memory budget,
compaction, and ids under concurrent calls.

Engine-level: no server. Blocking calls run in worker threads with short timeouts; a test
gives a worker 50 ms to reach its wait, checks it is still blocked, then releases it.
Sampling is in test_table_sampling.py, staleness, priorities, reads and stats in
test_table_updates.py, streams in test_streams.py.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expstore.errors import InvalidArgument, ResourceExhausted
from expstore.chunks import ChunkStore
from expstore.spec import RateLimiterSpec, SamplerSpec
from expstore.table import Table

from _tables import TOKENS, make, traj, traj_ids, with_column, live_ids, Worker

pytestmark = pytest.mark.timeout(30)  # a call that blocks by mistake fails instead of hanging


# --- insert: all or nothing -----------------------------------------------------------------

def test_insert_returns_monotonic_ids_and_stores_rows():
    t = make()
    a = t.insert(traj(3, "a"))
    b = t.insert(traj(2, "b"))
    assert a.item_ids.tolist() == [1, 2, 3] and b.item_ids.tolist() == [4, 5]
    assert (a.num_inserted, a.num_duplicates, a.num_stale) == (3, 0, 0)
    assert len(t) == 5
    assert traj_ids(t.get([1, 2, 3, 4, 5])) == ["a-0", "a-1", "a-2", "b-0", "b-1"]


def test_invalid_row_rejects_whole_batch():
    t = make()
    t.insert(traj(2, "pre"))
    before = t.stats()
    bad = with_column(traj(5, "x"), "policy_version", [0, 0, 0, -1, 0])
    with pytest.raises(InvalidArgument, match=r"row 3.*policy_version"):
        t.insert(bad)
    assert len(t) == 2
    assert t.stats() == before
    # the rejected traj_ids were not remembered: a corrected batch is stored whole
    res = t.insert(traj(5, "x"))
    assert (res.num_inserted, res.num_duplicates) == (5, 0)
    assert res.item_ids.tolist() == [3, 4, 5, 6, 7]  # the failed batch consumed no ids


def test_invalid_row_in_second_part_names_global_row():
    t = make()
    bad = with_column(traj(3, "y"), "loss_mask", [[2] * TOKENS] + [[0] * TOKENS] * 2,
                      pa.list_(pa.uint8()))
    with pytest.raises(InvalidArgument, match=r"row 4.*loss_mask"):
        t.insert([traj(4, "x"), bad])
    assert len(t) == 0 and t.stats()["inserts"] == 0
    assert t.insert(traj(4, "x")).num_inserted == 4  # the valid first part left no trace


def test_empty_insert_is_invalid():
    t = make()
    with pytest.raises(InvalidArgument):
        t.insert([])
    with pytest.raises(InvalidArgument):
        t.insert(traj(3).slice(0, 0))


@pytest.mark.parametrize("priorities, match", [
    ([1.0, 2.0, -1.0], r"row 2.*priority"),
    ([1.0, float("nan"), 1.0], r"row 1.*priority"),
    ([1.0, float("inf"), 1.0], r"row 1.*priority"),
    ([1.0, 2.0], r"2 priorities for 3 rows"),
    ([1.0, 2.0, 3.0, 4.0], r"4 priorities for 3 rows"),
])
def test_bad_priorities_reject_insert(priorities, match):
    t = make()
    with pytest.raises(InvalidArgument, match=match):
        t.insert(traj(3), priorities=priorities)
    assert len(t) == 0 and t.stats()["inserts"] == 0


def test_priorities_are_stored_default_one():
    t = make()
    a = t.insert(traj(3, "a"), priorities=[0.0, 2.5, 7.0])
    b = t.insert(traj(2, "b"))
    assert t.get(a.item_ids).priorities.tolist() == [0.0, 2.5, 7.0]
    assert t.get(b.item_ids).priorities.tolist() == [1.0, 1.0]


# --- insert: idempotency -------------------------------------------------------------------

def test_retry_returns_same_ids_counted_as_duplicates():
    t = make()
    first = t.insert(traj(4))
    again = t.insert(traj(4))
    assert again.item_ids.tolist() == first.item_ids.tolist()
    assert (again.num_inserted, again.num_duplicates) == (0, 4)
    assert len(t) == 4
    s = t.stats()
    assert s["inserts"] == 4 and s["duplicates"] == 4


def test_partially_duplicate_batch_stores_only_new_rows():
    t = make()
    first = t.insert(traj(5, seed=0))  # traj-0..traj-4 -> ids 1..5
    original = t.get([4]).data.column("tokens").to_pylist()
    mixed = traj(8, seed=1).slice(3)  # traj-3..traj-7, different tokens
    res = t.insert(mixed)
    assert res.item_ids.tolist() == [4, 5, 6, 7, 8]
    assert (res.num_inserted, res.num_duplicates) == (3, 2)
    assert len(t) == 8
    # the duplicate kept its first payload; new rows carry theirs
    assert t.get([4]).data.column("tokens").to_pylist() == original
    assert traj_ids(t.get([6, 7, 8])) == ["traj-5", "traj-6", "traj-7"]
    assert t.get([6]).data.column("tokens").to_pylist() == \
        mixed.slice(2, 1).column("tokens").to_pylist()
    assert first.item_ids.tolist() == [1, 2, 3, 4, 5]


def test_partial_duplicates_across_chunks_map_rows_to_ids():
    t = make()
    t.insert(pa.concat_tables([traj(2, "c"), traj(3, "d")]))  # two chunks: ids 1..5
    t.insert(traj(1, "e").to_batches()[0])  # a RecordBatch is accepted too: id 6
    res = t.insert(pa.concat_tables([traj(3, "c"), traj(4, "d")]))  # c-2 and d-3 are new
    assert res.item_ids.tolist() == [1, 2, 7, 3, 4, 5, 8]
    assert (res.num_inserted, res.num_duplicates) == (2, 5)
    assert traj_ids(t.get(res.item_ids)) == ["c-0", "c-1", "c-2", "d-0", "d-1", "d-2", "d-3"]
    assert traj_ids(t.get([6])) == ["e-0"]


def test_duplicate_rows_do_not_change_stored_priorities():
    t = make()
    ids = t.insert(traj(2), priorities=[1.0, 2.0]).item_ids
    t.insert(traj(2), priorities=[9.0, 9.0])
    assert t.get(ids).priorities.tolist() == [1.0, 2.0]


def test_removed_key_deduplicated_within_window_forgotten_beyond():
    t = make(max_size=1, remover="fifo", dedup_window=2)
    a = t.insert(traj(1, "a")).item_ids[0]
    t.insert(traj(1, "b"))  # evicts a; removed: [a]
    again = t.insert(traj(1, "a"))
    assert again.item_ids.tolist() == [a] and again.num_duplicates == 1
    assert traj_ids(t.get(live_ids(t, range(1, 10)))) == ["b-0"]  # b was not evicted
    t.insert(traj(1, "c"))  # evicts b; removed: [a, b]
    t.insert(traj(1, "d"))  # evicts c; removed: [b, c]; a is forgotten
    assert t.insert(traj(1, "b")).num_duplicates == 1
    fresh = t.insert(traj(1, "a"))
    assert fresh.num_inserted == 1 and fresh.item_ids[0] > a
    assert traj_ids(t.get(fresh.item_ids)) == ["a-0"]


def test_dedup_window_zero_forgets_removed_keys():
    t = make(max_size=1, dedup_window=0)
    a = t.insert(traj(1, "a")).item_ids[0]
    t.insert(traj(1, "b"))  # evicts a
    res = t.insert(traj(1, "a"))
    assert res.num_inserted == 1 and res.item_ids[0] != a


def test_generic_table_with_key_column_deduplicates():
    schema = pa.schema([("k", pa.string()), ("x", pa.int64())])
    t = make(kind="generic", schema=schema, key_column="k")
    data = pa.table({"k": ["p", "q"], "x": [1, 2]})
    first = t.insert(data)
    res = t.insert(pa.table({"k": ["q", "r"], "x": [20, 3]}))
    assert res.item_ids[0] == first.item_ids[1] and res.num_duplicates == 1
    assert len(t) == 3
    assert t.get(res.item_ids).data.column("x").to_pylist() == [2, 3]
    with pytest.raises(InvalidArgument, match=r"row 1.*'k'.*duplicate of row 0"):
        t.insert(pa.table({"k": ["s", "s"], "x": [1, 1]}))
    with pytest.raises(InvalidArgument, match=r"row 1.*'k'.*null"):
        t.insert(pa.table({"k": ["u", None], "x": [1, 1]}))
    assert len(t) == 3


def test_generic_table_without_key_stores_repeats():
    schema = pa.schema([("x", pa.int64()), ("v", pa.list_(pa.float32()))])
    t = make(kind="generic", schema=schema)
    data = pa.table({"x": [1, 2], "v": [[0.5], [1.5, 2.5]]}).cast(schema)
    a, b = t.insert(data), t.insert(data)
    assert a.item_ids.tolist() == [1, 2] and b.item_ids.tolist() == [3, 4]
    assert b.num_duplicates == 0 and len(t) == 4
    got = t.get([4, 1])
    assert got.data.column("x").to_pylist() == [2, 1]
    assert got.data.column("v").to_pylist() == [[1.5, 2.5], [0.5]]
    with pytest.raises(InvalidArgument, match="unknown column"):
        t.insert(pa.table({"x": [1], "nope": [1]}))


# --- insert: max_size and removers ---------------------------------------------------------

def test_fifo_remover_evicts_oldest():
    t = make(max_size=3, remover="fifo")
    t.insert(traj(3, "a"))
    res = t.insert(traj(2, "b"))
    assert res.num_inserted == 2 and len(t) == 3
    assert live_ids(t, range(1, 6)) == [3, 4, 5]
    assert t.stats()["removed_max_size"] == 2


def test_lifo_remover_evicts_newest_existing():
    t = make(max_size=3, remover="lifo")
    t.insert(traj(3, "a"))
    t.insert(traj(2, "b"))
    assert live_ids(t, range(1, 6)) == [1, 4, 5]


def test_min_priority_remover_evicts_lowest_priority():
    t = make(max_size=3, remover="min_priority")
    t.insert(traj(3, "a"), priorities=[5.0, 1.0, 3.0])
    t.insert(traj(1, "b"), priorities=[4.0])  # evicts id 2 (priority 1)
    assert live_ids(t, range(1, 5)) == [1, 3, 4]
    t.insert(traj(1, "c"), priorities=[0.5])  # evicts id 3 (priority 3), not the newcomer
    assert live_ids(t, range(1, 6)) == [1, 4, 5]
    t.update_priorities([1], [0.1])
    t.insert(traj(1, "d"), priorities=[9.0])  # lowest now: id 1 (0.1), below id 5 (0.5)
    assert live_ids(t, range(1, 7)) == [4, 5, 6]


def test_min_priority_remover_ties_evict_oldest():
    t = make(max_size=3, remover="min_priority")
    t.insert(traj(3, "a"), priorities=[2.0, 2.0, 2.0])
    t.insert(traj(1, "b"), priorities=[2.0])
    assert live_ids(t, range(1, 5)) == [2, 3, 4]


def test_insert_larger_than_max_size_is_invalid():
    t = make(max_size=3)
    t.insert(traj(2, "a"))
    with pytest.raises(InvalidArgument, match="max_size"):
        t.insert(traj(4, "b"))
    assert len(t) == 2 and live_ids(t, range(1, 10)) == [1, 2]
    assert t.insert(traj(3, "c")).item_ids.tolist() == [3, 4, 5]


def test_ids_monotonic_never_reused():
    t = make(max_size=4, max_times_sampled=1, sampler=SamplerSpec("fifo"))
    seen = []
    for i in range(6):
        seen += t.insert(traj(3, f"p{i}")).item_ids.tolist()
        t.insert(traj(3, f"p{i}"))  # duplicates consume no ids
        t.sample(1)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert seen == list(range(1, 19))


# --- insert: memory budget -----------------------------------------------------------------

def row_bytes(rows: pa.Table) -> int:
    return make("probe").prepare_insert(rows).nbytes


def test_memory_budget_refuses_whole_insert_and_applies_nothing():
    one = row_bytes(traj(1, "m0"))
    t = make(memory_bytes=4 * one, sampler=SamplerSpec("fifo"), max_times_sampled=1)
    for i in range(4):
        t.insert(traj(1, f"m{i}"))
    before = t.stats()
    assert before["memory_bytes"] == 4 * one
    with pytest.raises(ResourceExhausted, match="memory"):
        t.insert(traj(1, "m4"))
    assert t.stats() == before and len(t) == 4
    t.sample(1)  # removes id 1: its chunk is freed
    assert t.stats()["memory_bytes"] == 3 * one
    res = t.insert(traj(1, "m4"))  # not a duplicate: the refused insert left no trace
    assert res.num_inserted == 1 and res.item_ids.tolist() == [5]


def test_memory_budget_counts_space_freed_by_evictions():
    one = row_bytes(traj(1, "m0"))
    t = make(memory_bytes=4 * one, max_size=4, remover="fifo")
    for i in range(6):
        assert t.insert(traj(1, f"m{i}")).num_inserted == 1
    assert len(t) == 4 and live_ids(t, range(1, 7)) == [3, 4, 5, 6]
    assert t.stats()["memory_bytes"] <= 4 * one


def test_memory_budget_counts_only_rows_that_will_be_stored():
    probe = make("probe")
    probe.insert(traj(2, "a"))
    used = probe.stats()["memory_bytes"]
    one = row_bytes(traj(1, "z"))
    t = make(memory_bytes=used + 2 * one)
    t.insert(traj(2, "a"))
    retry = traj(3, "a")  # a-0 and a-1 are stored already; a-2 is new
    assert row_bytes(retry) > 2 * one  # counting every row sent would not fit
    res = t.insert(retry)
    assert (res.num_inserted, res.num_duplicates) == (1, 2)
    assert t.stats()["memory_bytes"] <= used + 2 * one


def test_chunks_freed_when_last_item_leaves():
    t = make(sampler=SamplerSpec("fifo"), max_times_sampled=1)
    t.insert(traj(4))
    s = t.stats()
    assert s["chunks"] == 1 and s["memory_bytes"] > 0
    t.sample(3)
    assert t.stats()["chunks"] == 1
    t.sample(1)
    s = t.stats()
    assert s["chunks"] == 0 and s["memory_bytes"] == 0 and s["items"] == 0




# --- inserts and samples together ---------------------------------------------------------

def test_concurrent_inserts_and_samples_keep_ids_unique():
    t = make(max_size=50, seed=5)
    results: list = []

    def producer(k):
        def run():
            for i in range(10):
                results.append(t.insert(traj(3, f"w{k}-{i}")).item_ids.tolist())
        return run

    ws = [Worker(producer(k)) for k in range(3)] + [Worker(lambda: [t.sample(4, timeout=2) for _ in range(20)])]
    for w in ws:
        w.start()
    for w in ws:
        w.finish(10)
        assert w.error is None, w.error
    ids = [i for r in results for i in r]
    assert sorted(ids) == list(range(1, 91))
    assert len(t) == 50
    assert math.isclose(t.stats()["removed_max_size"], 40)


def test_duplicate_traj_id_across_parts_of_one_insert_is_refused():
    t = make()
    with pytest.raises(InvalidArgument, match=r"row 2, column 'traj_id': duplicate of row 0"):
        t.insert([traj(2, "a"), traj(2, "a")])
    assert len(t) == 0


def test_compaction_keeps_memory_proportional_to_live_items(monkeypatch):
    monkeypatch.setattr(ChunkStore, "COMPACT_MIN_BYTES", 0)
    t = make(max_times_sampled=1)  # uniform sampling removes random items: chunks go sparse
    data = [traj(64, f"c{i}") for i in range(8)]
    for d in data:
        t.insert(d)
    full = t.stats()["memory_bytes"]
    taken = set()
    while len(t) > 64:
        taken.update(traj_ids(t.sample(16)))
    t.wait_for_background()  # compaction copies rows on the table's background thread
    s = t.stats()
    assert s["compactions"] >= 1 and s["compacted_rows"] > 0
    assert s["memory_bytes"] < 0.5 * full  # 1/8 of the items live: without compaction ~full
    # Every live item still reads back its own payload.
    live = [f"c{i}-{k}" for i in range(8) for k in range(64) if f"c{i}-{k}" not in taken]
    got = t.get(np.arange(1, 8 * 64 + 1)[[f"c{i}-{k}" in set(live) for i in range(8) for k in range(64)]])
    assert traj_ids(got) == live
    by_id = {r: row for r, row in zip(pa.concat_tables(data).column("traj_id").to_pylist(),
                                      pa.concat_tables(data).column("tokens").to_pylist())}
    assert got.data.column("tokens").to_pylist() == [by_id[r] for r in live]


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["insert", "sample", "priorities"]), st.integers(1, 12)),
                      min_size=1, max_size=25))
def test_payloads_follow_their_ids_through_evictions_and_compactions(steps):
    saved = ChunkStore.COMPACT_MIN_BYTES, ChunkStore.MERGE_BYTES
    ChunkStore.COMPACT_MIN_BYTES, ChunkStore.MERGE_BYTES = 0, 20_000  # compact and merge often
    try:
        t = make(sampler=SamplerSpec("uniform"), remover="min_priority", max_size=30, max_times_sampled=2)
        rng = np.random.default_rng(0)
        owner: dict[int, str] = {}
        for i, (op, n) in enumerate(steps):
            if op == "insert":
                rows = traj(n, f"s{i}")
                ids = t.insert(rows, priorities=rng.random(n)).item_ids
                owner.update(zip(ids.tolist(), rows.column("traj_id").to_pylist()))
            elif op == "sample" and len(t):
                t.sample(min(n, len(t)), timeout=0)
            elif op == "priorities" and len(t):
                live = [i for i in owner if live_ids(t, [i])]
                t.update_priorities(live[:n], rng.random(len(live[:n])))
            live = [i for i in sorted(owner) if live_ids(t, [i])]
            assert traj_ids(t.get(live)) == [owner[i] for i in live]
    finally:
        ChunkStore.COMPACT_MIN_BYTES, ChunkStore.MERGE_BYTES = saved


def test_rows_too_stale_to_store_do_not_use_up_the_rate_limiters_inserts():
    t = make(max_staleness=1, rate_limiter=RateLimiterSpec("sample_to_insert_ratio", samples_per_insert=1.0,
                                                           min_size_to_sample=1, error_buffer=8))
    t.set_policy_version(5)
    for i in range(10):  # a lagging producer: 40 rows dropped as stale, none stored
        assert t.insert(traj(4, prefix=f"old{i}", policy_version=0), timeout=0).num_stale == 4
    assert t.insert(traj(4, prefix="fresh", policy_version=5), timeout=0).num_inserted == 4
    assert t.stats()["rate_limiter_inserts"] == 4 and len(t) == 4
