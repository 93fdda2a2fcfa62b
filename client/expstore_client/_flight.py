"""The client's Arrow Flight path for bulk data (docs/rpc.md, "Arrow Flight").

AsyncClient asks the server once (``GetServerInfo``) where its Flight service is, and
then sends large inserts and every sample, stream read, get and query there: the rows
move as record batches in Arrow's C++ (pyarrow.flight), never as Python objects. The
calls are pyarrow's blocking ones, made on a thread pool of this module's; a client's
Flight inserts go one at a time in the order they were made, as do its samples (each
until the server has served it: its rows then come while the next is served), so the
server admits them in that order when they must wait (as over gRPC).

Errors come back as the same ``grpc.RpcError`` as over gRPC (``grpc.aio.AioRpcError``,
with the server's status code and message). Falls back to gRPC for one call when the
server says so (``RETRY_GRPC``: every Flight waiting place was taken), and for good when
the Flight port cannot be reached.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from expstore_proto.v1 import expstore_pb2 as pb

from ._codec import DURABILITY, InsertResult, insert_result
from .batch import SampleBatch

log = logging.getLogger("expstore.client")
T = TypeVar("T")
RETRY_GRPC = "RETRY_GRPC"

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(32, thread_name_prefix="expstore-flight")
        return _pool


class RetryOverGrpc(Exception):
    """The server asked for this call to be made over gRPC (or Flight is unreachable)."""


def flight_host(target: str) -> str:
    """The host of a gRPC target ("host:port", "dns:///host:port", "[::1]:port")."""
    address = target.split("///", 1)[-1] if "///" in target else target
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host


class FlightPath:
    """A client's Flight connection: DoPut for inserts, DoGet for rows out."""

    def __init__(self, location: str, metadata, tls_root: bytes | None, message_bytes: int,
                 max_message_bytes: int) -> None:
        self.location = location
        self._max_bytes = max_message_bytes
        self._client = fl.FlightClient(location, tls_root_certs=tls_root)
        self._headers = [(k.encode(), v.encode()) for k, v in (metadata or ())]
        self._message_bytes = message_bytes
        self.inserts, self._samples = asyncio.Lock(), asyncio.Lock()  # FIFO: one at a time, in order (module doc)
        self.broken = False

    def close(self) -> None:
        self._client.close()

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on a Flight thread, its Flight errors mapped to grpc.RpcError."""
        try:
            return await asyncio.get_running_loop().run_in_executor(_threads(), fn, *args)
        except fl.FlightError as e:
            raise self._error(e) from None

    def _options(self, timeout: float) -> fl.FlightCallOptions:
        return fl.FlightCallOptions(timeout=timeout, headers=self._headers)

    def insert(self, request: pb.InsertRequest, rows: pa.Table, deadline: float) -> InsertResult:
        descriptor = fl.FlightDescriptor.for_command(request.SerializeToString())
        writer, results = self._client.do_put(descriptor, rows.schema, self._options(deadline))
        try:
            writer.write_table(rows, max_chunksize=_rows_per_batch(rows, self._message_bytes))
            writer.done_writing()
            response = results.read()
        finally:
            writer.close()
        return insert_result(pb.InsertResponse.FromString(response.to_pybytes()))

    async def fetch_rows(self, ticket: pb.FlightTicket, deadline: float, with_weights: bool,
                         in_order: bool = False) -> SampleBatch:
        """Rows of a DoGet. ``in_order`` (a client's samples): the calls are served one at a
        time in the order they were made, each holding the line only until the server has
        served it (``start_rows``), so that the next is served while its rows are on the wire.
        Other calls make one hop to a Flight thread, not two."""
        if not in_order:
            return await self.run(lambda: self.read_rows(self.start_rows(ticket, deadline), with_weights))
        async with self._samples:
            reader = await self.run(self.start_rows, ticket, deadline)
        return await self.run(self.read_rows, reader, with_weights)

    def start_rows(self, ticket: pb.FlightTicket, deadline: float) -> fl.FlightStreamReader:
        """A DoGet of rows, once the server has served it: DoGet returns when the stream's
        schema arrives, which the server sends once it has chosen the rows (an error it
        answered is raised here). ``read_rows`` then reads them."""
        return self._client.do_get(fl.Ticket(ticket.SerializeToString()), self._options(deadline))

    def read_rows(self, reader: fl.FlightStreamReader, with_weights: bool) -> SampleBatch:
        batches, facts = [], pb.RowsResponse()
        for chunk in reader:
            if chunk.data.nbytes > self._max_bytes:  # the client's receive limit, as over gRPC
                reader.cancel()
                raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details=f"Received message larger than max ({chunk.data.nbytes} vs. "
                                                   f"{self._max_bytes})")
            batches.append(chunk.data)
            if chunk.app_metadata is not None:
                facts.MergeFromString(chunk.app_metadata.to_pybytes())  # repeated fields append
        data = pa.Table.from_batches(batches, schema=reader.schema)

        def col(name: str, dtype) -> np.ndarray:
            return np.asarray(getattr(facts, name), dtype=dtype)

        return SampleBatch(ids=col("item_ids", np.uint64), data=data, priorities=col("priorities", np.float64),
                           times_sampled=col("times_sampled", np.int64),
                           policy_versions=col("policy_versions", np.int64),
                           probabilities=col("probabilities", np.float64) if with_weights else None,
                           weights=col("weights", np.float64) if with_weights else None)

    def query(self, ticket: pb.FlightTicket, deadline: float) -> fl.FlightStreamReader:
        return self._client.do_get(fl.Ticket(ticket.SerializeToString()), self._options(deadline))

    def _error(self, e: fl.FlightError) -> Exception:
        detail, _, message = (getattr(e, "extra_info", None) or b"").decode("utf-8", "replace").partition("\n")
        if detail == RETRY_GRPC:
            return RetryOverGrpc(message)
        code = getattr(grpc.StatusCode, detail, None) if detail else None
        if code is None:  # not an answer of the server's: the Flight port is not reachable
            if isinstance(e, (fl.FlightUnavailableError, fl.FlightInternalError)):
                self.broken = True
                log.warning("expstore: the Flight service at %s is unreachable (%s); using gRPC", self.location, e)
                return RetryOverGrpc(str(e))
            code = _CODES.get(type(e), grpc.StatusCode.UNKNOWN)
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                    details=message if detail else _message(e))


_CODES = {fl.FlightUnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
          fl.FlightUnauthorizedError: grpc.StatusCode.PERMISSION_DENIED,
          fl.FlightTimedOutError: grpc.StatusCode.DEADLINE_EXCEEDED,
          fl.FlightUnavailableError: grpc.StatusCode.UNAVAILABLE,
          fl.FlightCancelledError: grpc.StatusCode.CANCELLED,
          fl.FlightInternalError: grpc.StatusCode.INTERNAL}


def _message(e: fl.FlightError) -> str:
    """The server's message: Flight appends ". Detail: <its status detail>"."""
    text = str(e)
    cut = text.find(". Detail: ")
    return text[:cut] if cut >= 0 else text


def _rows_per_batch(rows: pa.Table, message_bytes: int) -> int:
    per_row = max(1, rows.nbytes // max(1, rows.num_rows))
    return max(1, message_bytes // per_row)


def insert_request(table: str, priorities: Any, timeout: float, durability: str | None) -> pb.InsertRequest:
    request = pb.InsertRequest(table=table, timeout_s=timeout, durability=DURABILITY[durability])
    if priorities is not None:
        request.priorities.extend(np.asarray(priorities, dtype=np.float64).tolist())
    return request
