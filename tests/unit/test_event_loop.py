"""The server's event loop: uvloop by default, the standard library's on request
(``event_loop``, docs/config.md)."""

from __future__ import annotations

import asyncio

import pytest

from expstore.errors import InvalidArgument
from expstore_server.config import ServerConfig
from expstore_server.main import run_event_loop


@pytest.mark.parametrize("event_loop, module", [("uvloop", "uvloop"), ("asyncio", "asyncio")])
def test_the_server_coroutine_runs_on_the_loop_asked_for(event_loop, module):
    ran_on = []

    async def serve():
        ran_on.append(type(asyncio.get_running_loop()).__module__)

    run_event_loop(serve(), event_loop)
    assert len(ran_on) == 1 and ran_on[0].split(".")[0] == module, ran_on


def test_event_loop_is_checked_and_uvloop_by_default():
    assert ServerConfig().event_loop == "uvloop"
    with pytest.raises(InvalidArgument, match="event_loop must be one of"):
        ServerConfig(event_loop="tornado")
