"""Calls that outlive a server restart: retried while the server answers UNAVAILABLE.

A restarting server refuses connections for a few seconds; a producer or trainer that
should ride through it retries the call after 0.1 s, doubling to at most 1 s between
tries, up to a deadline, then raises the last error. Any other status is raised at once: only UNAVAILABLE means "not yet".
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import grpc

T = TypeVar("T")
FIRST_DELAY_S, MAX_DELAY_S = 0.1, 1.0


def retry_unavailable(call: Callable[[], T], seconds: float,
                      on_retry: Callable[[grpc.RpcError], None] | None = None) -> T:
    """``call()``, again while it raises UNAVAILABLE, for up to ``seconds``; ``on_retry``
    hears each error that is retried (to log it)."""
    deadline, delay = time.monotonic() + seconds, FIRST_DELAY_S
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                raise
            if on_retry is not None:
                on_retry(e)
            time.sleep(delay)
            delay = min(2 * delay, MAX_DELAY_S)
