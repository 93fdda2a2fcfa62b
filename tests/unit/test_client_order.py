"""A client's calls start on the wire in the order they were made (``aio._InOrder``), and a
call cancelled while it waits for its turn neither blocks nor reorders the calls around it."""

import asyncio

import grpc
import pytest

from expstore_client._flight import FlightPath
from expstore_client.aio import _InOrder
from expstore_proto.service import ORDER_KEY


class ReadyChannel:
    """The one thing ``_InOrder`` asks of its channel: its state."""

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return grpc.ChannelConnectivity.READY


class StartedCall:
    """What a started gRPC call offers ``_InOrder``: a callback for its end."""

    def __init__(self) -> None:
        self.on_done = []

    def add_done_callback(self, fn) -> None:
        self.on_done.append(fn)

    def end(self) -> None:
        for fn in self.on_done:
            fn(self)


def test_a_call_cancelled_in_line_lets_the_others_start_in_order():
    async def scenario():
        order = _InOrder(ReadyChannel(), (("authorization", "Bearer t"),))
        started: list[tuple[str, tuple]] = []
        encoded = asyncio.Event()  # the first call is still encoding its rows

        async def call(name: str, slow: bool = False) -> StartedCall:
            turn = order.take()
            async with turn:
                if slow:
                    await encoded.wait()
                return await turn.start(lambda metadata: started.append((name, metadata)) or StartedCall(), 5)

        first = asyncio.create_task(call("a", slow=True))
        cancelled, last = asyncio.create_task(call("b")), asyncio.create_task(call("c"))
        await asyncio.sleep(0.01)
        assert started == []  # b and c wait behind a
        cancelled.cancel()
        await asyncio.sleep(0.01)
        assert started == []  # c still waits for a
        encoded.set()
        a = await asyncio.wait_for(first, 5)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await asyncio.wait_for(last, 5)
        assert [name for name, _ in started] == ["a", "c"]
        (_, meta_a), (_, meta_c) = started
        assert meta_a[0] == ("authorization", "Bearer t")
        origin, seq, low = dict(meta_a)[ORDER_KEY].split(":")
        assert (seq, low) == ("0", "0")
        assert dict(meta_c)[ORDER_KEY] == f"{origin}:1:0"  # a has not ended: the lowest open is 0
        a.end()
        await call("d")
        assert dict(started[-1][1])[ORDER_KEY] == f"{origin}:2:1"

    asyncio.run(scenario())


class ScriptedPath(FlightPath):
    """A Flight path whose DoGets are scripted: the server serves a call when the test says
    (``served[ticket]``), and its rows arrive when the test says (``arrived``)."""

    def __init__(self, tickets: list[str]) -> None:
        super().__init__("grpc://127.0.0.1:1", None, None, 1 << 20, 1 << 20)  # connects at a call: never
        self.served = {t: asyncio.Event() for t in tickets}
        self.arrived = asyncio.Event()
        self.events: list[tuple[str, str]] = []

    async def run(self, fn, *args):
        return await fn(*args)

    async def start_rows(self, ticket, deadline):
        self.events.append(("asked", ticket))
        await self.served[ticket].wait()
        return ticket

    async def read_rows(self, reader, with_weights):
        await self.arrived.wait()
        self.events.append(("read", reader))
        return reader


async def _until(done) -> None:
    while not done():
        await asyncio.sleep(0.001)


def test_a_clients_flight_samples_are_served_in_order_and_the_next_while_rows_are_read():
    async def scenario():
        path = ScriptedPath(["a", "b"])
        first = asyncio.create_task(path.fetch_rows("a", 5, True, in_order=True))
        second = asyncio.create_task(path.fetch_rows("b", 5, True, in_order=True))
        await asyncio.sleep(0.01)
        assert path.events == [("asked", "a")]  # b waits until the server has served a
        path.served["a"].set()
        path.served["b"].set()
        await asyncio.wait_for(_until(lambda: len(path.events) == 2), 5)
        assert path.events == [("asked", "a"), ("asked", "b")]  # ... not until a's rows are read
        path.arrived.set()
        assert await asyncio.wait_for(first, 5) == "a" and await asyncio.wait_for(second, 5) == "b"
        path.close()

    asyncio.run(scenario())
