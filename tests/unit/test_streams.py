"""Streams: consumer groups over a table (Table.stream / Table.ack) with a fake clock for
visibility timeouts, and ConsumerGroup on its own."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from expstore.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from expstore.spec import TableSpec
from expstore.streams import ConsumerGroup
from expstore.synthetic import trajectories
from expstore.table import Table

pytestmark = pytest.mark.timeout(30)  # a fake clock never advances by itself: fail, don't hang


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def traj(n, prefix="traj", **kw):
    return trajectories(n, tokens=8, id_prefix=prefix, **kw)


def make(clock=None, **kw) -> Table:
    return Table(TableSpec("s", **kw), seed=0, **({"clock": clock} if clock else {}))


def ids(rows) -> list[int]:
    return rows.item_ids.tolist()


def caught_up(t: Table, group: str, n: int = 10) -> DeadlineExceeded:
    with pytest.raises(DeadlineExceeded) as e:
        t.stream(group, n, timeout=0)
    return e.value


# --- delivery order ---------------------------------------------------------------------

def test_each_item_once_in_insertion_order_across_batches():
    t = make()
    t.insert(traj(3, "a"))
    t.insert(traj(4, "b"))
    first = t.stream("g", 4, timeout=0)
    assert ids(first) == [1, 2, 3, 4]
    assert first.data.column("traj_id").to_pylist() == ["a-0", "a-1", "a-2", "b-0"]
    t.insert(traj(3, "c"))
    assert ids(t.stream("g", 4, timeout=0)) == [5, 6, 7, 8]
    assert ids(t.stream("g", 4, timeout=0)) == [9, 10]
    assert caught_up(t, "g").retry_after is not None  # items in flight: a deadline is known
    assert t.stats()["stream_deliveries"] == 10


def test_stream_returns_what_is_there_without_waiting_for_n():
    t = make()
    t.insert(traj(2))
    assert ids(t.stream("g", 100, timeout=5)) == [1, 2]


def test_groups_are_independent():
    t = make()
    t.insert(traj(5))
    assert ids(t.stream("x", 3, timeout=0)) == [1, 2, 3]
    assert ids(t.stream("y", 2, timeout=0)) == [1, 2]
    t.ack("x", [1, 2, 3])
    assert ids(t.stream("y", 10, timeout=0)) == [3, 4, 5]
    assert ids(t.stream("x", 10, timeout=0)) == [4, 5]
    s = t.stats()
    assert s["consumer_groups"] == 2
    assert s["group.x.acked"] == 3 and s["group.y.acked"] == 0
    assert s["group.y.inflight"] == 5


def test_streaming_does_not_count_as_sampling():
    t = make(max_times_sampled=1)
    t.insert(traj(2))
    t.stream("g", 2, timeout=0)
    assert len(t) == 2
    assert t.get([1, 2]).times_sampled.tolist() == [0, 0]


# --- visibility timeout ------------------------------------------------------------------

def test_unacked_items_redelivered_after_visibility_timeout():
    clock = FakeClock()
    t = make(clock)
    t.insert(traj(4))
    assert ids(t.stream("g", 3, timeout=0, visibility_timeout=10)) == [1, 2, 3]
    t.ack("g", [2])
    clock.advance(9.5)
    assert ids(t.stream("g", 10, timeout=0, visibility_timeout=10)) == [4]
    caught_up(t, "g")
    clock.advance(0.5)  # 1 and 3 expire at exactly 1010
    again = t.stream("g", 10, timeout=0, visibility_timeout=10)
    assert ids(again) == [1, 3]
    assert again.data.column("traj_id").to_pylist() == ["traj-0", "traj-2"]
    s = t.stats()
    assert s["group.g.redelivered"] == 2 and s["group.g.delivered"] == 6
    clock.advance(9.5)  # 4 expires at 1019.5; 1 and 3 now at 1020
    assert ids(t.stream("g", 10, timeout=0, visibility_timeout=10)) == [4]
    t.ack("g", [1, 3, 4])
    clock.advance(100)
    e = caught_up(t, "g")
    assert e.retry_after is None  # nothing in flight: only an insert can help


def test_redeliveries_come_before_unread_items():
    clock = FakeClock()
    t = make(clock)
    t.insert(traj(2))
    t.stream("g", 1, timeout=0, visibility_timeout=1)
    clock.advance(1)
    assert ids(t.stream("g", 2, timeout=0, visibility_timeout=1)) == [1, 2]
    clock.advance(1)
    t.insert(traj(2, "b"))
    mixed = t.stream("g", 3, timeout=0, visibility_timeout=1)  # two chunks in one delivery
    assert ids(mixed) == [1, 2, 3]
    assert mixed.data.column("traj_id").to_pylist() == ["traj-0", "traj-1", "b-0"]


def test_acked_items_are_never_redelivered():
    clock = FakeClock()
    t = make(clock)
    t.insert(traj(3))
    t.stream("g", 3, timeout=0, visibility_timeout=1)
    assert t.ack("g", [1, 2, 3]) == (3, 0)
    clock.advance(1000)
    caught_up(t, "g")
    assert t.stats()["group.g.redelivered"] == 0


def test_retry_after_reflects_next_visibility_deadline():
    clock = FakeClock(1000.0)
    t = make(clock)
    t.insert(traj(1, "a"))
    t.stream("g", 1, timeout=0, visibility_timeout=10)  # deadline 1010
    clock.advance(4)
    t.insert(traj(1, "b"))
    t.stream("g", 1, timeout=0, visibility_timeout=3)  # deadline 1007
    clock.advance(1)  # now 1005
    assert caught_up(t, "g").retry_after == pytest.approx(2.0)
    t.ack("g", [2])
    assert caught_up(t, "g").retry_after == pytest.approx(5.0)


def test_caught_up_without_in_flight_has_no_retry_after():
    t = make()
    e = caught_up(t, "g")
    assert e.retry_after is None
    t.insert(traj(1))
    assert ids(t.stream("g", 1, timeout=0)) == [1]


# --- ack ---------------------------------------------------------------------------------

def test_ack_of_never_delivered_id_is_not_found_and_acks_nothing():
    t = make()
    t.insert(traj(4))
    t.stream("g", 2, timeout=0)
    with pytest.raises(NotFound, match=r"\b3\b"):
        t.ack("g", [1, 3])
    assert t.stats()["group.g.acked"] == 0
    assert t.ack("g", [1]) == (1, 0)  # 1 was still in flight
    with pytest.raises(NotFound):
        t.ack("g", [99])
    with pytest.raises(NotFound, match="consumer group"):
        t.ack("other", [1])


def test_nacked_items_come_back_first_at_once_in_id_order():
    clock = FakeClock()
    t = make(clock)
    t.insert(traj(6))
    assert ids(t.stream("g", 4, timeout=0, visibility_timeout=600)) == [1, 2, 3, 4]
    t.ack("g", [3])
    assert t.nack("g", [4, 3, 2]) == 2  # 3 stays acked
    again = t.stream("g", 3, timeout=0, visibility_timeout=600)  # no time passed
    assert ids(again) == [2, 4, 5]
    assert again.data.column("traj_id").to_pylist() == ["traj-1", "traj-3", "traj-4"]
    assert t.nack("g", [4]) == 1 and ids(t.stream("g", 1, timeout=0)) == [4]
    s = t.stats()
    assert s["group.g.redelivered"] == 3 and s["group.g.acked"] == 1
    clock.advance(59)  # 1 was never nacked: it waits for its visibility timeout
    assert ids(t.stream("g", 5, timeout=0)) == [6]


def test_nack_of_never_delivered_id_is_not_found_and_changes_nothing():
    t = make()
    t.insert(traj(4))
    t.stream("g", 2, timeout=0, visibility_timeout=600)
    with pytest.raises(NotFound, match=r"\b3\b"):
        t.nack("g", [1, 3])
    assert ids(t.stream("g", 5, timeout=0)) == [3, 4]  # 1 was not handed back
    with pytest.raises(NotFound, match="consumer group"):
        t.nack("other", [1])


def test_ack_twice_counts_already_acked():
    t = make()
    t.insert(traj(3))
    t.stream("g", 3, timeout=0)
    assert t.ack("g", [1, 2]) == (2, 0)
    assert t.ack("g", [2, 3]) == (1, 1)
    assert t.ack("g", [1, 2, 3]) == (0, 3)
    s = t.stats()
    assert s["group.g.acked"] == 3 and s["group.g.inflight"] == 0


def test_ack_moves_committed_offset():
    t = make()
    t.insert(traj(4))
    t.stream("g", 4, timeout=0)
    assert t.stats()["group.g.committed"] == 1
    t.ack("g", [2, 3])
    assert t.stats()["group.g.committed"] == 1
    t.ack("g", [1])
    assert t.stats()["group.g.committed"] == 4
    t.ack("g", [4])
    s = t.stats()
    assert s["group.g.committed"] == 5 and s["group.g.position"] == 5


def test_ack_before_latest_start_is_not_found():
    t = make()
    t.insert(traj(3))
    with pytest.raises(DeadlineExceeded):  # creates the group at the latest position
        t.stream("g", 10, timeout=0, start="latest")
    with pytest.raises(NotFound, match=r"\b1\b"):
        t.ack("g", [1])
    t.insert(traj(1, "b"))
    assert ids(t.stream("g", 10, timeout=0)) == [4]
    with pytest.raises(NotFound):
        t.ack("g", [3, 4])
    assert t.ack("g", [4]) == (1, 0)


# --- start ---------------------------------------------------------------------------------

def test_start_latest_skips_existing_items():
    t = make()
    t.insert(traj(3, "old"))
    with pytest.raises(DeadlineExceeded):
        t.stream("late", 10, timeout=0, start="latest")
    t.insert(traj(2, "new"))
    got = t.stream("late", 10, timeout=0, start="latest")
    assert ids(got) == [4, 5]
    assert got.data.column("traj_id").to_pylist() == ["new-0", "new-1"]
    assert ids(t.stream("early", 10, timeout=0)) == [1, 2, 3, 4, 5]


def test_start_applies_only_when_group_is_created():
    t = make()
    t.insert(traj(2))
    assert ids(t.stream("g", 1, timeout=0)) == [1]
    t.insert(traj(1, "b"))
    assert ids(t.stream("g", 10, timeout=0, start="latest")) == [2, 3]  # existing group keeps its position


# --- removed items ---------------------------------------------------------------------

def test_evicted_items_are_skipped():
    t = make(max_size=3)
    t.insert(traj(2, "a"))
    assert ids(t.stream("g", 1, timeout=0)) == [1]
    t.insert(traj(3, "b"))  # evicts 1 and 2
    assert ids(t.stream("g", 10, timeout=0)) == [3, 4, 5]


def test_removed_in_flight_items_are_not_redelivered():
    clock = FakeClock()
    t = make(clock, max_size=2)
    t.insert(traj(2, "a"))
    assert ids(t.stream("g", 2, timeout=0, visibility_timeout=1)) == [1, 2]
    t.insert(traj(2, "b"))  # evicts both in-flight items
    clock.advance(5)
    assert ids(t.stream("g", 10, timeout=0, visibility_timeout=1)) == [3, 4]
    clock.advance(5)
    assert ids(t.stream("g", 10, timeout=0, visibility_timeout=1)) == [3, 4]  # redelivered; 1, 2 gone
    assert t.stats()["group.g.inflight"] == 2


def test_stale_items_are_skipped():
    t = make(max_staleness=1)
    for v in (1, 2, 3):
        t.insert(traj(1, f"v{v}", policy_version=v))
    t.set_policy_version(3)  # cutoff 2: version 1 goes
    assert ids(t.stream("g", 10, timeout=0)) == [2, 3]
    t.insert(traj(1, "v0", policy_version=0))  # stale on arrival: acknowledged, not streamed
    caught_up(t, "g")


# --- arguments, threads, close -------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(n=0), dict(group=""), dict(visibility_timeout=0),
                                dict(visibility_timeout=-1), dict(start="middle")])
def test_invalid_stream_arguments(kw):
    t = make()
    t.insert(traj(1))
    args = dict(group="g", n=1) | kw
    with pytest.raises(InvalidArgument):
        t.stream(args.pop("group"), args.pop("n"), timeout=5, **args)


def test_blocked_stream_released_by_insert():
    t = make()
    out: dict = {}

    def run():
        try:
            out["rows"] = t.stream("g", 5, timeout=5)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    time.sleep(0.05)
    assert th.is_alive()
    t.insert(traj(2))
    th.join(2)
    assert not th.is_alive() and "error" not in out
    assert ids(out["rows"]) == [1, 2]


def test_blocked_stream_wakes_for_expired_visibility_without_any_change():
    t = make()
    t.insert(traj(1))
    t.stream("g", 1, timeout=0, visibility_timeout=0.05)
    start = time.monotonic()
    again = t.stream("g", 1, timeout=2)  # no insert will come: only the deadline can help
    assert ids(again) == [1]
    assert time.monotonic() - start < 1.0
    assert t.stats()["group.g.redelivered"] == 1


def test_stream_small_timeout_and_close():
    t = make()
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        t.stream("g", 1, timeout=0.05)
    assert 0.04 <= time.monotonic() - start < 1.0
    out: dict = {}

    def run():
        try:
            t.stream("g", 1, timeout=5)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    time.sleep(0.05)
    t.close()
    th.join(2)
    assert not th.is_alive() and isinstance(out.get("error"), Unavailable)
    with pytest.raises(Unavailable):
        t.stream("g", 1, timeout=0)


# --- ConsumerGroup ---------------------------------------------------------------------------

U = np.uint64


def arr(*xs):
    return np.array(xs, dtype=U)


def test_group_starts_empty():
    g = ConsumerGroup("g", 7)
    assert g.position == 7 and g.committed == 7
    assert g.next_deadline() is None
    assert g.expired(1e9, 10).tolist() == []
    assert g.stats() == {"position": 7, "committed": 7, "inflight": 0, "delivered": 0,
                         "redelivered": 0, "acked": 0}


def test_group_delivery_expiry_and_redelivery():
    g = ConsumerGroup("g", 1)
    g.deliver(arr(1, 2, 3), arr(), deadline=10.0)
    assert g.position == 4 and g.committed == 1 and g.next_deadline() == 10.0
    assert g.expired(9.99, 10).tolist() == []
    assert g.expired(10.0, 10).tolist() == [1, 2, 3]
    assert g.expired(10.0, 2).tolist() == [1, 2]
    g.deliver(arr(5), arr(1, 2), deadline=20.0)
    assert g.position == 6
    assert g.expired(10.0, 10).tolist() == [3]
    assert g.next_deadline() == 10.0
    assert g.expired(20.0, 10).tolist() == [1, 2, 3, 5]
    st = g.stats()
    assert (st["delivered"], st["redelivered"], st["inflight"]) == (6, 2, 4)


def test_group_ack_and_committed():
    g = ConsumerGroup("g", 1)
    g.deliver(arr(1, 2, 3, 4), arr(), deadline=5.0)
    assert g.ack(arr(2, 4, 4)) == (2, 0)
    assert g.committed == 1
    assert g.ack(arr(1, 2)) == (1, 1)
    assert g.committed == 3
    assert g.expired(100.0, 10).tolist() == [3]
    assert g.ack(arr(3)) == (1, 0)
    assert g.committed == g.position == 5
    assert g.next_deadline() is None
    assert g.stats()["acked"] == 4


def test_group_check_ack_refuses_unread_ids():
    g = ConsumerGroup("g", 1)
    g.deliver(arr(1, 2), arr(), deadline=5.0)
    g.check_ack(arr(1, 2), "t")
    with pytest.raises(NotFound, match=r"'g'.*item 3"):
        g.check_ack(arr(1, 3), "t")
    g.ack(arr(1))
    g.check_ack(arr(1), "t")  # acked already: not an error, ack reports it


def test_group_check_ack_refuses_ids_before_its_start():
    g = ConsumerGroup("g", 10)
    g.deliver(arr(10, 11), arr(), deadline=5.0)
    g.ack(arr(10))
    g.check_ack(arr(10, 11), "t")
    with pytest.raises(NotFound, match="item 9"):
        g.check_ack(arr(9, 11), "t")


def test_group_forget_drops_in_flight():
    g = ConsumerGroup("g", 1)
    g.deliver(arr(1, 2, 3), arr(), deadline=5.0)
    g.forget(arr(1, 3, 9))
    assert g.expired(5.0, 10).tolist() == [2]
    assert g.committed == 2
    g.forget(arr(2))
    assert g.committed == g.position == 4


# -- training cuts: manifests and step 0 --------------------------------------------------


def test_a_cut_records_its_ids_as_the_steps_manifest_and_a_recommit_replaces_it():
    t = make(max_staleness=10)
    t.insert(traj(6, policy_version=2))
    first = ids(t.stream("g", 2))
    t.commit_cut("g", 1, first)
    got, versions = t.manifest(1)
    assert got.tolist() == first and versions.tolist() == [2, 2]
    t.commit_cut("g", 1, first)  # a retried commit: the same manifest, not twice
    assert t.manifest(1)[0].tolist() == first
    second = ids(t.stream("g", 2))
    t.set_policy_version(13)  # the items leave the table before the cut: version unknown
    t.commit_cut("g", 2, second)
    assert t.manifest(2)[1].tolist() == [-1, -1]


def test_resume_forgets_the_manifests_of_later_steps():
    t = make()
    t.insert(traj(6))
    for step in (1, 2, 3):
        t.commit_cut("g", step, ids(t.stream("g", 2)))
    t.resume("g", 1)
    assert t.manifest(1)[0].tolist() == [1, 2]
    for step in (2, 3):
        with pytest.raises(NotFound, match=f"no manifest for step {step}"):
            t.manifest(step)
    t.commit_cut("g", 2, ids(t.stream("g", 2)))  # step 2 again: items 3 and 4 again
    assert t.manifest(2)[0].tolist() == [3, 4]


def test_a_cut_without_ids_creates_a_group_at_the_earliest_item():
    t = make()
    t.insert(traj(4))
    assert t.commit_cut("g", 0) == 0
    assert t.manifest(0)[0].tolist() == []
    assert ids(t.stream("g", 10, start="latest")) == [1, 2, 3, 4]  # the group exists: start does not apply
    t.resume("g", 0)
    assert ids(t.stream("g", 10)) == [1, 2, 3, 4]
    with pytest.raises(NotFound, match="no consumer group 'other'"):
        t.commit_cut("other", 1, [1])  # with ids, the group must have read them
    with pytest.raises(InvalidArgument, match="consumer group name '../x' is not allowed"):
        t.commit_cut("../x", 0)
    assert t.stats()["consumer_groups"] == 1  # "g" only
