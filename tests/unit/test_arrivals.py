"""The server's arrival order: a connection's calls are handed to the engine in the
order they started, whatever order their uploads and validations finish in."""

from __future__ import annotations

import asyncio

from expstore_server.arrivals import Arrivals


def test_a_connections_calls_go_in_the_order_they_started():
    async def main():
        arrivals = Arrivals()
        first, second, third = (arrivals.start("peer-a", "insert") for _ in range(3))
        other = arrivals.start("peer-b", "insert")
        sample = arrivals.start("peer-a", "sample")
        assert await first.wait(0) and await other.wait(0) and await sample.wait(0)  # nobody before them
        assert not await second.wait(0.01) and not await third.wait(0.01)
        second.dispatched()  # ended before its turn (say, bad rows): it passes on only in order
        assert not await third.wait(0.01)
        first.dispatched()
        assert await third.wait(1) and await second.wait(0)
        third.dispatched()
        later = arrivals.start("peer-a", "insert")
        assert await later.wait(0)  # everything before it has gone

    asyncio.run(main())


def test_a_call_waiting_for_an_earlier_one_is_not_cancelled_with_it():
    async def main():
        arrivals = Arrivals()
        first, second = arrivals.start("p", "insert"), arrivals.start("p", "insert")
        waiter = asyncio.create_task(second.wait(None))
        await asyncio.sleep(0.01)
        waiter.cancel()  # the second call is cancelled while it waits...
        await asyncio.gather(waiter, return_exceptions=True)
        with second:  # ...and ends
            pass
        third = arrivals.start("p", "insert")
        assert not await third.wait(0.01)  # the first still has not gone
        first.dispatched()
        assert await third.wait(1)

    asyncio.run(main())
