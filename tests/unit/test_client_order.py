"""A client's calls start on the wire in the order they were made (``aio._InOrder``), and a
call cancelled while it waits for its turn neither blocks nor reorders the calls around it."""

import asyncio

import grpc
import pytest

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
