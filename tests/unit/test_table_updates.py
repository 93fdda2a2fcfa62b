"""Table staleness (policy versions), priority updates, get, and stats.
"""

from __future__ import annotations

import numpy as np
import pytest

from expstore.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from expstore.spec import SamplerSpec
from expstore.table import Table

from _tables import make, traj, traj_ids, live_ids, RATIO

pytestmark = pytest.mark.timeout(30)  # a call that blocks by mistake fails instead of hanging


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
