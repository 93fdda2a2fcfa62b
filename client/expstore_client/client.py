"""The synchronous client, used inside training loops: a thin facade over AsyncClient.

Every method runs the AsyncClient coroutine of the same name on the process's background
event loop (``_loop``) and waits for it, so ``Client`` and ``AsyncClient`` have one
implementation, the same methods, arguments and docstrings, and cannot drift (the
LanceDB pattern). Iterators (``sampler``, ``stream``, ``query``) pull their async
twins item by item. Thread-safe: one channel, shared by every thread.

Errors are ``grpc.RpcError`` with the server's status code and message (for example
DEADLINE_EXCEEDED when the rate limiter held a call back past ``timeout``).
"""

from __future__ import annotations

import concurrent.futures
import functools
from pathlib import Path
from typing import Any, Iterator, Sequence

import pyarrow as pa

from . import _loop
from ._codec import InsertResult
from .aio import (DEFAULT_TIMEOUT, FLIGHT_MIN_BYTES, MAX_MESSAGE_BYTES, MESSAGE_BYTES,  # noqa: F401
                  AsyncClient, make_credentials)
from .batch import SampleBatch


def _sync(name: str):
    """The synchronous twin of ``AsyncClient.<name>`` (same signature and docstring)."""
    method = getattr(AsyncClient, name)

    @functools.wraps(method)
    def call(self: "Client", *args, **kwargs):
        return self._loop.run(method(self._core, *args, **kwargs))
    return call


class Client:
    """>>> client = Client("127.0.0.1:50051")
    >>> client.create_table("rollouts", sampler={"type": "prioritized", "alpha": 0.6})
    >>> client.insert("rollouts", [{"traj_id": "a", ...}])
    >>> batch = client.sample("rollouts", 256)
    """

    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, *,
                 tls: bool | str | bytes | Path | None = None, timeout: float = DEFAULT_TIMEOUT,
                 message_bytes: int = MESSAGE_BYTES, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 channel_options: Sequence[tuple[str, Any]] = (), flight: bool = True,
                 flight_min_bytes: int = FLIGHT_MIN_BYTES) -> None:
        """As ``AsyncClient``'s (``flight=False``: gRPC only)."""
        self._loop = _loop.shared()
        self._core: AsyncClient = self._loop.run(_make_core(
            target, token, tls=tls, timeout=timeout, message_bytes=message_bytes,
            max_message_bytes=max_message_bytes, channel_options=channel_options, flight=flight,
            flight_min_bytes=flight_min_bytes))

    @property
    def timeout(self) -> float:
        return self._core.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._core.timeout = value

    @property
    def message_bytes(self) -> int:
        return self._core.message_bytes

    @property
    def target(self) -> str:
        return self._core.target

    @property
    def flight_location(self) -> str | None:
        """As ``AsyncClient.flight_location``."""
        return self._core.flight_location

    create_table = _sync("create_table")
    drop_table = _sync("drop_table")
    list_tables = _sync("list_tables")
    describe = _sync("describe")
    schema = _sync("schema")
    insert = _sync("insert")
    sample = _sync("sample")
    poll_stream = _sync("poll_stream")
    ack = _sync("ack")
    nack = _sync("nack")
    update_priorities = _sync("update_priorities")
    set_policy_version = _sync("set_policy_version")
    reserve = _sync("reserve")
    release = _sync("release")
    get = _sync("get")
    stats = _sync("stats")
    query_table = _sync("query_table")
    commit_cut = _sync("commit_cut")
    resume = _sync("resume")
    manifest = _sync("manifest")
    checkpoint = _sync("checkpoint")

    @functools.wraps(AsyncClient.insert_future)
    def insert_future(self, table: str, data: Any, **options: Any) -> "InsertFuture":
        started = self._loop.run(self._core.insert_future(table, data, **options))
        return InsertFuture(self._loop.submit(_loop.wait(started)))

    @functools.wraps(AsyncClient.sampler)
    def sampler(self, table: str, batch_size: int, **options: Any) -> Iterator[SampleBatch]:
        return self._loop.iterate(self._core.sampler(table, batch_size, **options))

    @functools.wraps(AsyncClient.stream)
    def stream(self, table: str, group: str, batch_size: int, **options: Any) -> Iterator[SampleBatch]:
        for batch in self._loop.iterate(self._core.stream(table, group, batch_size, **options)):
            yield batch.acked_by(lambda ack=batch.ack: self._loop.run(ack()))  # ``batch.ack()`` waits here

    @functools.wraps(AsyncClient.query)
    def query(self, sql: str, **options: Any) -> pa.RecordBatchReader:
        result = self._loop.run(self._core.query(sql, **options))
        return pa.RecordBatchReader.from_batches(result.schema, self._loop.iterate(result.__aiter__()))

    def close(self) -> None:
        self._loop.run(self._core.close())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _make_core(*args, **kwargs) -> AsyncClient:
    return AsyncClient(*args, **kwargs)  # on the loop: its channel belongs to it


class InsertFuture:
    """An insert in flight (``Client.insert_future``)."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> InsertResult:
        """The InsertResult; raises the call's grpc.RpcError if it failed."""
        return self._future.result(timeout)
