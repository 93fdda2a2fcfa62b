"""Table: inserts (all-or-nothing, idempotency, eviction, budgets), sampling (rows, limits,
rate limiting across threads), staleness, priorities, reads and stats.

Engine-level: no server. Blocking calls run in worker threads with short timeouts; a test
gives a worker 50 ms to reach its wait, checks it is still blocked, then releases it.
Streams live in test_streams.py.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expstore.errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound,
                             ResourceExhausted, Unavailable)
from expstore.admission import Admission, Wait
from expstore.chunks import ChunkStore
from expstore.spec import RateLimiterSpec, SamplerSpec, TableSpec
from expstore.synthetic import trajectories
from expstore.table import Table

TOKENS = 16
pytestmark = pytest.mark.timeout(30)  # a call that blocks by mistake fails instead of hanging


def make(name: str = "t", seed: int = 0, **kw) -> Table:
    return Table(TableSpec(name, **kw), seed=seed)


def traj(n: int, prefix: str = "traj", **kw) -> pa.Table:
    kw.setdefault("tokens", TOKENS)
    return trajectories(n, id_prefix=prefix, **kw)


def traj_ids(rows) -> list[str]:
    return rows.data.column("traj_id").to_pylist()


def with_column(t: pa.Table, name: str, values, type_=None) -> pa.Table:
    i = t.schema.get_field_index(name)
    return t.set_column(i, t.schema.field(name), pa.array(values, type=type_ or t.schema.field(name).type))


def live_ids(table: Table, ids) -> list[int]:
    """The ids among ``ids`` that ``get`` still finds."""
    out = []
    for i in ids:
        try:
            table.get([i])
            out.append(int(i))
        except NotFound:
            pass
    return out


def assert_blocked(w: "Worker", settle: float = 0.05) -> None:
    """The worker has had time to reach its wait and is still in it."""
    time.sleep(settle)
    assert w.is_alive() and w.error is None, w.error


class Worker(threading.Thread):
    """Runs ``fn`` in a thread, keeping its result or exception."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def finish(self, timeout: float = 2.0):
        self.join(timeout)
        assert not self.is_alive(), "worker still blocked"
        return self


RATIO = RateLimiterSpec(type="sample_to_insert_ratio", samples_per_insert=1.0,
                        min_size_to_sample=1, error_buffer=1.0)  # diff window [0, 2]


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


# --- sample ------------------------------------------------------------------------------

def test_sample_returns_inserted_rows_for_their_ids():
    t = make(seed=3)
    by_traj: dict[str, list] = {}
    id_to_traj: dict[int, str] = {}
    for i in range(4):
        batch = traj(5, f"c{i}", seed=i, tokens=(8, 32))
        res = t.insert(batch)
        for j, (iid, tid) in enumerate(zip(res.item_ids.tolist(), batch.column("traj_id").to_pylist())):
            id_to_traj[iid] = tid
            by_traj[tid] = batch.slice(j, 1).column("tokens").to_pylist()[0]
    rows = t.sample(64)
    assert len(rows.item_ids) == rows.data.num_rows == 64
    for iid, tid, tokens in zip(rows.item_ids.tolist(), traj_ids(rows),
                                rows.data.column("tokens").to_pylist()):
        assert id_to_traj[iid] == tid
        assert by_traj[tid] == tokens
    assert len(set(rows.item_ids.tolist())) > 5  # draws spread over the table
    assert np.all(rows.probabilities == pytest.approx(1 / 20))


def test_sample_row_facts_are_aligned():
    t = make(sampler=SamplerSpec("max_heap"))
    res = t.insert([traj(2, "a", policy_version=3), traj(2, "b", policy_version=5)],
                   priorities=[1.0, 4.0, 3.0, 2.0])
    rows = t.sample(4)
    assert rows.item_ids.tolist() == [2, 3, 4, 1]
    assert traj_ids(rows) == ["a-1", "b-0", "b-1", "a-0"]
    assert rows.priorities.tolist() == [4.0, 3.0, 2.0, 1.0]
    assert rows.policy_versions.tolist() == [3, 5, 5, 3]
    assert rows.times_sampled.tolist() == [1, 1, 1, 1]
    assert res.item_ids.tolist() == [1, 2, 3, 4]


def test_times_sampled_counts_each_sample():
    t = make()
    iid = t.insert(traj(1)).item_ids[0]
    assert [int(t.sample(1).times_sampled[0]) for _ in range(3)] == [1, 2, 3]
    assert t.get([iid]).times_sampled.tolist() == [3]
    t.sample(4)  # with replacement from one item: four more samples of it
    assert t.get([iid]).times_sampled.tolist() == [7]
    assert t.stats()["samples"] == 7


def test_max_times_sampled_removes_after_exactly_k():
    t = make(sampler=SamplerSpec("fifo"), max_times_sampled=2)
    t.insert(traj(3))
    assert t.sample(1).item_ids.tolist() == [1]
    assert len(t) == 3
    assert t.sample(1).item_ids.tolist() == [1]
    assert len(t) == 2 and live_ids(t, [1, 2, 3]) == [2, 3]
    assert t.sample(2).item_ids.tolist() == [2, 3]
    assert t.sample(2).item_ids.tolist() == [2, 3]
    assert len(t) == 0
    assert t.stats()["removed_max_times_sampled"] == 3


def test_fifo_queue_delivers_each_item_once():
    t = make(sampler=SamplerSpec("fifo"), max_times_sampled=1)
    t.insert(traj(5))
    got = t.sample(2).item_ids.tolist() + t.sample(3).item_ids.tolist()
    assert got == [1, 2, 3, 4, 5]
    with pytest.raises(DeadlineExceeded):
        t.sample(1, timeout=0)


def test_max_times_sampled_holds_within_one_batch():
    t = make(max_times_sampled=1)
    t.insert(traj(1))
    with pytest.raises(DeadlineExceeded):  # one item may be drawn once: 3 cannot be served
        t.sample(3, timeout=0)
    assert len(t) == 1 and t.get([1]).times_sampled.tolist() == [0]


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_max_times_sampled_caps_draws_with_replacement(sampler):
    t = make(max_times_sampled=2, sampler=SamplerSpec(sampler), seed=4)
    batch = traj(10)
    res = t.insert(batch, priorities=np.arange(1, 11, dtype=float))
    id_to_traj = dict(zip(res.item_ids.tolist(), batch.column("traj_id").to_pylist()))
    rows = t.sample(15)
    got = rows.item_ids.tolist()
    assert len(got) == 15
    counts = {i: got.count(i) for i in set(got)}
    assert max(counts.values()) <= 2
    assert rows.times_sampled.max() <= 2
    assert [id_to_traj[i] for i in got] == traj_ids(rows)
    exhausted = sorted(i for i, c in counts.items() if c == 2)
    assert len(t) == 10 - len(exhausted)
    assert not set(live_ids(t, res.item_ids)) & set(exhausted)
    assert t.stats()["removed_max_times_sampled"] == len(exhausted)
    left = 20 - 15  # draws the table can still serve
    assert len(t.sample(left).item_ids) == left
    assert len(t) == 0


def test_min_size_blocks_sampling_until_reached():
    t = make(rate_limiter=RateLimiterSpec(type="min_size", min_size_to_sample=3))
    t.insert(traj(2))
    with pytest.raises(DeadlineExceeded, match="rate limiter"):
        t.sample(1, timeout=0)
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        t.sample(1, timeout=0.05)
    assert 0.04 <= time.monotonic() - start < 1.0
    assert t.stats()["sample_waits"] >= 1
    assert t.stats()["sample_wait_seconds"] > 0
    t.insert(traj(1, "z"))
    assert len(t.sample(1, timeout=0).item_ids) == 1


def test_empty_table_sample_times_out():
    t = make()
    with pytest.raises(DeadlineExceeded):
        t.sample(1, timeout=0)
    assert t.stats()["samples"] == 0


def test_blocked_sampler_released_by_insert_in_another_thread():
    t = make()
    w = Worker(lambda: t.sample(2, timeout=5))
    w.start()
    assert_blocked(w)
    t.insert(traj(1))
    w.finish()
    assert w.error is None
    assert w.result.item_ids.tolist() == [1, 1]


def test_ratio_limiter_blocks_inserts_until_samples():
    t = make(rate_limiter=RATIO)
    t.insert(traj(2, "a"))  # diff 2 = max_diff
    with pytest.raises(DeadlineExceeded, match="rate limiter"):
        t.insert(traj(1, "b"), timeout=0)
    assert len(t) == 2
    w = Worker(lambda: t.insert(traj(1, "b"), timeout=5))
    w.start()
    assert_blocked(w)
    assert w.is_alive()
    t.sample(1)
    w.finish()
    assert w.error is None and w.result.item_ids.tolist() == [3]
    assert len(t) == 3


def test_ratio_limiter_blocks_samples_until_inserts():
    t = make(rate_limiter=RATIO)
    t.insert(traj(2, "a"))
    t.sample(2)  # diff 0 = min_diff
    with pytest.raises(DeadlineExceeded):
        t.sample(1, timeout=0)
    w = Worker(lambda: t.sample(1, timeout=5))
    w.start()
    assert_blocked(w)
    t.insert(traj(1, "b"))
    w.finish()
    assert w.error is None and len(w.result.item_ids) == 1


def test_never_admissible_batches_fail_at_once():
    t = make(rate_limiter=RATIO)
    t.insert(traj(1, "a"))
    start = time.monotonic()
    with pytest.raises(InvalidArgument, match="never"):
        t.sample(3, timeout=5)
    with pytest.raises(InvalidArgument, match="never"):
        t.insert(traj(3, "b"), timeout=5)
    assert time.monotonic() - start < 1.0
    assert len(t) == 1 and t.stats()["samples"] == 0


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_capped_batch_above_total_allowance_fails_at_once(sampler):
    t = make(max_size=2, max_times_sampled=1, sampler=SamplerSpec(sampler))
    t.insert(traj(2))
    with pytest.raises(InvalidArgument, match="max_times_sampled|max_size"):
        t.sample(3, timeout=0.05)
    assert len(t.sample(2).item_ids) == 2  # the whole allowance is fine


def test_group_sampler_batch_must_be_multiple_of_group_size():
    t = make(sampler=SamplerSpec("group", group_size=3))
    t.insert(traj(6, groups=2))
    with pytest.raises(InvalidArgument, match="multiple"):
        t.sample(4, timeout=5)
    rows = t.sample(3)
    gids = rows.data.column("group_id").to_pylist()
    assert len(set(gids)) == 1 and len(gids) == 3
    assert sorted(traj_ids(rows)) == sorted(
        f"traj-{i}" for i in range(6) if f"traj-g{i % 2}" == gids[0])


def test_group_sampler_drops_zero_variance_groups():
    t = make(sampler=SamplerSpec("group", group_size=2, drop_zero_variance=True))
    t.insert(traj(4, groups=2, reward=np.array([1.0, 0.5, 1.0, 0.0])))  # g0: {1,1}, g1: {.5,0}
    assert len(t) == 2 and t.stats()["removed_zero_variance"] == 2
    rows = t.sample(2)
    assert sorted(traj_ids(rows)) == ["traj-1", "traj-3"]


def test_group_size_column_must_match_sampler():
    t = make(sampler=SamplerSpec("group", group_size=3))
    with pytest.raises(InvalidArgument, match="group_size"):
        t.insert(traj(4, groups=2))  # group_size column = 2
    assert len(t) == 0


@pytest.mark.parametrize("sampler", ["fifo", "lifo", "max_heap", "min_heap"])
def test_distinct_samplers_refuse_batches_above_max_size(sampler):
    t = make(max_size=4, sampler=SamplerSpec(sampler))
    t.insert(traj(4))
    with pytest.raises(InvalidArgument, match="max_size"):
        t.sample(5, timeout=5)
    assert len(t.sample(4).item_ids) == 4
    with pytest.raises(InvalidArgument):
        t.sample(0)


def test_fifo_sampler_waits_for_enough_items():
    t = make(max_size=10, sampler=SamplerSpec("fifo"))
    t.insert(traj(2))
    with pytest.raises(DeadlineExceeded):
        t.sample(3, timeout=0)


def test_close_wakes_blocked_sampler_and_inserter():
    t = make(rate_limiter=RATIO)
    t.insert(traj(2, "a"))
    t.sample(2)
    s = Worker(lambda: t.sample(1, timeout=5))
    s.start()
    assert_blocked(s)
    t2 = make("t2", rate_limiter=RATIO)
    t2.insert(traj(2, "a"))
    i = Worker(lambda: t2.insert(traj(1, "b"), timeout=5))
    i.start()
    assert_blocked(i)
    t.close()
    t2.close()
    assert isinstance(s.finish().error, Unavailable)
    assert isinstance(i.finish().error, Unavailable)
    with pytest.raises(Unavailable):
        t.insert(traj(1, "c"))
    with pytest.raises(Unavailable):
        t.sample(1, timeout=0)


def test_subscribe_is_called_on_changes():
    t = make()
    calls = []
    t.subscribe(lambda: calls.append(1))
    t.insert(traj(2))
    n = len(calls)
    assert n >= 1
    t.sample(1)
    assert len(calls) > n


# --- first come, first served ------------------------------------------------------------

QUEUE1 = dict(sampler=SamplerSpec("fifo"), remover="fifo", max_size=1, max_times_sampled=1,
              rate_limiter=RateLimiterSpec(type="queue", size=1))


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def blocked_in_order(t: Table, op: str, calls) -> list[Worker]:
    """Start one worker per call, each only once the one before it waits in the table."""
    workers = []
    for k, call in enumerate(calls, 1):
        w = Worker(call)
        w.start()
        workers.append(w)
        wait_for(lambda: t.stats()[f"{op}_waits"] >= k)  # nothing else wakes them meanwhile
    return workers


@pytest.mark.parametrize("rounds", [5])
def test_blocked_inserts_are_admitted_in_arrival_order(rounds):
    """A Queue(1) table: one insert is stored, seven more wait; each sample lets exactly
    one in, and they come out in the order they arrived (Reverb's pending inserts)."""
    for _ in range(rounds):
        t = make(**QUEUE1)
        t.insert(traj(1, "k1"))
        workers = blocked_in_order(t, "insert", [lambda k=k: t.insert(traj(1, f"k{k}"), timeout=10)
                                                 for k in range(2, 9)])
        queued = t.stats().get("insert_queue")
        order = [traj_ids(t.sample(1, timeout=5))[0] for _ in range(8)]
        assert order == [f"k{k}-0" for k in range(1, 9)]
        assert queued == 7
        for w in workers:
            assert w.finish().error is None
        assert t.stats()["insert_queue"] == 0


def test_blocked_samples_are_served_in_arrival_order():
    t = make(sampler=SamplerSpec("fifo"), max_times_sampled=1)
    workers = blocked_in_order(t, "sample", [lambda: t.sample(1, timeout=10) for _ in range(6)])
    queued = t.stats().get("sample_queue")
    for k in range(6):
        t.insert(traj(1, f"k{k}"))
        wait_for(lambda: t.stats()["samples"] == k + 1)
    assert [traj_ids(w.finish().result) for w in workers] == [[f"k{k}-0"] for k in range(6)]
    assert queued == 6


def test_the_oldest_waiter_holds_back_those_behind_it():
    """Head-of-line, as in Reverb: a later, smaller call that would fit is not let past."""
    t = make(sampler=SamplerSpec("fifo"), max_times_sampled=1)
    big, small = blocked_in_order(t, "sample", [lambda: t.sample(2, timeout=10),
                                                lambda: t.sample(1, timeout=10)])
    t.insert(traj(1, "a"))
    assert_blocked(big)
    assert_blocked(small)  # one item would serve it, but the batch of 2 came first
    with pytest.raises(DeadlineExceeded, match="2 earlier samples are waiting"):
        t.sample(1, timeout=0)  # a newcomer goes behind them too
    t.insert(traj(1, "b"))
    assert traj_ids(big.finish().result) == ["a-0", "b-0"]
    assert_blocked(small)
    t.insert(traj(1, "c"))
    assert traj_ids(small.finish().result) == ["c-0"]


def test_a_newcomer_insert_goes_behind_the_waiting_ones():
    t = make(sampler=SamplerSpec("fifo"), rate_limiter=RateLimiterSpec(type="queue", size=2))
    t.insert(traj(1, "a"))  # diff 1 of 2
    (pair,) = blocked_in_order(t, "insert", [lambda: t.insert(traj(2, "pair"), timeout=10)])
    with pytest.raises(DeadlineExceeded, match="first come, first served"):
        t.insert(traj(1, "late"), timeout=0)  # the limiter alone would take it
    assert len(t) == 1
    t.sample(1)
    assert pair.finish().error is None and len(t) == 3


def test_a_waiter_that_gives_up_lets_the_next_one_through():
    t = make(**QUEUE1)
    t.insert(traj(1, "a"))
    quitter, patient = blocked_in_order(t, "insert", [lambda: t.insert(traj(1, "q"), timeout=0.3),
                                                      lambda: t.insert(traj(1, "p"), timeout=10)])
    assert isinstance(quitter.finish().error, DeadlineExceeded)
    assert traj_ids(t.sample(1)) == ["a-0"]
    assert patient.finish().error is None
    assert traj_ids(t.sample(1)) == ["p-0"] and t.stats()["insert_queue"] == 0


def test_a_call_that_fails_once_admitted_wakes_the_next_in_line():
    """The head is admitted by the limiter, then refused by the memory budget: the call
    behind it must not sleep until some unrelated change."""
    t = make(sampler=SamplerSpec("fifo"), tiers="memory", memory_bytes=64 * 1024,
             rate_limiter=RateLimiterSpec(type="queue", size=2))
    t.insert(traj(1, "a"))  # diff 1 of 2
    big, small = blocked_in_order(t, "insert", [lambda: t.insert(traj(2, "big", tokens=20_000), timeout=10),
                                                lambda: t.insert(traj(1, "small"), timeout=10)])
    t.sample(1)  # diff 0: the big pair is admitted, and does not fit in memory
    assert isinstance(big.finish().error, ResourceExhausted)
    assert small.finish().error is None and len(t) == 2


def test_an_attempt_that_overtakes_an_earlier_call_of_its_connection_waits_for_it():
    """The server hands a connection's calls to engine threads in order (``expect``);
    an attempt that gets to the lock first is told to wait for the earlier one instead
    of passing it, and is woken when that one passes or leaves."""
    t = make(sampler=SamplerSpec("fifo"))
    first, second, other = (t.turn("insert", origin) for origin in ("peer-a", "peer-a", "peer-b"))
    for turn in (first, second, other):
        t.expect(turn)
    late = t.prepare_insert(traj(1, "second"))
    held = t.try_insert(late, second)
    assert isinstance(held, Wait) and "earlier insert of this connection" in held.why  # ``first`` is not there yet
    assert t.try_insert(t.prepare_insert(traj(1, "other")), other).item_ids.tolist() == [1]
    assert t.try_insert(t.prepare_insert(traj(1, "first")), first).item_ids.tolist() == [2]
    assert t.try_insert(late, second).item_ids.tolist() == [3]
    # An earlier call that ends without getting there releases the ones behind it...
    gone, waiting = t.turn("insert", "peer-a"), t.turn("insert", "peer-a")
    t.expect(gone), t.expect(waiting)
    prep = t.prepare_insert(traj(1, "w"))
    held = t.try_insert(prep, waiting)
    assert isinstance(held, Wait)
    waiter = Worker(lambda: t.wait_for_change(held.epoch, 30))
    waiter.start()
    assert_blocked(waiter)
    t.leave(gone)
    assert waiter.finish().error is None  # woken by the leave
    assert t.try_insert(prep, waiting).item_ids.tolist() == [4]
    # ...and one that never comes holds them back up to their own deadline only.
    never, stuck = t.turn("insert", "peer-a"), t.turn("insert", "peer-a")
    t.expect(never), t.expect(stuck)
    prep = t.prepare_insert(traj(1, "s"))
    with pytest.raises(DeadlineExceeded, match="earlier insert of this connection"):
        with Admission(t, "insert", 0.05, stuck) as adm:
            while isinstance(outcome := t.try_insert(prep, stuck), Wait):
                t.wait_for_change(outcome.epoch, adm.limit(outcome))
    t.abandon_insert(prep)
    assert len(t) == 4 and t.stats()["insert_waits"] == 1


def test_the_blocking_calls_and_the_attempts_share_one_line():
    """A thread blocked in ``insert`` and a caller driving ``try_insert`` under another
    waiter (the server's) wait in the same line, first come, first served."""
    t = make(**QUEUE1)
    t.insert(traj(1, "a"))
    (blocked,) = blocked_in_order(t, "insert", [lambda: t.insert(traj(1, "thread"), timeout=10)])
    turn = t.turn("insert")
    prep = t.prepare_insert(traj(1, "attempts"))
    outcome = t.try_insert(prep, turn)
    assert isinstance(outcome, Wait) and "1 earlier inserts are waiting" in outcome.why
    assert traj_ids(t.sample(1)) == ["a-0"]  # room for one: the thread's insert goes first
    assert blocked.finish().error is None
    assert isinstance(t.try_insert(prep, turn), Wait)  # the limiter again
    assert traj_ids(t.sample(1)) == ["thread-0"]
    assert t.try_insert(prep, turn).num_inserted == 1
    assert traj_ids(t.sample(1)) == ["attempts-0"]


# --- staleness ---------------------------------------------------------------------------

def staleness_table(**kw) -> tuple[Table, dict[int, list[int]]]:
    t = make(max_staleness=2, **kw)
    by_version = {v: t.insert(traj(2, f"v{v}", policy_version=v)).item_ids.tolist()
                  for v in (5, 6, 7, 8)}
    return t, by_version


def test_set_policy_version_removes_items_older_than_cutoff():
    t, ids = staleness_table()
    assert t.set_policy_version(9) == 4  # cutoff 7: versions 5 and 6 go, 7 stays
    assert live_ids(t, range(1, 9)) == ids[7] + ids[8]
    assert t.set_policy_version(10) == 2  # cutoff 8: exactly 8 stays
    assert live_ids(t, range(1, 9)) == ids[8]
    assert t.stats()["removed_stale"] == 6 and t.stats()["policy_version"] == 10
    assert set(t.sample(50).policy_versions.tolist()) == {8}
    with pytest.raises(NotFound):
        t.get(ids[7][:1])
    assert t.set_policy_version(10) == 0


def test_stale_items_are_never_streamed():
    t, ids = staleness_table()
    first = t.stream("g", 1, timeout=0)  # v5 item 1 in flight
    assert first.item_ids.tolist() == [1]
    t.set_policy_version(10)
    got = t.stream("g", 10, timeout=0).item_ids.tolist()
    assert got == ids[8]


def test_policy_version_must_not_decrease():
    t = make(max_staleness=1)
    t.set_policy_version(5)
    with pytest.raises(FailedPrecondition, match="decrease"):
        t.set_policy_version(4)
    assert t.policy_version == 5
    with pytest.raises(InvalidArgument):
        t.set_policy_version(-1)
    assert t.set_policy_version(5) == 0


def test_inserting_stale_rows_is_acknowledged_but_never_sampled():
    t = make(max_staleness=1)
    t.set_policy_version(10)  # cutoff 9
    res = t.insert([traj(2, "old", policy_version=8), traj(1, "ok", policy_version=9)])
    assert res.item_ids.tolist() == [1, 2, 3]
    assert (res.num_inserted, res.num_stale, res.num_duplicates) == (3, 2, 0)
    assert len(t) == 1
    assert set(t.sample(20).item_ids.tolist()) == {3}
    with pytest.raises(NotFound):
        t.get([1])
    s = t.stats()
    assert s["removed_stale"] == 2 and s["inserts"] == 3
    retry = t.insert(traj(2, "old", policy_version=8))  # still idempotent
    assert retry.item_ids.tolist() == [1, 2] and retry.num_duplicates == 2
    assert t.stream("g", 10, timeout=0).item_ids.tolist() == [3]


def test_all_stale_insert_stores_nothing():
    t = make(max_staleness=0)
    t.set_policy_version(3)
    res = t.insert(traj(4, policy_version=2))
    assert res.num_stale == 4 and len(res.item_ids) == 4 and len(t) == 0
    assert t.stats()["memory_bytes"] == 0 and t.stats()["chunks"] == 0
    with pytest.raises(DeadlineExceeded):
        t.sample(1, timeout=0)


def test_without_max_staleness_nothing_is_stale():
    t = make()
    t.insert(traj(2, policy_version=0))
    assert t.set_policy_version(100) == 0 and len(t) == 2


# --- update_priorities -------------------------------------------------------------------

def test_update_priorities_changes_prioritized_sampling():
    t = make(sampler=SamplerSpec("prioritized", alpha=1.0), seed=1)
    ids = t.insert(traj(10)).item_ids
    before = t.sample(400).item_ids
    assert (before == ids[6]).mean() < 0.3
    assert t.update_priorities([ids[6]], [1e6]).num_updated == 1
    after = t.sample(400)
    assert (after.item_ids == ids[6]).mean() > 0.95
    assert t.get([ids[6]]).priorities.tolist() == [1e6]
    p = after.probabilities[after.item_ids == ids[6]]
    assert p == pytest.approx(1e6 / (1e6 + 9))
    assert t.stats()["priority_updates"] == 1


def test_priority_zero_excludes_an_item_at_alpha_zero():
    t = make(sampler=SamplerSpec("prioritized", alpha=0.0), seed=3)
    ids = t.insert(traj(3), priorities=[1.0, 0.0, 4.0]).item_ids.tolist()
    batch = t.sample(3000)
    assert set(batch.item_ids.tolist()) == {ids[0], ids[2]}
    np.testing.assert_array_equal(batch.probabilities, 0.5)
    t.update_priorities(ids, [0.0, 0.0, 0.0])  # all excluded: uniform over all, as in Reverb
    assert set(t.sample(300).item_ids.tolist()) == set(ids)


def test_update_priorities_changes_heap_order():
    t = make(sampler=SamplerSpec("max_heap"))
    t.insert(traj(4), priorities=[4.0, 3.0, 2.0, 1.0])
    assert t.sample(1).item_ids.tolist() == [1]
    t.update_priorities([4, 1], [10.0, 0.0])
    assert t.sample(4).item_ids.tolist() == [4, 2, 3, 1]


def test_heap_ties_rotate_after_updates_and_the_min_priority_remover_follows():
    """Reverb breaks heap ties by the least recently inserted *or updated* item, so a
    trainer that resets equal priorities makes equal items take turns; the min_priority
    remover evicts by the same rule."""
    t = make(sampler=SamplerSpec("max_heap"), remover="min_priority", max_size=4)
    ids = t.insert(traj(4), priorities=[1.0] * 4).item_ids.tolist()
    assert t.sample(4).item_ids.tolist() == ids
    t.update_priorities([ids[0]], [1.0])
    assert t.sample(4).item_ids.tolist() == ids[1:] + ids[:1]
    t.update_priorities([ids[2], ids[1]], [1.0, 1.0])  # in call order
    assert t.sample(4).item_ids.tolist() == [ids[3], ids[0], ids[2], ids[1]]
    new = t.insert(traj(1, "new"), priorities=[5.0]).item_ids.tolist()
    assert live_ids(t, ids + new) == [ids[0], ids[1], ids[2]] + new  # ids[3]: least recently touched


def test_update_priorities_skips_removed_items_and_reports_them():
    """A trainer updates the batch it sampled; with max_times_sampled some of it has left
    meanwhile. The live items are updated all the same (Reverb ignores missing keys)."""
    t = make(sampler=SamplerSpec("max_heap"), max_times_sampled=1)
    ids = t.insert(traj(4), priorities=[4.0, 3.0, 2.0, 1.0]).item_ids
    batch = t.sample(2).item_ids  # the two highest, now removed
    assert batch.tolist() == [ids[0], ids[1]]
    done = t.update_priorities([ids[1], ids[2], 99, ids[0], ids[3], 99], [9.0, 0.5, 9.0, 9.0, 7.0, 1.0])
    assert done.num_updated == 2
    assert done.unknown_item_ids.tolist() == [ids[1], 99, ids[0]]  # once each, in call order
    assert done.unknown_item_ids.dtype == np.uint64
    assert t.get(ids[2:]).priorities.tolist() == [0.5, 7.0]
    assert t.sample(2).item_ids.tolist() == [ids[3], ids[2]]
    assert t.stats()["priority_updates"] == 2


def test_update_priorities_of_only_unknown_ids_changes_nothing():
    t = make(sampler=SamplerSpec("max_heap"))
    ids = t.insert(traj(2), priorities=[1.0, 2.0]).item_ids
    calls = []
    t.subscribe(lambda: calls.append(1))
    done = t.update_priorities([50, 60], [9.0, 9.0])
    assert done.num_updated == 0 and done.unknown_item_ids.tolist() == [50, 60]
    assert t.get(ids).priorities.tolist() == [1.0, 2.0] and calls == []


def test_update_priorities_repeated_id_last_wins():
    t = make(sampler=SamplerSpec("max_heap"))
    ids = t.insert(traj(2), priorities=[1.0, 2.0]).item_ids
    assert t.update_priorities([ids[0], ids[1], ids[0]], [9.0, 3.0, 0.5]).num_updated == 2
    assert t.get(ids).priorities.tolist() == [0.5, 3.0]
    assert t.sample(2).item_ids.tolist() == [ids[1], ids[0]]


@pytest.mark.parametrize("bad", [[-1.0], [float("nan")], [1.0, 2.0]])
def test_update_priorities_validates(bad):
    t = make()
    ids = t.insert(traj(1)).item_ids
    with pytest.raises(InvalidArgument):
        t.update_priorities(ids, bad)
    assert t.get(ids).priorities.tolist() == [1.0]


def test_update_priorities_without_priorities_is_invalid():
    t = make(sampler=SamplerSpec("max_heap"))
    ids = t.insert(traj(2), priorities=[5.0, 7.0]).item_ids
    with pytest.raises(InvalidArgument):
        t.update_priorities(ids, [])
    assert t.get(ids).priorities.tolist() == [5.0, 7.0]


@pytest.mark.parametrize("call", ["update_none", "update_scalar", "insert_scalar"])
def test_priorities_of_wrong_shape_are_invalid_argument(call):
    t = make()
    ids = t.insert(traj(2)).item_ids
    with pytest.raises(InvalidArgument):
        if call == "update_none":
            t.update_priorities(ids, None)
        elif call == "update_scalar":
            t.update_priorities(ids, 3.0)
        else:
            t.insert(traj(1, "x"), priorities=2.0)
    assert len(t) == 2 and t.get(ids).priorities.tolist() == [1.0, 1.0]


# --- get -------------------------------------------------------------------------------

def test_get_returns_ids_in_given_order():
    t = make()
    t.insert(traj(3, "a"))
    t.insert(traj(3, "b"))
    rows = t.get([5, 1, 3, 5])
    assert rows.item_ids.tolist() == [5, 1, 3, 5]
    assert traj_ids(rows) == ["b-1", "a-0", "a-2", "b-1"]
    assert t.get([]).data.num_rows == 0


def test_get_unknown_id_names_it():
    t = make()
    t.insert(traj(3))
    with pytest.raises(NotFound, match=r"id 42\b"):
        t.get([1, 42, 2])
    with pytest.raises(NotFound, match=r"id 4\b"):
        t.get([4])


def test_get_negative_id_is_an_engine_error():
    t = make()
    t.insert(traj(1))
    with pytest.raises((NotFound, InvalidArgument)):
        t.get([-1])


def test_get_does_not_count_as_sample():
    t = make()
    t.insert(traj(1))
    t.get([1])
    assert t.get([1]).times_sampled.tolist() == [0]
    assert t.stats()["samples"] == 0


# --- stats ------------------------------------------------------------------------------

def test_stats_counters_follow_operations():
    t = make(max_size=5, max_times_sampled=2, sampler=SamplerSpec("fifo"), max_staleness=0)
    s0 = t.stats()
    assert s0["items"] == 0 and s0["inserts"] == 0 and s0["consumer_groups"] == 0
    t.insert(traj(4, "a", policy_version=1))
    t.insert(traj(4, "a", policy_version=1))  # 4 duplicates
    t.insert(traj(3, "b", policy_version=1))  # evicts 2
    s = t.stats()
    assert (s["items"], s["inserts"], s["duplicates"], s["removed_max_size"]) == (5, 7, 4, 2)
    assert s["sampler_eligible"] == 5
    assert s["inserted_bytes"] > 0
    t.sample(2)
    t.sample(2)  # ids 3, 4 reach 2 samples
    s = t.stats()
    assert (s["samples"], s["removed_max_times_sampled"], s["items"]) == (4, 2, 3)
    t.update_priorities([5, 6], [2.0, 3.0])
    t.stream("g", 2, timeout=0)
    s = t.stats()
    assert s["priority_updates"] == 2 and s["stream_deliveries"] == 2
    assert s["consumer_groups"] == 1 and s["group.g.delivered"] == 2
    t.set_policy_version(2)
    s = t.stats()
    assert s["removed_stale"] == 3 and s["items"] == 0 and s["policy_version"] == 2
    assert s["rate_limiter_inserts"] == 7 and s["rate_limiter_deletes"] == 7
    assert s["rate_limiter_samples"] == 4


def test_insert_wait_counted():
    t = make(rate_limiter=RATIO)
    t.insert(traj(2, "a"))
    with pytest.raises(DeadlineExceeded):
        t.insert(traj(1, "b"), timeout=0.02)
    s = t.stats()
    assert s["insert_waits"] >= 1 and s["insert_wait_seconds"] > 0


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
