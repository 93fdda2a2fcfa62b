"""AsyncClient: the one implementation of the client contract, on grpc.aio.

``Client`` (client.py) is a thin synchronous facade that runs this class's coroutines
on a background event loop (the LanceDB pattern), so the two can never drift: every
method here has a synchronous twin of the same name and arguments, and one conformance
suite (tests/integration/test_conformance.py) runs against both and ``ShardedClient``.

For producers running thousands of environments in one event loop: one channel per
client, safe to share across tasks. Calls of one kind (inserts, samples) reach the
server in the order they were made, so the server admits them in that order when they
must wait. Errors are ``grpc.aio.AioRpcError`` (a ``grpc.RpcError``) with the server's
status code and message.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence

import grpc
import numpy as np
import pyarrow as pa

from expstore_proto import arrow_ipc
from expstore_proto.v1 import expstore_pb2 as pb
from expstore_proto.service import ORDER_KEY, client_stub

from . import _codec, _flight, merge
from ._codec import InsertResult, PriorityUpdate, Reservation, TableInfo
from ._flight import FlightPath
from .batch import SampleBatch
from .batcher import InsertBatcher
from .merge import Group, InsertMerger, Member, settle

DEFAULT_TIMEOUT = 30.0
MESSAGE_BYTES = 8 << 20
MAX_MESSAGE_BYTES = 256 << 20
SLACK_S = 5.0  # seconds an RPC deadline exceeds the call's own timeout_s: the server answers first
FLIGHT_MIN_BYTES = 1 << 20  # inserts at least this large go over Flight (smaller ones: gRPC)


def make_credentials(tls: bool | str | bytes | Path | None) -> grpc.ChannelCredentials | None:
    """None/False: plaintext. True: TLS with system roots. bytes or a path: TLS trusting
    that PEM root certificate."""
    if not tls:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    root = tls if isinstance(tls, bytes) else Path(tls).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=root)


@dataclass
class QueryResult:
    """The record batches of one ``query``, as they arrive: ``schema``, then ``async for
    batch in result`` (or ``await result.read_all()``). Each batch points into its
    received message: no copy."""

    schema: pa.Schema
    _batches: AsyncIterator[pa.RecordBatch]

    def __aiter__(self) -> AsyncIterator[pa.RecordBatch]:
        return self._batches

    async def read_all(self) -> pa.Table:
        return pa.Table.from_batches([b async for b in self._batches], schema=self.schema)


class AsyncClient:
    """>>> async with AsyncClient("127.0.0.1:50051") as client:
    ...     await client.insert("rollouts", rows)
    ...     batch = await client.sample("rollouts", 256)
    """

    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, *,
                 tls: bool | str | bytes | Path | None = None, timeout: float = DEFAULT_TIMEOUT,
                 message_bytes: int = MESSAGE_BYTES, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 channel_options: Sequence[tuple[str, Any]] = (), flight: bool = True,
                 flight_min_bytes: int = FLIGHT_MIN_BYTES) -> None:
        """``channel_options``: extra gRPC channel arguments (e.g. reconnect backoff).
        ``flight``: send bulk data over the server's Arrow Flight service when it offers
        one (inserts of at least ``flight_min_bytes`` Arrow bytes, and every sample,
        stream read, get and query); False: gRPC only."""
        options = _codec.channel_options(max_message_bytes) + list(channel_options)
        creds = make_credentials(tls)
        self._tls_root = None if not tls or tls is True else (tls if isinstance(tls, bytes) else Path(tls).read_bytes())
        self._tls = bool(tls)
        self.flight, self.flight_min_bytes = flight, flight_min_bytes
        self._flight: FlightPath | None = None
        self._info: pb.ServerInfo | None = None  # what the server serves (``_server_info``)
        self._info_asked: asyncio.Future | None = None
        self._channel = grpc.aio.secure_channel(target, creds, options) if creds else \
            grpc.aio.insecure_channel(target, options)
        self._stub = client_stub(self._channel)
        self._metadata = _codec.metadata(token)
        self.target = target
        self.timeout = timeout
        self.message_bytes, self.max_message_bytes = message_bytes, max_message_bytes
        self._schemas: dict[str, pa.Schema] = {}
        self._inserts, self._samples = _InOrder(self._channel, self._metadata), _InOrder(self._channel, self._metadata)
        self._merger = InsertMerger(self._start_group)

    @property
    def flight_location(self) -> str | None:
        """The Arrow Flight service bulk calls use (``grpc+tcp://host:port``), or None:
        gRPC only, or no bulk call made yet."""
        path = self._flight
        return None if path is None or path.broken else path.location

    # -- tables -----------------------------------------------------------------------

    async def create_table(self, name: str, *, kind: str = "trajectory", schema: pa.Schema | None = None,
                           sampler: str | Mapping[str, Any] = "uniform",
                           rate_limiter: Mapping[str, Any] | None = None, if_not_exists: bool = False,
                           **config: Any) -> TableInfo:
        """Create a table. ``config`` takes the other TableConfig fields: remover,
        max_size, max_times_sampled, max_staleness, memory_bytes, key_column, dedup_window,
        tiers, ssd_bytes, durability, archive, vocab_size (token ids must be below it),
        metadata (string notes such as the console's ``tokenizer``), group_timeout_s and
        group_timeout_action, ingest_checks (a list), routed_experts (``{"layers": L,
        "top_k": k, "num_experts": E}``), pacing (``{"rollouts_per_version": B, "lease_s": s}``),
        hot_retention_s, hot_retention_bytes, retention_s, retention_bytes, share_prefixes (a
        trajectory table's chunks store each distinct prompt once); the sampler mapping may hold task_quotas
        (``{task: {"min": share, "max": share}}``). See docs/config.md."""
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
        """Coalesce inserts of many tasks into few RPCs (see ``InsertBatcher``; asyncio
        only: a thread-based producer batches its own rows)."""
        return InsertBatcher(self, table, linger_s=linger_s, max_rows=max_rows, timeout=timeout)

    # -- rows in ----------------------------------------------------------------------

    async def insert(self, table: str, data: Any, *, priorities: Sequence[float] | None = None,
                     timeout: float | None = None, durability: str | None = None,
                     compress: bool = False) -> InsertResult:
        """Insert rows (pa.Table, RecordBatch, list of dicts or dict of arrays), all or
        none. Waits up to ``timeout`` for the rate limiter. Retrying with the same
        traj_ids is safe: rows already stored are reported as duplicates. Inserts of one
        client reach the server in the order they were called, so the server admits them
        in that order when they must wait."""
        return await (await self._start_insert(table, data, priorities, timeout, durability, compress, self.flight))

    async def insert_future(self, table: str, data: Any, *, priorities: Sequence[float] | None = None,
                            timeout: float | None = None, durability: str | None = None,
                            compress: bool = False) -> "asyncio.Future[InsertResult]":
        """Start an insert and return once it is on its way, with a future of its
        result: with a few inserts in flight a producer encodes its next batch while the
        server validates this one (each insert is still all or none)."""
        return asyncio.ensure_future(
            await self._start_insert(table, data, priorities, timeout, durability, compress, self.flight))

    async def _start_insert(self, table: str, data: Any, priorities, timeout: float | None,
                            durability: str | None, compress: bool, flight: bool,
                            merge: bool = True) -> Awaitable[InsertResult]:
        """Start an insert once the calls made before it have started: its result to await
        (a coroutine over gRPC, so that ``insert`` makes no task of it: with thousands of
        inserts in flight, fewer live objects make each garbage collection cheaper; or
        the future of its share of a merged call, merge.py). Everything before the first
        ``await`` fixes the insert's place: among the client's calls (its turn) and in
        its table's line (``InsertMerger``)."""
        turn = self._inserts.take()
        async with turn:  # (entering it does not suspend) left: passes the turn on
            timeout = self.timeout if timeout is None else timeout
            rows = data if isinstance(data, pa.Table) else pa.Table.from_batches([data]) \
                if isinstance(data, pa.RecordBatch) else None
            small = merge and rows is not None and not compress and self._merger.mergeable(rows) and \
                not (flight and _at_least(rows, self.flight_min_bytes))
            if small:
                pr = _codec.insert_priorities(rows, priorities, durability)  # checks the arguments
                answer = self._merger.insert(table, rows, pr, durability, timeout)
                if answer is not None:  # merged: the group's call needs no turn
                    return answer
            place = self._merger.alone(table, small)
            try:
                arrow = rows if rows is not None else _codec.to_arrow(data, await self.schema(table))
                requests = _codec.insert_requests(table, arrow, priorities, timeout, durability, compress,
                                                  self.message_bytes)  # checks the arguments
                big = flight and not compress and _at_least(arrow, self.flight_min_bytes)
                path = await self._flight_path() if big else None
                info = await self._known_info()
                if place.previous is not None:  # the table's inserts made before this one start first
                    await asyncio.shield(place.previous)
                if path is not None:
                    await turn.start(None, timeout)
                    flight = _flight.insert_request(table, priorities, timeout, durability)
                    # A task starts at once and queues on the path's lock: the order of the calls.
                    call = asyncio.ensure_future(self._flight_insert(path, flight, arrow, table, data, priorities,
                                                                     timeout, durability))
                else:
                    only, messages = _codec.only_message(requests)  # one message: unary, fewer gRPC steps
                    send, request = self._insert_call(info, only, messages)
                    call = await turn.start(lambda metadata: send(request, timeout=self._deadline(timeout),
                                                                  metadata=metadata), timeout)
            except BaseException:
                self._merger.gone(place)
                raise
        self._merger.started(place)
        if small:  # the table's next small inserts gather behind it until it ends
            call.add_done_callback(lambda _: self._merger.ended(table))
        return call if path is not None else _insert_result(call)

    def _insert_call(self, info: pb.ServerInfo | None, only: bytes | None, messages: Iterator[bytes]) -> tuple:
        """The stub an insert's messages go by, and its request: a unary InsertUnary of
        one message where the server takes it, else a streaming Insert."""
        if only is None:
            return self._stub.Insert, messages
        if info is not None and info.insert_unary:
            return self._stub.InsertUnary, only
        return self._stub.Insert, iter((only,))  # a server older than InsertUnary

    async def _start_group(self, group: Group) -> None:
        """Put a group of merged inserts on the wire as one call (its place in the client's
        order is now: ``InsertMerger`` starts it once everything of its table before it
        has started) and answer each member. A server that does not take a call of
        several inserts (``InsertRequest.parts``) gets the members' calls one after another."""
        members = group.live()
        try:
            info = await self._known_info()
            now = asyncio.get_running_loop().time()
            left = [max(0.0, m.deadline - now) for m in members]  # of each caller's timeout
            await self._inserts.connected(max(left))
            if info is not None and info.insert_parts and len(members) > 1:
                priorities = None if all(m.priorities is None for m in members) else np.concatenate(
                    [np.ones(m.rows.num_rows) if m.priorities is None else m.priorities for m in members])
                calls = [(members, self._send_numbered(group, pa.concat_tables([m.rows for m in members]),
                                                       priorities, left, info, [m.rows.num_rows for m in members]))]
            else:
                calls = [([m], self._send_numbered(group, m.rows, m.priorities, [t], info))
                         for m, t in zip(members, left)]
        except BaseException as e:  # e.g. the client was closed meanwhile: each caller's error
            group.started.set_result(None)
            self._merger.ended(group.table)
            for m in members:
                settle(m.future, error=e)
            if not isinstance(e, Exception):
                raise
            return  # answered: nothing for asyncio to report as never retrieved
        group.started.set_result(None)
        try:
            for part, call in calls:
                await self._answer(part, call)
        finally:
            self._merger.ended(group.table)

    def _send_numbered(self, group: Group, rows: pa.Table, priorities: np.ndarray | None, timeouts: list[float],
                       info: pb.ServerInfo | None, parts: Sequence[int] = ()):
        """Start an insert call of a group's rows (``parts``: of several inserts, each with
        its own timeout; else one), numbered in the client's order now."""
        timeout = max(timeouts)
        requests = _codec.insert_requests(group.table, rows, priorities, timeout, group.durability, False,
                                          self.message_bytes, parts, timeouts if parts else ())
        send, request = self._insert_call(info, *_codec.only_message(requests))
        return self._inserts.start(lambda metadata: send(request, timeout=self._deadline(timeout), metadata=metadata))

    @staticmethod
    async def _answer(members: list[Member], call) -> None:
        """Answer each of ``members`` from their call: its own result or error."""
        try:
            response = await call
            answers = merge.answers(response, [m.rows.num_rows for m in members]) if len(members) > 1 \
                else [_codec.insert_result(response)]
        except Exception as e:  # noqa: BLE001 - the call's error is each member's
            answers = [e] * len(members)
        except BaseException:  # the client's loop is going away
            for m in members:
                m.future.cancel()
            raise
        for m, answer in zip(members, answers):
            if isinstance(answer, Exception):
                settle(m.future, error=answer)
            else:
                settle(m.future, answer)

    async def _flight_insert(self, path: FlightPath, request: pb.InsertRequest, arrow: pa.Table, table: str,
                             data: Any, priorities, timeout: float, durability: str | None) -> InsertResult:
        try:
            async with path.inserts:
                return await path.run(path.insert, request, arrow, self._deadline(timeout))
        except _flight.RetryOverGrpc:  # every Flight waiting place was taken: wait as a coroutine
            return await (await self._start_insert(table, arrow, priorities, timeout, durability, False, False))

    # -- rows out ---------------------------------------------------------------------

    async def sample(self, table: str, batch_size: int, *, timeout: float | None = None,
                     compress: bool = False, step: int | None = None,
                     data_versions: Mapping[str, tuple[int | None, int | None]] | None = None) -> SampleBatch:
        """Sample a batch. With ``step``, the server records the batch's manifest (item
        ids, policy versions) under that training step (``manifest(table, step)``).
        ``data_versions`` (``{task: (lo, hi)}``, ``"*"`` for the other tasks, None for an
        open bound; task mixing with a ``data_version`` column) samples only those versions.
        Samples of one client reach the server in the order they were called."""
        turn = self._samples.take()
        async with turn:
            timeout = self.timeout if timeout is None else timeout
            req = pb.SampleRequest(table=table, batch_size=batch_size, timeout_s=timeout, compress=compress, step=step,
                                   data_versions=_codec.version_ranges(data_versions))
            path = await self._flight_path()
            if path is not None:
                await turn.start(None, timeout)
                task = asyncio.ensure_future(self._flight_rows(path, pb.FlightTicket(sample=req), timeout, True,
                                                               in_order=True))
            else:
                call = await turn.start(lambda metadata: self._stream(self._stub.Sample, req, timeout, metadata),
                                        timeout)
        if path is not None:
            try:
                return await task
            except _flight.RetryOverGrpc:
                return await self._grpc_rows(self._stub.Sample, req, timeout, True)
        return _codec.rows([m async for m in call], with_weights=True)

    def sampler(self, table: str, batch_size: int, *, prefetch: int = 2, timeout: float | None = None,
                compress: bool = False) -> AsyncIterator[SampleBatch]:
        """Sample batches forever, keeping ``prefetch`` Sample calls in flight so that the
        server gathers the next batch while this one is used (Reverb's in-flight samples).
        Closing the iterator cancels the calls in flight; the server may already have
        counted them as sampled."""
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1")
        return _sampler(lambda: self.sample(table, batch_size, timeout=timeout, compress=compress), prefetch)

    def stream(self, table: str, group: str, batch_size: int, *, poll_timeout: float = 5.0,
               idle_timeout: float | None = None, visibility_timeout: float | None = None,
               start: str = "earliest", compress: bool = False, auto_ack: bool = False
               ) -> AsyncIterator[SampleBatch]:
        """Iterate a consumer group's batches in insertion order (at most ``batch_size``
        each). Ack each batch (``await batch.ack()``) once processed, or it is redelivered
        after the visibility timeout (``nack`` hands it back at once). Ends after
        ``idle_timeout`` seconds without rows (None: never).

        ``auto_ack``: asking for the next batch acks the last (Kafka's auto-commit): the
        ack rides on the call that fetches the next batch, one round trip a batch instead
        of two; the last batch is acked when the iteration ends or is closed. A consumer
        that dies holding a batch has it redelivered, as without."""
        poller = _codec.StreamPoller(table, group, batch_size, poll_timeout, idle_timeout,
                                     visibility_timeout, start, compress)
        return _stream(self, table, group, poller, auto_ack)

    async def poll_stream(self, request: pb.StreamRequest, wait: float) -> SampleBatch | None:
        """One Stream call waiting up to ``wait`` seconds: its batch, or None if the
        group stayed caught up (what ``stream`` and ``ShardedClient.stream`` repeat)."""
        try:
            return await self._rows(self._stub.Stream, pb.FlightTicket(stream=request), request, wait, False)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            return None

    async def ack(self, table: str, group: str, item_ids: Sequence[int] | np.ndarray) -> int:
        req = pb.AckRequest(table=table, group=group, item_ids=list(map(int, item_ids)))
        return (await self._call(self._stub.Ack, req)).num_acked

    async def nack(self, table: str, group: str, item_ids: Sequence[int] | np.ndarray) -> int:
        """Hand rows delivered to a consumer group back unprocessed: its next reads
        deliver them first, without waiting for their visibility timeout. Returns how
        many were in flight (an acked row stays acked)."""
        req = pb.NackRequest(table=table, group=group, item_ids=list(map(int, item_ids)))
        return (await self._call(self._stub.Nack, req)).num_released

    async def update_priorities(self, table: str, item_ids, priorities) -> PriorityUpdate:
        """Set the priorities of the live items among ``item_ids`` (the last entry wins
        for a repeated id). Ids of items that have left are ignored and returned in
        ``unknown_item_ids``: the rest are updated all the same."""
        req = pb.UpdatePrioritiesRequest(table=table, item_ids=list(map(int, item_ids)),
                                         priorities=list(map(float, priorities)))
        return _codec.priority_update(await self._call(self._stub.UpdatePriorities, req))

    async def set_policy_version(self, table: str, version: int) -> int:
        """Set the table's current policy version; returns how many stale items left."""
        req = pb.SetPolicyVersionRequest(table=table, version=version)
        return (await self._call(self._stub.SetPolicyVersion, req)).num_expired

    async def reserve(self, table: str, count: int = 1, *, timeout: float | None = None,
                      lease_s: float | None = None) -> Reservation:
        """Reserve admission for a rollout of ``count`` rows on a paced table (created
        with ``pacing``), before starting it: waits up to ``timeout`` while the trainer
        is too far behind (DEADLINE_EXCEEDED then, saying why). Put the reservation's
        ``id`` in every row's ``reservation_id``; ``release`` what will not be inserted.
        ``lease_s``: how long the reservation holds if no row comes (default: the
        table's ``pacing.lease_s``)."""
        timeout = self.timeout if timeout is None else timeout
        req = pb.ReserveRequest(table=table, count=count, timeout_s=timeout, lease_s=lease_s)
        return _codec.reservation(await self._call(self._stub.Reserve, req, timeout))

    async def release(self, table: str, reservation_id: int) -> int:
        """Give back a reservation's rows not inserted (an abandoned rollout); returns
        how many (0 when it was already settled, released or expired)."""
        req = pb.ReleaseRequest(table=table, reservation_id=int(reservation_id))
        return (await self._call(self._stub.Release, req)).num_released

    async def get(self, table: str, item_ids, *, compress: bool = False) -> SampleBatch:
        req = pb.GetRequest(table=table, item_ids=list(map(int, item_ids)), compress=compress)
        return await self._rows(self._stub.Get, pb.FlightTicket(get=req), req, None, False)

    async def stats(self, table: str | None = None) -> dict[str, dict[str, float]]:
        return _codec.stats(await self._call(self._stub.Stats, pb.StatsRequest(table=table or "")))

    async def query(self, sql: str, *, max_rows: int = 0, timeout: float | None = None) -> QueryResult:
        """Run one SELECT on the server (docs/cli.md, "query"): its record batches as they
        arrive, at most ``max_rows`` rows (0: all). The first message is awaited here (it
        carries the schema)."""
        request = pb.QueryRequest(sql=sql, max_rows=max_rows)
        path = await self._flight_path()
        if path is not None:
            try:
                reader = await path.run(path.query, pb.FlightTicket(query=request), self._deadline(timeout))
                return QueryResult(await path.run(lambda: reader.schema), _flight_batches(path, reader))
            except _flight.RetryOverGrpc:
                pass
        messages = self._stream(self._stub.Query, request, timeout).__aiter__()
        first = arrow_ipc.decode((await messages.__anext__())[1])

        async def batches() -> AsyncIterator[pa.RecordBatch]:
            for batch in first.to_batches():
                yield batch
            async for _, payload in messages:
                for batch in arrow_ipc.decode(payload).to_batches():
                    yield batch

        return QueryResult(first.schema, batches())

    async def query_table(self, sql: str, *, max_rows: int = 0, timeout: float | None = None) -> pa.Table:
        """The whole result of ``query`` as one table."""
        return await (await self.query(sql, max_rows=max_rows, timeout=timeout)).read_all()

    # -- training cuts and checkpoints ------------------------------------------------

    async def commit_cut(self, table: str, group: str, step: int, item_ids=(), *, tag: str = "") -> int:
        """Atomically ack what training step ``step`` consumed, remember the stream
        position under ``step`` and record the ids as the step's manifest (replacing an
        earlier commit of ``step``); returns the number acked. With no ids it creates a
        group that has not read yet (a trainer's step 0)."""
        req = pb.CommitCutRequest(table=table, group=group, step=step, item_ids=list(map(int, item_ids)), tag=tag)
        return (await self._call(self._stub.CommitCut, req)).num_acked

    async def resume(self, table: str, group: str, step: int) -> dict[str, int]:
        """Rewind ``group`` to its cut at ``step``: everything after it is delivered again,
        and the manifests of later steps are forgotten."""
        resp = await self._call(self._stub.Resume, pb.ResumeRequest(table=table, group=group, step=step))
        return {"position": resp.position, "inflight": resp.inflight}

    async def manifest(self, table: str, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(item ids, policy versions) that training step ``step`` sampled or committed."""
        resp = await self._call(self._stub.GetManifest, pb.GetManifestRequest(table=table, step=step))
        return np.array(resp.item_ids, dtype=np.uint64), np.array(resp.policy_versions, dtype=np.int64)

    async def checkpoint(self, name: str = "", *, timeout: float | None = None) -> dict[str, Any]:
        """Snapshot the whole server to its remote tier (inserts and samples go on)."""
        resp = await self._call(self._stub.Checkpoint, pb.CheckpointRequest(name=name), timeout or 3600.0)
        return {"name": resp.name, "uri": resp.uri, "num_bytes": resp.num_bytes, "seconds": resp.seconds}

    # -- lifecycle --------------------------------------------------------------------

    async def close(self) -> None:
        if self._flight is not None:
            self._flight.close()
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _flight_path(self) -> FlightPath | None:
        """The server's Flight service, or None: gRPC only."""
        if not self.flight:
            return None
        info = self._info if self._info is not None else await self._server_info()
        if self._flight is None and info.flight_port:
            scheme = "grpc+tls" if info.flight_tls else "grpc+tcp"
            host = _flight.flight_host(self.target)
            self._flight = FlightPath(f"{scheme}://{host}:{info.flight_port}", self._metadata, self._tls_root,
                                      self.message_bytes, self.max_message_bytes)
        path = self._flight
        return None if path is None or path.broken else path

    async def _known_info(self) -> pb.ServerInfo | None:
        """What the server serves, or None where asking failed: the insert's own call
        (a plain ``Insert``, which every server takes) then meets what is wrong."""
        if self._info is not None:
            return self._info
        try:
            return await self._server_info()
        except grpc.RpcError:
            return None

    async def _server_info(self) -> pb.ServerInfo:
        """What the server serves, asked for once (``GetServerInfo``): where its Flight
        service is, whether it takes ``InsertUnary``. Servers older than a field leave it
        unset: no Flight, every insert streamed. A failed ask fails the call that made
        it, and the next call asks again."""
        if self._info_asked is None:
            self._info_asked = asyncio.ensure_future(self._ask_info())
        await asyncio.shield(self._info_asked)
        return self._info

    async def _ask_info(self) -> None:
        try:
            self._info = await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest())
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                self._info_asked = None
                raise
            self._info = pb.ServerInfo()  # older than GetServerInfo itself

    async def _rows(self, method, ticket: pb.FlightTicket, request, timeout: float | None,
                    with_weights: bool) -> SampleBatch:
        path = await self._flight_path()
        if path is not None:
            try:
                return await self._flight_rows(path, ticket, timeout, with_weights)
            except _flight.RetryOverGrpc:
                pass
        return await self._grpc_rows(method, request, timeout, with_weights)

    async def _flight_rows(self, path: FlightPath, ticket: pb.FlightTicket, timeout: float | None,
                           with_weights: bool, in_order: bool = False) -> SampleBatch:
        return await path.fetch_rows(ticket, self._deadline(timeout), with_weights, in_order)

    async def _grpc_rows(self, method, request, timeout: float | None, with_weights: bool) -> SampleBatch:
        return _codec.rows([m async for m in self._stream(method, request, timeout)], with_weights=with_weights)

    def _deadline(self, timeout: float | None) -> float:
        # The RPC deadline leaves the server time to answer DEADLINE_EXCEEDED itself.
        return (timeout if timeout is not None else self.timeout) + SLACK_S

    async def _call(self, method, request, timeout: float | None = None):
        return await method(request, timeout=self._deadline(timeout), metadata=self._metadata)

    def _stream(self, method, request, timeout: float | None, metadata: tuple | None = None):
        """A server-streaming call; ``metadata``: the call's own (the client's by default)."""
        return method(request, timeout=self._deadline(timeout),
                      metadata=self._metadata if metadata is None else metadata)


async def _flight_batches(path: FlightPath, reader) -> AsyncIterator[pa.RecordBatch]:
    def next_batch() -> pa.RecordBatch | None:
        try:
            return reader.read_chunk().data
        except StopIteration:
            return None

    while (batch := await path.run(next_batch)) is not None:
        yield batch


async def _insert_result(call: Awaitable) -> InsertResult:
    return _codec.insert_result(await call)


async def _sampler(sample: Callable[[], Awaitable[SampleBatch]], prefetch: int) -> AsyncIterator[SampleBatch]:
    inflight: deque[asyncio.Task] = deque()
    try:
        while True:
            while len(inflight) < prefetch:
                inflight.append(asyncio.ensure_future(sample()))
            yield await inflight.popleft()
    finally:
        for task in inflight:
            task.cancel()


async def _stream(client: AsyncClient, table: str, group: str, poller: _codec.StreamPoller,
                  auto_ack: bool) -> AsyncIterator[SampleBatch]:
    unacked = np.zeros(0, np.uint64)  # auto_ack: the batch handed out last, acked by the next call
    try:
        while True:
            request, poll = poller.request(unacked)
            batch = await client.poll_stream(request, poll)
            unacked = unacked[:0]  # acked: a Stream call acks before its first attempt to read
            if batch is None:
                if poller.idle():
                    return
                continue
            poller.got_rows()
            if auto_ack:
                unacked = batch.ids
            yield batch.acked_by(lambda ids=batch.ids: client.ack(table, group, ids))
    except GeneratorExit:  # closed: the last batch is done with
        if len(unacked):
            await client.ack(table, group, unacked)
        raise


class _InOrder:
    """Starts a client's calls of one kind on the wire in the order they were made, and
    numbers them so that the server hands them to its engine in that order however grpc
    delivers them (metadata ``expstore-order``: ``ORIGIN:SEQ:LOW``, see the server's
    arrivals.py; LOW is the lowest number whose call has not ended here).

    Calls made while the channel connects are started in any order once it is up, so a
    call waits (up to its timeout) while the channel is idle or connecting, after the
    call made before it has started: the order holds through a reconnect. A channel that
    failed to connect is not waited for (the call fails fast, as it would have). The
    server then admits the calls in that order when they wait.
    """

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] | None) -> None:
        self._channel, self._metadata = channel, tuple(metadata or ())
        self._origin = secrets.token_hex(8)
        self._last: asyncio.Future | None = None
        self._next = 0  # the number of the next call started
        self._low = 0  # every call numbered below it has ended
        self._ended: set[int] = set()  # ended calls numbered above _low

    def take(self) -> "_Start":
        """A place in the order; call before the caller's first ``await``."""
        previous, self._last = self._last, asyncio.get_running_loop().create_future()
        return _Start(self, previous, self._last)

    async def connected(self, timeout: float) -> None:
        """Wait up to ``timeout`` while the channel is idle or connecting."""
        state = self._channel.get_state(try_to_connect=True)
        if state in (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING):
            deadline = time.monotonic() + timeout
            while state in (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING):
                try:
                    await asyncio.wait_for(self._channel.wait_for_state_change(state), deadline - time.monotonic())
                except TimeoutError:
                    break  # the call itself reports the timeout
                state = self._channel.get_state(try_to_connect=True)

    def start(self, make_call: Callable[[tuple], Any]):
        """Start a call now (``make_call(metadata)``), numbered next; its number ends with it."""
        seq, self._next = self._next, self._next + 1
        try:
            call = make_call(self._metadata + ((ORDER_KEY, f"{self._origin}:{seq}:{self._low}"),))
        except BaseException:
            self.ended(seq)
            raise
        call.add_done_callback(lambda _: self.ended(seq))
        return call

    def ended(self, seq: int) -> None:
        self._ended.add(seq)
        while self._low in self._ended:
            self._ended.remove(self._low)
            self._low += 1


class _Start:
    def __init__(self, order: _InOrder, previous: asyncio.Future | None, started: asyncio.Future) -> None:
        self._order, self._previous, self._started = order, previous, started

    async def start(self, make_call: Callable[[tuple], Any] | None, timeout: float):
        """Start the call (``make_call(metadata)``; None: a call that is not a gRPC call
        of this channel) once the previous one has started and the channel is up."""
        if self._previous is not None and not self._previous.done():
            await asyncio.shield(self._previous)  # not cancelled if this call is: __aexit__ waits on it
        await self._order.connected(timeout)
        return None if make_call is None else self._order.start(make_call)

    async def __aenter__(self) -> "_Start":
        return self

    async def __aexit__(self, *exc) -> None:
        """Pass the turn on: the call started, or failed or was cancelled before it did.
        One that never started passes it on only once the call before it has started, so
        that the call after it cannot overtake that one."""
        if self._previous is None or self._previous.done():
            self._pass_turn()
        else:
            self._previous.add_done_callback(self._pass_turn)

    def _pass_turn(self, _previous: asyncio.Future | None = None) -> None:
        if not self._started.done():
            self._started.set_result(None)


def _at_least(data: pa.Table, nbytes: int) -> bool:
    """``data.nbytes >= nbytes``, answered by the buffers' total size (~2 us) when that is
    smaller: ``nbytes`` costs ~3 us a column. (Buffers shared by columns count once in the
    total: such rows may go over gRPC, which splits them as any other.)"""
    return data.get_total_buffer_size() >= nbytes and data.nbytes >= nbytes
