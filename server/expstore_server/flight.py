"""Arrow Flight for bulk data: the rows of Insert, Sample, Stream, Get and Query move as
record batches in Arrow's C++, never as Python objects (docs/rpc.md, "Arrow Flight").

The Flight service is a second listener of the same server (``flight_port``), with the
same semantics, roles, bearer tokens, TLS certificate, audit log, metrics and status
codes as the gRPC service; the client finds it with ``GetServerInfo`` and uses it for
bulk calls (large inserts, samples, streams, gets, queries):

- DoPut: the descriptor's command is an ``InsertRequest`` without ``arrow_ipc``; the
  record batches are the rows; the one ``PutResult`` is the ``InsertResponse``.
- DoGet: the ticket is a ``FlightTicket`` (a Sample, Stream, Get or Query request); each
  record batch carries its rows' ``RowsResponse`` facts (item ids, priorities, weights...)
  as ``app_metadata`` (none for Query).

Concurrency: Flight's handlers run on the threads of its own C++ gRPC server, not on the
asyncio loop; engine calls run on the handler's thread (Arrow releases the GIL while it
moves bytes). A call that must wait (the rate limiter, the sampler, a caught-up stream)
waits on the table's Condition (admission.py) and so holds its thread: at most
``flight_waiters`` calls wait at once. One more that would wait ends at once with
UNAVAILABLE and the detail ``RETRY_GRPC``; the client then makes the same call over gRPC,
where a waiting call is a coroutine (an insert's rows are sent again). So thousands of
held-back producers never hold thousands of Flight threads; and small inserts, the
calls of such producers, go over gRPC anyway (the client sends only inserts of at least
``flight_min_bytes`` over Flight).

Errors: pyarrow.flight carries UNAUTHENTICATED, PERMISSION_DENIED, DEADLINE_EXCEEDED,
UNAVAILABLE, CANCELLED and INTERNAL as gRPC status codes of their own (its other
exception classes attach a Python traceback to the status, which would leak internals);
every other status goes out as UNKNOWN. Every error carries, in ``grpc-status-details-bin``
(Flight's ``extra_info``), its gRPC status code's name, a newline and its message; the
client raises the same ``grpc.RpcError`` (code and details) as over gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from expstore import query
from expstore.admission import Admission, Wait
from expstore.errors import DeadlineExceeded, ExpstoreError, InvalidArgument, ResourceExhausted, Unavailable
from expstore_proto.v1 import expstore_pb2 as pb
from expstore.table import Rows, Table

from .auth import Authenticator, Principal
from .clip import MESSAGE_CHARS, clip
from . import convert
from .convert import RESPONSE_FRAMING, ids_of
from .errors import status_of
from .servicer import Call, acks, stream_reads  # the gRPC service's record of a call, its Stream reads

log = logging.getLogger("expstore.server")

RETRY_GRPC = "RETRY_GRPC"  # extra_info of a call that would have waited with no waiting place left
WAIT_SLICE_S = 0.25  # a waiting handler checks for a draining server this often
_FLIGHT_ERRORS = {
    grpc.StatusCode.UNAUTHENTICATED: fl.FlightUnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: fl.FlightUnauthorizedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: fl.FlightTimedOutError,
    grpc.StatusCode.UNAVAILABLE: fl.FlightUnavailableError,
    grpc.StatusCode.CANCELLED: fl.FlightCancelledError,
    grpc.StatusCode.INTERNAL: fl.FlightInternalError,
}
_DURABILITY = {pb.DURABILITY_UNSPECIFIED: None, pb.DURABILITY_MEMORY: "memory",
               pb.DURABILITY_WAL: "wal", pb.DURABILITY_FSYNC: "fsync"}


def flight_error(status: grpc.StatusCode, message: str, detail: str | None = None) -> fl.FlightError:
    """The Flight exception that carries ``status`` and ``message`` (module docstring)."""
    cls = _FLIGHT_ERRORS.get(status, fl.FlightServerError)
    return cls(message, extra_info=f"{detail or status.name}\n{message}".encode())


class _Auth(fl.ServerMiddleware):
    def __init__(self, principal: Principal | None, error: ExpstoreError | None) -> None:
        self.principal, self.error = principal, error


class _AuthFactory(fl.ServerMiddlewareFactory):
    """Identifies every call's bearer token (``authorization`` header), as the gRPC
    service does; the handler checks the role (and reports a bad token: raising here
    would end the call before the audit log sees it)."""

    def __init__(self, auth: Authenticator) -> None:
        self._auth = auth

    def start_call(self, info, headers):
        metadata = [(k, v) for k, values in headers.items() for v in values]
        try:
            return _Auth(self._auth.identify(metadata), None)
        except ExpstoreError as e:
            return _Auth(None, e)


class FlightService(fl.FlightServerBase):
    """DoPut and DoGet over a ``Servicer``'s store, auth, audit log and metrics."""

    def __init__(self, location: str, servicer, *, tls_certificates=None, waiters: int = 32) -> None:
        super().__init__(location, tls_certificates=tls_certificates,
                         middleware={"auth": _AuthFactory(servicer.auth)})
        self._servicer = servicer
        self._waiting = threading.BoundedSemaphore(waiters)
        self.draining = False

    # -- Flight methods ---------------------------------------------------------------

    def do_put(self, context, descriptor, reader, writer):
        request = _parse(pb.InsertRequest, descriptor.command, "Insert")
        response = self._guard(context, "Insert", "producer", request.table, True,
                               lambda call: self._insert(request, reader, call, context))
        writer.write(pa.py_buffer(response.SerializeToString()))

    def do_get(self, context, ticket):
        t = _parse(pb.FlightTicket, ticket.ticket, "DoGet")
        kind = t.WhichOneof("request")
        if kind is None:
            raise flight_error(grpc.StatusCode.INVALID_ARGUMENT, "DoGet: the ticket names no request")
        request = getattr(t, kind)
        if kind == "query":
            return self._query(context, request)
        method, role = {"sample": ("Sample", "trainer"), "stream": ("Stream", "trainer"),
                        "get": ("Get", "reader")}[kind]
        audited = kind == "stream" and acks(request)  # as Ack is
        rows = self._guard(context, method, role, request.table, audited,
                           lambda call: getattr(self, "_" + kind)(request, call, context))
        return _rows_stream(rows, request.compress, self._servicer.config.message_bytes)

    def list_actions(self, context):
        return []

    # -- calls ------------------------------------------------------------------------

    def _insert(self, request: pb.InsertRequest, reader, call, context) -> pb.InsertResponse:
        table = self._servicer.store.table(request.table)
        if request.durability not in _DURABILITY:
            raise InvalidArgument(f"table {request.table!r}: unknown durability {request.durability}")
        batches, received = [], 0
        max_bytes = self._servicer.config.max_message_bytes
        for chunk in reader:  # each record batch as it arrives, so a huge upload is refused early
            batch = chunk.data
            received += batch.nbytes
            if batch.nbytes > max_bytes:  # RESOURCE_EXHAUSTED, as gRPC answers a message over its limit
                raise ResourceExhausted(f"table {request.table!r}: insert batch {len(batches)} takes {batch.nbytes} "
                                      f"bytes, more than max_message_bytes ({max_bytes}); send smaller batches")
            batches.append(batch)
        call.bytes_in = received
        rows = pa.Table.from_batches(batches) if batches else None
        if rows is None or rows.num_rows == 0:
            raise InvalidArgument(f"table {request.table!r}: insert of no rows")
        _check_rows(rows, request.table, max_bytes)
        priorities = np.asarray(request.priorities, dtype=np.float64) if request.priorities else None
        if priorities is not None and len(priorities) != rows.num_rows:
            raise InvalidArgument(f"table {request.table!r}: {len(priorities)} priorities for {rows.num_rows} rows")
        prep = table.prepare_insert(rows, priorities, _DURABILITY[request.durability])
        try:
            result = self._admit(table, "insert", lambda turn: table.try_insert(prep, turn),
                                 request.timeout_s, context, turn=table.turn("insert"))
        except BaseException:
            table.abandon_insert(prep)
            raise
        call.detail = f"rows={prep.num_rows} inserted={result.num_inserted} duplicates={result.num_duplicates}"
        return convert.insert_response(result)

    def _sample(self, request: pb.SampleRequest, call, context) -> Rows:
        table = self._servicer.store.table(request.table)
        step = request.step if request.HasField("step") else None
        versions = convert.version_ranges(request.data_versions)
        return self._admit(table, "sample", lambda turn: table.try_sample(request.batch_size, turn, step, versions),
                           request.timeout_s, context, turn=table.turn("sample"))

    def _stream(self, request: pb.StreamRequest, call, context) -> Rows:
        table = self._servicer.store.table(request.table)
        read = stream_reads(table, request, self._servicer.config.visibility_timeout_s, call)
        return self._admit(table, "stream", lambda turn: read(), request.timeout_s, context)

    def _get(self, request: pb.GetRequest, call, context) -> Rows:
        return self._servicer.store.table(request.table).get(ids_of(request.item_ids))

    def _query(self, context, request: pb.QueryRequest):
        """A query's batches as DuckDB makes them, on this thread (within the server's
        query admission and limits, as over gRPC); the client going away closes it."""
        runner = self._servicer.queries

        def start(call):
            admitted = runner.admit()
            admitted.__enter__()
            q = query.Query(runner.limits)
            try:
                q.start(query.store_sources(self._servicer.store), request.sql, max_rows=request.max_rows)
            except BaseException:
                q.close()
                admitted.__exit__(None, None, None)
                raise
            return q, admitted

        q, admitted = self._guard(context, "Query", "reader", None, False, start)

        def batches() -> Iterator[pa.RecordBatch]:
            try:
                sent = False
                while (batch := q.next_batch()) is not None:
                    sent = True
                    yield from pa.Table.from_batches([batch]).to_batches()
                if not sent:
                    yield from q.schema.empty_table().to_batches() or [pa.RecordBatch.from_pylist([], q.schema)]
            finally:
                q.close()
                admitted.__exit__(None, None, None)

        return fl.GeneratorStream(q.schema, batches())

    # -- plumbing ---------------------------------------------------------------------

    def _admit(self, table: Table, op: str, attempt: Callable, timeout_s: float, context, *,
               turn=None) -> Any:
        """Attempts until one completes the call, waiting on the table's Condition in
        between, for up to ``timeout_s``; a wait needs one of the ``flight_waiters``
        places (module docstring)."""
        limit = max(0.0, timeout_s)
        with Admission(table, op, limit, turn) as admission:
            outcome = attempt(turn)
            if not isinstance(outcome, Wait):
                return outcome
            admission.limit(outcome)  # DeadlineExceeded now for a call that may not wait
            if not self._waiting.acquire(blocking=False):
                raise _RetryOverGrpc(f"table {table.name!r}: {op} must wait and every Flight waiting place "
                                     f"is taken (flight_waiters); retry over gRPC")
            try:
                while True:
                    if self.draining:
                        raise Unavailable("server is draining; retry on another server or after restart")
                    if context.is_cancelled():
                        raise DeadlineExceeded(f"table {table.name!r}: the client went away")
                    limit = admission.limit(outcome)
                    table.wait_for_change(outcome.epoch, WAIT_SLICE_S if limit is None else min(limit, WAIT_SLICE_S))
                    outcome = attempt(turn)
                    if not isinstance(outcome, Wait):
                        return outcome
            finally:
                self._waiting.release()

    def _guard(self, context, method: str, role: str, table: str | None, audit: bool, body: Callable) -> Any:
        """As the gRPC service's ``rpc`` decorator: authenticate, run, map errors, audit,
        record metrics."""
        servicer = self._servicer
        call = Call(method, table=table or None)
        status, message, detail = grpc.StatusCode.OK, "", None
        try:
            auth = context.get_middleware("auth")
            if auth.error is not None:
                raise auth.error
            call.who = auth.principal.name
            servicer.auth.authorize(auth.principal, role)
            return body(call)
        except _RetryOverGrpc as e:
            status, message, detail = grpc.StatusCode.UNAVAILABLE, str(e), RETRY_GRPC
        except ExpstoreError as e:
            status, message = status_of(e), clip(str(e), MESSAGE_CHARS)
        except fl.FlightError:
            status = grpc.StatusCode.CANCELLED
            raise
        except Exception:  # a bug: log it, do not leak it
            log.exception("internal error", extra={"method": method, "table": table and clip(table)})
            status, message = grpc.StatusCode.INTERNAL, f"internal error in {method}; see server log"
        finally:
            call.status = status
            if audit and servicer.audit is not None:
                servicer.audit.record(who=call.who, method=method, table=call.table, outcome=status.name,
                                      detail=call.detail)
            servicer.metrics.record(call)
        raise flight_error(status, message, detail)

    def drain(self) -> None:
        """Stop waiting: waiting calls end with UNAVAILABLE; running ones finish."""
        self.draining = True


class _RetryOverGrpc(Exception):
    """A call that must wait while every Flight waiting place is taken."""


def _parse(message_type, data: bytes, what: str):
    try:
        return message_type.FromString(data)
    except Exception as e:  # DecodeError: any malformed input
        raise flight_error(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{what}: not a valid {message_type.__name__} ({type(e).__name__})") from None


def _check_rows(rows: pa.Table, table: str, max_bytes: int) -> None:
    """The checks of an untrusted upload that the gRPC path makes on its IPC streams."""
    try:
        rows.validate(full=True)
    except (pa.ArrowException, ValueError) as e:
        raise InvalidArgument(f"table {table!r}: insert rows are not valid Arrow data: {e}") from None
    limit = max_bytes - RESPONSE_FRAMING
    if rows.nbytes > limit:
        from expstore_proto import ipc_size

        sizes = ipc_size.row_bytes(rows)
        over = np.flatnonzero(sizes > limit)
        if len(over):
            r = int(over[0])
            raise InvalidArgument(f"table {table!r}: row {r} takes {int(sizes[r])} bytes, more than one response "
                                  f"message can carry back ({limit}); split the trajectory or raise max_message_bytes")


def _rows_stream(rows: Rows, compress: bool, message_bytes: int) -> fl.FlightDataStream:
    """Rows as record batches of about ``message_bytes``, each with its facts as app_metadata."""
    from expstore_proto import arrow_ipc

    def batches():
        start = 0
        for part in arrow_ipc.split_rows(rows.data, message_bytes):
            end = start + part.num_rows
            meta = convert.rows_facts(rows, start, end)
            for batch in (part.to_batches() if isinstance(part, pa.Table) else [part]) or \
                    [pa.RecordBatch.from_pylist([], rows.data.schema)]:
                yield batch, pa.py_buffer(meta.SerializeToString())
                meta = pb.RowsResponse()  # the facts go with the first batch of the part
            start = end

    options = pa.ipc.IpcWriteOptions(compression="zstd") if compress else None
    return fl.GeneratorStream(rows.data.schema, batches(), options=options)
