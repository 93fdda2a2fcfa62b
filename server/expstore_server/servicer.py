"""The ExperienceStore servicer: translate the wire, call the engine, map the status.

Concurrency model: the servicer runs on the grpc.aio event loop. Engine calls run on a
small thread pool (Arrow and numpy release the GIL, so decoding, gathering and encoding
overlap with network I/O) and never block there: a call that may wait is a series of
attempts (``Table.try_insert``, ``try_sample``, ``try_stream``) and the coroutine waits
for the table's change notifications in between (expstore/admission.py), so
a thousand producers held back by the rate limiter cost a thousand coroutines, not a
thousand threads, and can never starve the trainer's calls of workers. SQL queries run
on threads of their own (``queries.QueryRunner``), never on the engine's. Blocked inserts
and samples keep their place in the table's line across attempts (expstore/turns.py),
and the calls of one connection reach it in the order they started (arrivals.py).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
import numpy as np
import pyarrow as pa

from expstore import query
from expstore.admission import Admission, Wait
from expstore.errors import DeadlineExceeded, ExpstoreError, FailedPrecondition, InvalidArgument, Unavailable
from expstore_proto import arrow_ipc
from expstore_proto.service import Malformed
from expstore_proto.v1 import expstore_pb2 as pb
from expstore.catalog import Catalog
from expstore.table import InsertResult, PreparedInsert, Rows, Table
from expstore.turns import Turn

from . import convert, frames
from .arrivals import Arrival, Arrivals, order_of
from .security_log import SecurityLog
from .auth import ANY_ROLE, Authenticator
from .clip import MESSAGE_CHARS, clip
from .coalesce import InsertCoalescer, Pending
from .config import ServerConfig
from .errors import status_of
from .metrics import ServerMetrics, wire_size
from .queries import QueryRunner

log = logging.getLogger("expstore.server")
_DURABILITY = {pb.DURABILITY_UNSPECIFIED: None, pb.DURABILITY_MEMORY: "memory",
               pb.DURABILITY_WAL: "wal", pb.DURABILITY_FSYNC: "fsync"}


@dataclass
class Call:
    """What the audit log, error messages and metrics need to know about one RPC."""

    method: str
    who: str = "anonymous"
    table: str | None = None
    detail: str | None = None
    status: grpc.StatusCode = grpc.StatusCode.OK
    started: float = field(default_factory=time.perf_counter)
    bytes_in: int = 0
    bytes_out: int = 0
    audited: bool = False


def rpc(role: str, *, audit: bool | Callable[[Any], bool] = False, method: str | None = None):
    """Wrap a handler: authenticate, run, map engine errors to statuses, audit, and
    record the call's metrics as it ends, before its status goes out (a client that
    went away mid-stream counts as CANCELLED). ``audit``: whether calls are audited, or
    which (a function of the request: a Stream that acks). ``method``: the name the
    audit log and the metrics give the call (default: the handler's).

    Works for unary-response handlers (coroutines) and server-streaming ones (async
    generators, whose messages go out as they are made: a large Query result never sits
    whole in memory; audited once, at the first message). Unexpected exceptions become
    INTERNAL without leaking internals.
    """

    def decorate(handler):
        name = method or handler.__name__

        async def guard(self: "Servicer", call: Call, context, body, *, first: bool = True):
            status, message = grpc.StatusCode.OK, ""
            try:
                if first:
                    principal = self.auth.identify(context.invocation_metadata())
                    call.who = principal.name
                    self.auth.authorize(principal, role)
                return await body()
            except ExpstoreError as e:
                status, message = status_of(e), clip(str(e), MESSAGE_CHARS)  # may echo a huge name
            except asyncio.CancelledError:
                status = grpc.StatusCode.CANCELLED
                raise
            except Exception:  # a bug: log it, do not leak it
                log.exception("internal error", extra={"method": name, "table": call.table and clip(call.table)})
                status, message = grpc.StatusCode.INTERNAL, f"internal error in {name}; see server log"
            finally:  # queued before the status goes out
                call.status = status
                if call.audited and first and self.audit is not None:
                    self.audit.record(who=call.who, method=name, table=call.table,
                                      outcome=status.name, detail=call.detail)
                if status != grpc.StatusCode.OK:  # the call ends here
                    self.metrics.record(call)
            await context.abort(status, message)

        if inspect.isasyncgenfunction(handler):
            @functools.wraps(handler)
            async def streaming(self, request, context):
                call = Call(name, table=_table_of(request), bytes_in=wire_size(request),
                            audited=_audited(audit, request))
                messages = None

                async def start():
                    nonlocal messages
                    _check_parsed(request, name)
                    messages = handler(self, request, context, call)
                    return await _next(messages)

                message = await guard(self, call, context, start)
                while message is not _END:
                    call.bytes_out += len(message)
                    try:
                        yield message
                    except GeneratorExit:  # the client went away mid-stream
                        call.status = grpc.StatusCode.CANCELLED
                        self.metrics.record(call)
                        raise
                    message = await guard(self, call, context, lambda: _next(messages), first=False)
                self.metrics.record(call)
            return streaming

        @functools.wraps(handler)
        async def unary(self, request, context):
            call = Call(name, table=_table_of(request), bytes_in=wire_size(request),
                        audited=_audited(audit, request))

            async def body():
                _check_parsed(request, name)
                return await handler(self, request, context, call)

            response = await guard(self, call, context, body)
            call.bytes_out = wire_size(response)
            self.metrics.record(call)
            return response
        return unary

    return decorate


_END = object()


async def _next(messages):
    """The next message of an async generator, or _END (StopAsyncIteration would be an
    error to the guard)."""
    try:
        return await messages.__anext__()
    except StopAsyncIteration:
        return _END


def _audited(audit: bool | Callable[[Any], bool], request) -> bool:
    """Whether a call is audited: ``rpc``'s ``audit``, of the request where it is a
    function (a request that did not parse did nothing such a function looks for)."""
    if callable(audit):
        return not isinstance(request, Malformed) and audit(request)
    return audit


def acks(request: pb.StreamRequest) -> bool:
    """Whether a Stream request acks (it is then audited, as Ack is)."""
    return len(request.ack_item_ids) > 0


def stream_reads(table: Table, request: pb.StreamRequest, default_visibility_s: float,
                 call: Call) -> Callable[[], Rows | Wait]:
    """The attempts of a Stream request (each on an engine thread; gRPC's and Flight's).
    The first acks the request's ``ack_item_ids`` as Ack would (a consumer acks its
    previous batch with the call that fetches the next: one round trip a batch, not two;
    an id never delivered to the group is NOT_FOUND and nothing is read). Each then tries
    to read the group's next rows."""
    visibility = request.visibility_timeout_s or default_visibility_s
    start = request.start or "earliest"
    unacked = [convert.ids_of(request.ack_item_ids)] if acks(request) else []

    def read() -> Rows | Wait:
        if unacked:
            acked, _ = table.ack(request.group, unacked.pop())
            call.detail = f"group={request.group} acked={acked}"
        return table.try_stream(request.group, request.batch_size, visibility, start)
    return read


def _table_of(request) -> str | None:
    """The table a unary or server-streaming request names (CreateTable: in its config)."""
    config = getattr(request, "config", None)
    return config.name if config is not None else getattr(request, "table", None)


MAX_INSERT_PARTS = 4096  # inserts one call may carry (InsertRequest.parts; a client merges at most 4,096 rows)


def _parts_response(answers: list, sizes: list[int]) -> pb.InsertResponse:
    """The answer of a call of several inserts: each one's counts or its own error (its
    rows then under id 0); an error that is not the insert's own (a bug) is the call's."""
    response = pb.InsertResponse()
    for answer, n in zip(answers, sizes):
        if isinstance(answer, InsertResult):
            response.item_ids.extend(answer.item_ids.tolist())
            response.parts.add(num_inserted=answer.num_inserted, num_duplicates=answer.num_duplicates,
                               num_stale=answer.num_stale)
            response.num_inserted += answer.num_inserted
            response.num_duplicates += answer.num_duplicates
            response.num_stale += answer.num_stale
        elif isinstance(answer, ExpstoreError):
            response.item_ids.extend([0] * n)
            response.parts.add(code=status_of(answer).value[0], message=clip(str(answer), MESSAGE_CHARS))
        else:
            raise answer
    return response


async def _one(request):
    """A request stream of one message."""
    yield request


def _check_parsed(request, method: str) -> None:
    if isinstance(request, Malformed):
        raise InvalidArgument(f"{method}: the request is not a valid protobuf message ({request.error})")


class _ChangeSignal:
    """Wakes coroutines waiting on a table when the table changes (any thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.event = asyncio.Event()

    def notify(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._fire)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _fire(self) -> None:
        self.event.set()
        self.event = asyncio.Event()


class Servicer:
    def __init__(self, store: Catalog, config: ServerConfig, auth: Authenticator,
                 audit: SecurityLog | None, checkpoints=None, metrics: ServerMetrics | None = None) -> None:
        self.store = store
        self.metrics = metrics if metrics is not None else ServerMetrics(store)
        self.checkpoints = checkpoints
        self.config = config
        self.auth = auth
        self.audit = audit
        self.draining = False
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="engine")
        self.queries = QueryRunner(config.query_workers, config.query_queue, config.query_limits)
        self._signals: weakref.WeakKeyDictionary[Table, _ChangeSignal] = weakref.WeakKeyDictionary()
        self._arrivals = Arrivals()
        self._inserts = InsertCoalescer(self._run)  # concurrent Insert calls, committed together
        self.flight_port, self.flight_tls = 0, False  # set by main once the Flight service listens

    # -- tables -----------------------------------------------------------------------

    @rpc("admin", audit=True)
    async def CreateTable(self, request, context, call):
        spec = convert.spec_from_proto(request.config)
        table = self.store.create_table(spec, if_not_exists=request.if_not_exists)
        return convert.table_info(table)

    @rpc("admin", audit=True)
    async def DropTable(self, request, context, call):
        await asyncio.to_thread(self.store.drop_table, request.table)  # remote I/O, a compaction
        return pb.DropTableResponse()

    @rpc("reader")
    async def ListTables(self, request, context, call):
        return pb.ListTablesResponse(tables=[convert.table_info(t) for t in self.store.tables()])

    @rpc(ANY_ROLE)  # clients need the schema to convert Python rows before inserting
    async def DescribeTable(self, request, context, call):
        return convert.table_info(self.store.table(request.table))

    # -- rows in ----------------------------------------------------------------------

    @rpc("producer", audit=True)
    async def Insert(self, request_iterator, context, call):
        origin, arrival = self._arrival("insert", context)  # before any await: the call's start
        with arrival:
            return await self._insert(request_iterator, call, origin, arrival, context)

    @rpc("producer", audit=True, method="Insert")
    async def InsertUnary(self, request, context, call):
        """Insert of one message, unary: gRPC moves it in fewer steps than a stream of one
        (docs/rpc.md); everything else, its audit and metrics included, is Insert's."""
        origin, arrival = self._arrival("insert", context)
        with arrival:
            return await self._insert(_one(request), call, origin, arrival, context)

    async def _insert(self, request_iterator, call, origin, arrival, context):
        first, parts, priorities, nbytes = None, [], [], 0
        async for item in request_iterator:
            _check_parsed(item, "Insert")
            req, payload = item
            call.bytes_in += req.ByteSize() + len(payload)
            if first is None:
                first = req
                call.table = req.table
                table = self.store.table(req.table)
                durability = _DURABILITY.get(req.durability)
                if req.durability not in _DURABILITY:
                    raise InvalidArgument(f"table {req.table!r}: unknown durability {req.durability}")
            elif req.table and req.table != first.table:
                raise InvalidArgument(f"insert message {len(parts)} names table {req.table!r}, "
                                      f"the first named {first.table!r}; one call inserts into one table")
            # Inline: framing and IPC decoding are zero-copy and cheap, not worth a thread hop.
            data, size = convert.decode_rows(payload, table=first.table, message=len(parts),
                                             row_offset=sum(p.num_rows for p in parts),
                                             max_bytes=self.config.max_message_bytes)
            if req.priorities and len(req.priorities) != data.num_rows:
                raise InvalidArgument(f"table {first.table!r}: insert message {len(parts)} has "
                                      f"{len(req.priorities)} priorities for {data.num_rows} rows")
            parts.append(data)
            nbytes += size
            priorities.append(np.asarray(req.priorities, dtype=np.float64) if req.priorities
                              else np.ones(data.num_rows))
        if first is None:
            raise InvalidArgument("an insert call must send at least one message")
        priorities = np.concatenate(priorities)
        remaining = context.time_remaining()
        wait_s = None if remaining is None else max(0.0, remaining - 0.05)
        if not first.parts:
            pending = Pending(parts, priorities, durability, nbytes,
                              self._alone(table, parts, priorities, durability, origin, first.timeout_s, context))
            result = await self._inserts.insert(table, pending, arrival, wait_s)
            call.detail = f"rows={len(priorities)} inserted={result.num_inserted} duplicates={result.num_duplicates}"
            return convert.insert_response(result)
        sizes = list(first.parts)
        if len(sizes) > MAX_INSERT_PARTS:
            raise InvalidArgument(f"table {first.table!r}: a call carries at most {MAX_INSERT_PARTS} inserts "
                                  f"(parts), not {len(sizes)}")
        if min(sizes) < 1 or sum(sizes) != len(priorities):
            raise InvalidArgument(f"table {first.table!r}: the call's parts {clip(str(sizes), MESSAGE_CHARS)} "
                                  f"do not split its {len(priorities)} rows into inserts of at least one row")
        timeouts = list(first.part_timeouts_s) or [first.timeout_s] * len(sizes)
        if len(timeouts) != len(sizes):
            raise InvalidArgument(f"table {first.table!r}: {len(timeouts)} part timeouts for {len(sizes)} parts")
        rows = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        bounds = np.cumsum([0] + sizes).tolist()
        inserts = []
        for lo, hi, timeout_s in zip(bounds[:-1], bounds[1:], timeouts):
            own, pr = [rows.slice(lo, hi - lo)], priorities[lo:hi]
            inserts.append(Pending(own, pr, durability, nbytes * (hi - lo) // len(priorities),
                                   self._alone(table, own, pr, durability, origin, timeout_s, context)))
        answers = await self._inserts.insert_many(table, inserts, arrival, wait_s)
        response = _parts_response(answers, sizes)
        call.detail = (f"rows={len(priorities)} inserted={response.num_inserted} "
                       f"duplicates={response.num_duplicates} inserts={len(sizes)} "
                       f"refused={sum(1 for a in answers if not isinstance(a, InsertResult))}")
        return response

    def _alone(self, table: Table, parts: list[pa.Table], priorities: np.ndarray, durability: str | None,
               origin: str, timeout_s: float, context
               ) -> Callable[[PreparedInsert | None, Arrival, Callable[[], None]], Awaitable[InsertResult]]:
        """How an insert is committed by itself (coalesce.py's ``Pending.alone``)."""

        async def alone(prep: PreparedInsert | None, order: Arrival, tried: Callable[[], None]) -> InsertResult:
            """Validation and SSD writes first, then the commit attempts, the first handed
            over in ``order``."""
            if prep is None:
                prep = await self._run(table.prepare_insert, parts, priorities, durability)
            turn = table.turn("insert", origin)
            loop = asyncio.get_running_loop()

            def attempt():
                try:
                    return table.try_insert(prep, turn)
                finally:
                    loop.call_soon_threadsafe(tried)

            try:
                return await self._admit(table, "insert", attempt, timeout_s, context, arrival=order, turn=turn)
            except BaseException:
                await self._run(table.abandon_insert, prep)
                raise
        return alone

    def _arrival(self, kind: str, context) -> tuple[str, Arrival]:
        """The call's origin (the client's line of calls, else its connection) and its
        place among the origin's calls of ``kind`` (arrivals.py)."""
        order = order_of(context.invocation_metadata())
        return (context.peer() if order is None else order[0]), self._arrivals.start(kind, context.peer(), order)

    # -- rows out ---------------------------------------------------------------------

    @rpc("trainer")
    async def Sample(self, request, context, call):
        origin, arrival = self._arrival("sample", context)  # before any await: the call's start
        with arrival:
            table = self.store.table(request.table)
            turn = table.turn("sample", origin)
            step = request.step if request.HasField("step") else None
            versions = convert.version_ranges(request.data_versions)

            def attempt():
                rows = table.try_sample(request.batch_size, turn, step, versions)
                return rows if isinstance(rows, Wait) else self._messages(rows, request.compress)

            messages = await self._admit(table, "sample", attempt, request.timeout_s, context,
                                         arrival=arrival, turn=turn)
        for msg in messages:
            yield msg

    @rpc("trainer", audit=acks)
    async def Stream(self, request, context, call):
        table = self.store.table(request.table)
        read = stream_reads(table, request, self.config.visibility_timeout_s, call)

        def attempt():
            rows = read()
            return rows if isinstance(rows, Wait) else self._messages(rows, request.compress)

        for msg in await self._admit(table, "stream", attempt, request.timeout_s, context):
            yield msg

    @rpc("trainer", audit=True)
    async def Ack(self, request, context, call):
        table = self.store.table(request.table)
        acked, already = await self._run(table.ack, request.group, convert.ids_of(request.item_ids))
        call.detail = f"group={request.group} acked={acked}"
        return pb.AckResponse(num_acked=acked, num_already_acked=already)

    @rpc("trainer", audit=True)
    async def Nack(self, request, context, call):
        table = self.store.table(request.table)
        released = await self._run(table.nack, request.group, convert.ids_of(request.item_ids))
        call.detail = f"group={request.group} released={released}"
        return pb.NackResponse(num_released=released)

    @rpc("trainer", audit=True)
    async def UpdatePriorities(self, request, context, call):
        table = self.store.table(request.table)
        if len(request.item_ids) != len(request.priorities):
            raise InvalidArgument(f"table {request.table!r}: {len(request.item_ids)} ids but "
                                  f"{len(request.priorities)} priorities")
        done = await self._run(table.update_priorities, convert.ids_of(request.item_ids),
                               np.asarray(request.priorities, dtype=np.float64))
        call.detail = f"updated={done.num_updated} unknown={len(done.unknown_item_ids)}"
        return pb.UpdatePrioritiesResponse(num_updated=done.num_updated,
                                           unknown_item_ids=done.unknown_item_ids.tolist())

    @rpc("trainer", audit=True)
    async def SetPolicyVersion(self, request, context, call):
        table = self.store.table(request.table)
        expired = await self._run(table.set_policy_version, request.version)
        call.detail = f"version={request.version} expired={expired}"
        return pb.SetPolicyVersionResponse(version=table.policy_version, num_expired=expired)

    @rpc("producer", audit=True)
    async def Reserve(self, request, context, call):
        table = self.store.table(request.table)
        turn = table.turn("reserve", context.peer())
        lease_s = request.lease_s if request.HasField("lease_s") else None
        r = await self._admit(table, "reserve", lambda: table.try_reserve(request.count, turn, lease_s),
                              request.timeout_s, context, turn=turn)
        call.detail = f"reservation={r.id} count={r.count}"
        return pb.ReserveResponse(reservation_id=r.id, count=r.count, lease_deadline=r.deadline,
                                  policy_version=r.policy_version)

    @rpc("producer", audit=True)
    async def Release(self, request, context, call):
        table = self.store.table(request.table)
        released = await self._run(table.release, request.reservation_id)
        call.detail = f"reservation={request.reservation_id} released={released}"
        return pb.ReleaseResponse(num_released=released)

    @rpc("reader")
    async def Get(self, request, context, call):
        table = self.store.table(request.table)
        ids = convert.ids_of(request.item_ids)
        for msg in await self._run(lambda: self._messages(table.get(ids), request.compress)):
            yield msg

    @rpc("reader")
    async def Stats(self, request, context, call):
        tables = [self.store.table(request.table)] if request.table else self.store.tables()
        stats = await self._run(lambda: [(t.name, t.stats()) for t in tables])
        if not request.table:  # tables that failed to restore: Describe says why
            stats += [(name, {"unopened": 1.0}) for name in sorted(self.store.unopened)]
        return pb.StatsResponse(tables=[pb.TableStats(table=name, values=values) for name, values in stats])

    @rpc("reader")
    async def Query(self, request, context, call):
        """On the query threads (``queries.QueryRunner``), never the engine's; a client
        that goes away interrupts its query (the ``finally``, on cancellation too)."""

        def encode(data) -> bytes:
            return frames.rows_message(pb.RowsResponse(), data)

        def next_messages() -> list[bytes] | None:  # one result batch
            batch = q.next_batch()
            if batch is None:
                return None
            return [encode(part) for part in arrow_ipc.split_rows(batch, self.config.message_bytes)]

        with self.queries.admit():
            q = query.Query(self.queries.limits)
            try:
                await self.queries.run(lambda: q.start(query.store_sources(self.store), request.sql,
                                                       max_rows=request.max_rows))
                sent = False
                while (messages := await self.queries.run(next_messages)) is not None:
                    for msg in messages:
                        sent = True
                        yield msg
                if not sent:  # an empty result still tells the client its schema
                    yield await self.queries.run(encode, q.schema.empty_table())
            finally:
                q.close()

    # -- training cuts and checkpoints ------------------------------------------------

    @rpc("trainer", audit=True)
    async def CommitCut(self, request, context, call):
        table = self.store.table(request.table)
        acked = await self._run(table.commit_cut, request.group, request.step,
                                convert.ids_of(request.item_ids), request.tag)
        call.detail = f"group={request.group} step={request.step} acked={acked}"
        return pb.CommitCutResponse(num_acked=acked)

    @rpc("trainer", audit=True)
    async def Resume(self, request, context, call):
        table = self.store.table(request.table)
        where = await self._run(table.resume, request.group, request.step)
        call.detail = f"group={request.group} step={request.step}"
        return pb.ResumeResponse(**where)

    @rpc("reader")
    async def GetManifest(self, request, context, call):
        table = self.store.table(request.table)
        ids, versions = await self._run(table.manifest, request.step)
        return pb.GetManifestResponse(item_ids=ids.tolist(), policy_versions=versions.tolist())

    @rpc("admin", audit=True)
    async def Checkpoint(self, request, context, call):
        if self.checkpoints is None:
            raise FailedPrecondition("this server has no remote tier to checkpoint to")
        # Its own thread: an upload of many GB must not hold an engine worker.
        info = await asyncio.to_thread(self.checkpoints.create, request.name or None)
        call.detail = f"name={info.name} bytes={info.num_bytes}"
        return pb.CheckpointResponse(name=info.name, uri=info.uri, num_bytes=info.num_bytes,
                                     seconds=info.seconds)

    @rpc(ANY_ROLE)
    async def GetServerInfo(self, request, context, call):
        return pb.ServerInfo(flight_port=self.flight_port, flight_tls=self.flight_tls, insert_unary=True,
                             insert_parts=True)

    # -- plumbing ---------------------------------------------------------------------

    async def drain(self) -> None:
        """Stop waiting: blocked calls end with UNAVAILABLE; running ones finish."""
        self.draining = True
        for signal in list(self._signals.values()):
            signal.notify()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.queries.close()

    async def _run(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _messages(self, rows, compress: bool) -> list[bytes]:
        """Framed response messages (run on an engine thread, with the call that made rows)."""
        return convert.rows_to_messages(rows, compress=compress, message_bytes=self.config.message_bytes)

    async def _admit(self, table: Table, op: str, attempt: Callable, timeout_s: float, context, *,
                     arrival: Arrival | None = None, turn: Turn | None = None) -> Any:
        """Run a call's attempts (each on an engine thread; each returns its result or a
        ``Wait``) until one completes it, waiting on the event loop for the table's
        changes in between (admission.py), for up to ``timeout_s`` (bounded by the
        client's own deadline).

        Inserts and samples keep one ``turn`` in the table's line across attempts (blocked
        calls are admitted first come, first served). A call hands its first attempt to
        an engine thread only after the earlier calls of its connection have handed
        theirs (``arrival``), and registers it with the table (``expect``), which tells an
        attempt that overtakes an earlier one of its connection to wait for it. A turn
        that cannot be admitted yet costs no thread hop; it leaves the line when the
        call ends, however it ends (on an engine thread: after an attempt still running
        there, and off the loop)."""
        loop = asyncio.get_running_loop()
        signal = self._signals.get(table)
        if signal is None:
            signal = self._signals[table] = _ChangeSignal(loop)
            table.subscribe(signal.notify)
        remaining_rpc = context.time_remaining()
        rpc_left = None if remaining_rpc is None else max(0.0, remaining_rpc - 0.05)
        # Bounded by the RPC's deadline, not timeout_s: a call with timeout_s = 0 still
        # lets the calls its client started before it go first.
        if arrival is not None and not await arrival.wait(rpc_left):
            raise DeadlineExceeded(f"table {table.name!r}: an earlier {op} of this connection was still "
                                   f"being received or validated at the call's deadline")
        if turn is not None:
            table.expect(turn)  # handed to a thread now, in the connection's order
        limit = max(0.0, timeout_s)
        remaining_rpc = context.time_remaining()
        if remaining_rpc is not None:
            limit = min(limit, max(0.0, remaining_rpc - 0.05))
        wait = Wait(f"earlier {op}s are waiting (first come, first served)", -1)
        with Admission(table, op, limit, turn, leave=lambda t: self._leave(table, t)) as admission:
            while True:
                event = signal.event  # taken before the attempt: a change during it still wakes us
                if turn is None or turn.may_try():
                    future = loop.run_in_executor(self._pool, attempt)
                    if arrival is not None:
                        arrival.dispatched()  # the connection's next call may follow
                    outcome = await future
                    if not isinstance(outcome, Wait):
                        return outcome
                    wait = outcome
                if self.draining:
                    raise Unavailable("server is draining; retry on another server or after restart")
                limit = admission.limit(wait)  # DeadlineExceeded (a TimeoutError) at the deadline
                try:
                    await asyncio.wait_for(event.wait(), limit)
                except TimeoutError:
                    pass

    def _leave(self, table: Table, turn: Turn) -> None:
        try:  # on an engine thread: after an attempt still running there, and off the loop
            self._pool.submit(table.leave, turn)
        except RuntimeError:  # the pool is shut down: nothing runs there any more
            table.leave(turn)
