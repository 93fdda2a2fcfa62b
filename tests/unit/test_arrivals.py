"""The server's arrival order: a client's calls are handed to the engine in the order the
client started them, whatever order grpc starts their handlers in and their uploads and
validations finish in."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings, strategies as st

from expstore.errors import InvalidArgument
from expstore_server import arrivals as arrivals_module
from expstore_server.arrivals import ORDER_KEY, Arrivals, order_of


def test_a_connections_calls_go_in_the_order_they_started():
    async def main():
        arrivals = Arrivals()
        first, second, third = (arrivals.start("insert", "peer-a", None) for _ in range(3))
        other = arrivals.start("insert", "peer-b", None)
        sample = arrivals.start("sample", "peer-a", None)
        assert await first.wait(0) and await other.wait(0) and await sample.wait(0)  # nobody before them
        assert not await second.wait(0.01) and not await third.wait(0.01)
        second.dispatched()  # ended before its turn (say, bad rows): it passes on only in order
        assert not await third.wait(0.01)
        first.dispatched()
        assert await third.wait(1)
        third.dispatched()
        later = arrivals.start("insert", "peer-a", None)
        assert await later.wait(0)  # everything before it has gone

    asyncio.run(main())


def test_a_call_waiting_for_an_earlier_one_is_not_cancelled_with_it():
    async def main():
        arrivals = Arrivals()
        first, second = arrivals.start("insert", "p", None), arrivals.start("insert", "p", None)
        waiter = asyncio.create_task(second.wait(None))
        await asyncio.sleep(0.01)
        waiter.cancel()  # the second call is cancelled while it waits...
        await asyncio.gather(waiter, return_exceptions=True)
        with second:  # ...and ends
            pass
        third = arrivals.start("insert", "p", None)
        assert not await third.wait(0.01)  # the first still has not gone
        first.dispatched()
        assert await third.wait(1)

    asyncio.run(main())


def test_numbered_calls_go_in_the_clients_order_whatever_order_they_arrive_in():
    async def main():
        arrivals = Arrivals()
        second = arrivals.start("sample", "conn-1", ("client-a", 1, 0))  # its handler started first
        assert not await second.wait(0.05)
        first = arrivals.start("sample", "conn-1", ("client-a", 0, 0))
        assert await first.wait(0) and not await second.wait(0.01)
        first.dispatched()
        assert await second.wait(1)

    asyncio.run(main())


def test_the_calls_a_client_saw_end_are_not_waited_for():
    async def main():
        arrivals = Arrivals()
        # calls 0..4 ended at the client long ago (their line was forgotten, or they never
        # reached the server): LOW says so, and call 5 goes at once
        assert await arrivals.start("insert", "conn", ("client-a", 5, 5)).wait(0)
        # a new line starts at LOW: call 8 waits for 7, still on its way
        eight = arrivals.start("insert", "conn", ("client-b", 8, 7))
        assert not await eight.wait(0.05)
        seven = arrivals.start("insert", "conn", ("client-b", 7, 7))
        seven.dispatched()
        assert await eight.wait(1)

    asyncio.run(main())


def test_a_number_that_never_arrives_is_given_up_on(monkeypatch):
    monkeypatch.setattr(arrivals_module, "GAP_GRACE_S", 0.2)

    async def main():
        arrivals = Arrivals()
        zero = arrivals.start("insert", "conn", ("client-a", 0, 0))
        assert await zero.wait(0)
        zero.dispatched()
        # call 1 was lost on the way; calls 2 and 3 arrive, 3 first
        three = arrivals.start("insert", "conn", ("client-a", 3, 1))
        two = arrivals.start("insert", "conn", ("client-a", 2, 1))
        assert not await two.wait(0.05)  # within the grace, call 1 may still come
        assert await two.wait(2) and not await three.wait(0.01)  # then 2 goes, still before 3
        two.dispatched()
        assert await three.wait(1)
        late = arrivals.start("insert", "conn", ("client-a", 1, 1))  # the lost call turns up after all
        assert await late.wait(0)

    asyncio.run(main())


def test_calls_the_client_gave_up_on_never_take_the_turn_back(monkeypatch):
    monkeypatch.setattr(arrivals_module, "GAP_GRACE_S", 0.1)

    async def main():
        arrivals = Arrivals()
        arrivals.start("insert", "conn", ("c", 0, 0)).dispatched()
        one = arrivals.start("insert", "conn", ("c", 1, 0))  # its turn; still being received
        two = arrivals.start("insert", "conn", ("c", 2, 0))  # waits for it
        # the client's deadline passed for 1 and 2; call 3 is on its way, 4 got here first
        four = arrivals.start("insert", "conn", ("c", 4, 3))
        assert await one.wait(0) and await two.wait(0)  # they wait for nothing any more
        assert await four.wait(1)  # 3 never came: given up on after the grace
        five = arrivals.start("insert", "conn", ("c", 5, 3))
        two.dispatched()
        one.dispatched()  # the abandoned calls going on do not hold up the line
        assert not await five.wait(0.2)  # ...but 5 still comes after 4
        four.dispatched()
        assert await five.wait(1)

    asyncio.run(main())


def test_an_idle_line_is_forgotten_and_a_running_one_is_not(monkeypatch):
    monkeypatch.setattr(arrivals_module, "IDLE_S", 0.0)

    async def main():
        arrivals = Arrivals()
        with arrivals.start("insert", "conn", ("running", 0, 0)) as running:
            running.dispatched()  # had its turn, still running (say, blocked by the rate limiter)
            with arrivals.start("insert", "conn", ("ended", 0, 0)):
                pass
            arrivals.start("insert", "conn", ("other", 0, 0)).dispatched()  # forgets idle lines
            # "running" is remembered: call 1 knows call 0 had its turn
            assert await arrivals.start("insert", "conn", ("running", 1, 0)).wait(0)
            # "ended" was forgotten: its call 1 (whose client had not seen call 0 end) waits
            # for a call 0 that already went; kept lines (IDLE_S) are what spares it this
            assert not await arrivals.start("insert", "conn", ("ended", 1, 0)).wait(0.01)

    asyncio.run(main())


@settings(max_examples=200, deadline=None)
@given(st.permutations(range(8)), st.lists(st.booleans(), min_size=8, max_size=8))
def test_any_arrival_order_is_dispatched_in_the_clients_order(arrival_order, fails_early):
    """Calls numbered 0..7 arrive in any order; some end before their turn (an error while
    receiving). Those that wait are handed on strictly in number order."""
    async def main():
        arrivals = Arrivals()
        dispatched: list[int] = []

        async def call(seq: int):
            with arrivals.start("insert", "conn", ("client", seq, 0)) as arrival:
                if fails_early[seq]:
                    return
                assert await arrival.wait(5)
                dispatched.append(seq)
                arrival.dispatched()

        tasks = []
        for seq in arrival_order:
            tasks.append(asyncio.create_task(call(seq)))
            await asyncio.sleep(0)  # each handler starts before the next arrives
        await asyncio.gather(*tasks)
        assert dispatched == sorted(s for s in range(8) if not fails_early[s])

    asyncio.run(main())


@pytest.mark.parametrize("value", ["", "abc", "a:1", "a:x:0", "a:1:2", "a:-1:0", ":1:0", "x" * 65 + ":1:0"])
def test_bad_order_metadata_is_refused_with_what_it_must_be(value):
    with pytest.raises(InvalidArgument, match=ORDER_KEY):
        order_of([(ORDER_KEY, value)])


def test_order_metadata_is_read():
    assert order_of([("authorization", "Bearer t"), (ORDER_KEY, "ab:cd:7:3")]) == ("ab:cd", 7, 3)
    assert order_of([("authorization", "Bearer t")]) is None and order_of(None) is None


def test_a_stalled_loop_does_not_give_up_on_a_call_received_during_the_stall(monkeypatch):
    """The grace counts time in which the loop ran. After a stall longer than the grace,
    the missing call's handler may be queued behind the grace timer (grpc starts a handler
    a few loop iterations after its call is received): it still goes first."""
    monkeypatch.setattr(arrivals_module, "GAP_GRACE_S", 0.2)

    async def main():
        loop = asyncio.get_running_loop()
        arrivals = Arrivals()
        arrivals.start("insert", "conn", ("c", 0, 0)).dispatched()
        two = arrivals.start("insert", "conn", ("c", 2, 1))  # call 1 is on its way
        one = []

        def stall():
            time.sleep(0.35)  # the loop is held up past the grace; call 1 is received meanwhile
            loop.call_soon(loop.call_soon, lambda: one.append(arrivals.start("insert", "conn", ("c", 1, 1))))

        loop.call_soon(stall)
        await asyncio.sleep(0.5)
        assert one and await one[0].wait(0)
        assert not await two.wait(0.05)  # 2 still waits for 1
        one[0].dispatched()
        assert await two.wait(1)

    asyncio.run(main())
