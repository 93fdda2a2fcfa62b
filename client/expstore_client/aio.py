"""AsyncClient: the same API as Client on grpc.aio, for producers that run thousands of
environments in one event loop. One channel per client; safe to share across tasks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Sequence

import grpc
import numpy as np
import pyarrow as pa

from expstore_proto.v1 import expstore_pb2 as pb
from expstore_proto.service import client_stub

from . import _codec
from ._codec import InsertResult, PriorityUpdate, TableInfo
from .batch import SampleBatch
from .batcher import InsertBatcher
from .client import DEFAULT_TIMEOUT, MAX_MESSAGE_BYTES, MESSAGE_BYTES, make_credentials


class AsyncClient:
    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, *,
                 tls: bool | str | bytes | Path | None = None, timeout: float = DEFAULT_TIMEOUT,
                 message_bytes: int = MESSAGE_BYTES, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        options = _codec.channel_options(max_message_bytes)
        creds = make_credentials(tls)
        self._channel = grpc.aio.secure_channel(target, creds, options) if creds else \
            grpc.aio.insecure_channel(target, options)
        self._stub = client_stub(self._channel)
        self._metadata = _codec.metadata(token)
        self.timeout = timeout
        self.message_bytes = message_bytes
        self._schemas: dict[str, pa.Schema] = {}
        self._inserts, self._samples = _InOrder(self._channel), _InOrder(self._channel)

    async def create_table(self, name: str, *, kind: str = "trajectory", schema: pa.Schema | None = None,
                           sampler: str | Mapping[str, Any] = "uniform",
                           rate_limiter: Mapping[str, Any] | None = None, if_not_exists: bool = False,
                           **config: Any) -> TableInfo:
        req = pb.CreateTableRequest(config=_codec.table_config(name, kind=kind, schema=schema, sampler=sampler,
                                                               rate_limiter=rate_limiter, **config),
                                    if_not_exists=if_not_exists)
        return _codec.table_info(await self._call(self._stub.CreateTable, req))

    async def drop_table(self, name: str) -> None:
        await self._call(self._stub.DropTable, pb.DropTableRequest(table=name))
        self._schemas.pop(name, None)

    async def list_tables(self) -> list[TableInfo]:
        resp = await self._call(self._stub.ListTables, pb.ListTablesRequest())
        return [_codec.table_info(t) for t in resp.tables]

    async def describe(self, name: str) -> TableInfo:
        info = _codec.table_info(await self._call(self._stub.DescribeTable, pb.DescribeTableRequest(table=name)))
        self._schemas[name] = info.schema
        return info

    async def schema(self, table: str) -> pa.Schema:
        """The table's stored schema (cached after the first call)."""
        return self._schemas.get(table) or (await self.describe(table)).schema

    def batcher(self, table: str, *, linger_s: float = 0.005, max_rows: int = 1024,
                timeout: float | None = None) -> InsertBatcher:
        """Coalesce inserts of many tasks into few RPCs (see ``InsertBatcher``)."""
        return InsertBatcher(self, table, linger_s=linger_s, max_rows=max_rows, timeout=timeout)

    async def insert(self, table: str, data: Any, *, priorities: Sequence[float] | None = None,
                     timeout: float | None = None, durability: str | None = None,
                     compress: bool = False) -> InsertResult:
        """Insert rows, all or none. Inserts of one client reach the server in the order
        they were called, so the server admits them in that order when they must wait."""
        turn = self._inserts.take()  # before any await: the order of the calls
        async with turn:
            schema = None if isinstance(data, (pa.Table, pa.RecordBatch)) else await self.schema(table)
            arrow = _codec.to_arrow(data, schema)
            timeout = self.timeout if timeout is None else timeout
            requests = _codec.insert_requests(table, arrow, priorities, timeout, durability, compress,
                                              self.message_bytes)
            call = await turn.start(lambda: self._stub.Insert(requests, timeout=self._deadline(timeout),
                                                              metadata=self._metadata), timeout)
        return _codec.insert_result(await call)

    async def sample(self, table: str, batch_size: int, *, timeout: float | None = None,
                     compress: bool = False, step: int | None = None,
                     data_versions: Mapping[str, tuple[int | None, int | None]] | None = None) -> SampleBatch:
        """One batch; samples of one client reach the server in the order they were called
        (``data_versions`` as in ``Client.sample``)."""
        turn = self._samples.take()
        async with turn:
            timeout = self.timeout if timeout is None else timeout
            req = pb.SampleRequest(table=table, batch_size=batch_size, timeout_s=timeout, compress=compress, step=step,
                                   data_versions=_codec.version_ranges(data_versions))
            call = await turn.start(lambda: self._stream(self._stub.Sample, req, timeout), timeout)
        return _codec.rows([m async for m in call], with_weights=True)

    async def stream(self, table: str, group: str, batch_size: int, *, poll_timeout: float = 5.0,
                     idle_timeout: float | None = None, visibility_timeout: float | None = None,
                     start: str = "earliest", compress: bool = False) -> AsyncIterator[SampleBatch]:
        poller = _codec.StreamPoller(table, group, batch_size, poll_timeout, idle_timeout,
                                     visibility_timeout, start, compress)
        while True:
            req, poll = poller.request()
            try:
                messages = [m async for m in self._stream(self._stub.Stream, req, poll)]
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                if poller.idle():
                    return
                continue
            poller.got_rows()
            batch = _codec.rows(messages, with_weights=False)
            batch._ack = lambda ids=batch.ids: self.ack(table, group, ids)
            yield batch

    async def ack(self, table: str, group: str, item_ids) -> int:
        req = pb.AckRequest(table=table, group=group, item_ids=list(map(int, item_ids)))
        return (await self._call(self._stub.Ack, req)).num_acked

    async def update_priorities(self, table: str, item_ids, priorities) -> PriorityUpdate:
        """As ``Client.update_priorities``: unknown ids are ignored and returned."""
        req = pb.UpdatePrioritiesRequest(table=table, item_ids=list(map(int, item_ids)),
                                         priorities=list(map(float, priorities)))
        return _codec.priority_update(await self._call(self._stub.UpdatePriorities, req))

    async def set_policy_version(self, table: str, version: int) -> int:
        req = pb.SetPolicyVersionRequest(table=table, version=version)
        return (await self._call(self._stub.SetPolicyVersion, req)).num_expired

    async def get(self, table: str, item_ids, *, compress: bool = False) -> SampleBatch:
        req = pb.GetRequest(table=table, item_ids=list(map(int, item_ids)), compress=compress)
        return _codec.rows([m async for m in self._stream(self._stub.Get, req, None)], with_weights=False)

    async def stats(self, table: str | None = None) -> dict[str, dict[str, float]]:
        return _codec.stats(await self._call(self._stub.Stats, pb.StatsRequest(table=table or "")))

    async def commit_cut(self, table: str, group: str, step: int, item_ids=(), *, tag: str = "") -> int:
        req = pb.CommitCutRequest(table=table, group=group, step=step, item_ids=list(map(int, item_ids)), tag=tag)
        return (await self._call(self._stub.CommitCut, req)).num_acked

    async def resume(self, table: str, group: str, step: int) -> dict[str, int]:
        resp = await self._call(self._stub.Resume, pb.ResumeRequest(table=table, group=group, step=step))
        return {"position": resp.position, "inflight": resp.inflight}

    async def manifest(self, table: str, step: int) -> tuple[np.ndarray, np.ndarray]:
        resp = await self._call(self._stub.GetManifest, pb.GetManifestRequest(table=table, step=step))
        return np.array(resp.item_ids, dtype=np.uint64), np.array(resp.policy_versions, dtype=np.int64)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> float:
        return (timeout if timeout is not None else self.timeout) + 5.0

    async def _call(self, method, request, timeout: float | None = None):
        return await method(request, timeout=self._deadline(timeout), metadata=self._metadata)

    def _stream(self, method, request, timeout: float | None):
        return method(request, timeout=self._deadline(timeout), metadata=self._metadata)


class _InOrder:
    """Starts a client's calls of one kind on the wire in the order they were made.

    Calls made while the channel connects are started in any order once it is up, so a
    call waits (up to its timeout) while the channel is idle or connecting, after the
    call made before it has started: the order holds through a reconnect. A channel that
    failed to connect is not waited for (the call fails fast, as it would have). The
    server then sees the calls in order, and admits them in that order when they wait.
    """

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self._last: asyncio.Future | None = None

    def take(self) -> "_Start":
        """A place in the order; call before the caller's first ``await``."""
        previous, self._last = self._last, asyncio.get_running_loop().create_future()
        return _Start(self._channel, previous, self._last)


class _Start:
    def __init__(self, channel: grpc.aio.Channel, previous: asyncio.Future | None,
                 started: asyncio.Future) -> None:
        self._channel, self._previous, self._started = channel, previous, started

    async def start(self, make_call, timeout: float):
        """Start the call once the previous one has started and the channel is up."""
        if self._previous is not None and not self._previous.done():
            await asyncio.shield(self._previous)  # not cancelled if this call is
        deadline = time.monotonic() + timeout
        state = self._channel.get_state(try_to_connect=True)
        while state in (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING):
            try:
                await asyncio.wait_for(self._channel.wait_for_state_change(state), deadline - time.monotonic())
            except TimeoutError:
                break  # the call itself reports the timeout
            state = self._channel.get_state(try_to_connect=True)
        return make_call()

    async def __aenter__(self) -> "_Start":
        return self

    async def __aexit__(self, *exc) -> None:
        if not self._started.done():  # started, failed before starting, or cancelled
            self._started.set_result(None)
