"""Table sampling: rows and their facts, max_times_sampled, rate limiting across threads,
the group sampler, closing, and first come, first served for blocked calls.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from expstore.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from expstore.admission import Admission, Wait
from expstore.spec import RateLimiterSpec, SamplerSpec
from expstore.table import Table

from _tables import make, traj, traj_ids, live_ids, assert_blocked, Worker, RATIO

pytestmark = pytest.mark.timeout(30)  # a call that blocks by mistake fails instead of hanging


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
