"""Request building and response parsing shared by Client and AsyncClient (no I/O)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from expstore_proto import arrow_ipc
from expstore_proto import framing
from expstore_proto.messages import message_to_dict
from expstore_proto.service import INSERT_PAYLOAD
from expstore_proto.v1 import expstore_pb2 as pb

from .batch import SampleBatch
from .tensors import cell_shape, tensor_list

DURABILITY = {None: pb.DURABILITY_UNSPECIFIED, "memory": pb.DURABILITY_MEMORY,
              "wal": pb.DURABILITY_WAL, "fsync": pb.DURABILITY_FSYNC}


@dataclass(frozen=True)
class InsertResult:
    item_ids: np.ndarray
    num_inserted: int
    num_duplicates: int
    num_stale: int  # acknowledged, but already older than the table's staleness bound


@dataclass(frozen=True)
class PriorityUpdate:
    """What ``update_priorities`` did: the live items it updated, and the ids it ignored
    because they name no live item (removed since they were sampled, or never stored),
    once each, in the order given."""

    num_updated: int
    unknown_item_ids: np.ndarray  # uint64


@dataclass(frozen=True)
class Reservation:
    """Admission to start a rollout of ``count`` rows on a paced table (``reserve``):
    put ``id`` in the rows' ``reservation_id`` column; rows not inserted by
    ``lease_deadline`` (Unix seconds) go back to the pace."""

    id: int
    count: int
    lease_deadline: float
    policy_version: int


@dataclass(frozen=True)
class TableInfo:
    name: str
    config: dict[str, Any]
    schema: pa.Schema
    num_items: int
    policy_version: int


def table_config(name: str, *, kind: str = "trajectory", schema: pa.Schema | None = None,
                 sampler: str | Mapping[str, Any] = "uniform", rate_limiter: Mapping[str, Any] | None = None,
                 **fields: Any) -> pb.TableConfig:
    """Build a TableConfig; ``fields`` are the scalar TableConfig fields (max_size, ...)."""
    sampler = {"type": sampler} if isinstance(sampler, str) else dict(sampler)
    config = pb.TableConfig(name=name, kind=kind, sampler=pb.SamplerConfig(**sampler),
                            **{k: v for k, v in fields.items() if v is not None})
    if rate_limiter is not None:
        config.rate_limiter.CopyFrom(pb.RateLimiterConfig(**rate_limiter))
    if schema is not None:
        config.schema = arrow_ipc.encode_schema(schema)
    return config


def version_ranges(data_versions: Mapping[str, tuple[int | None, int | None]] | None
                   ) -> dict[str, pb.VersionRange] | None:
    """``{task: (lo, hi)}`` (either bound None: open) -> SampleRequest.data_versions."""
    if data_versions is None:
        return None
    out = {}
    for task, (lo, hi) in data_versions.items():
        out[task] = pb.VersionRange(**{k: v for k, v in (("min", lo), ("max", hi)) if v is not None})
    return out


def table_info(info: pb.TableInfo) -> TableInfo:
    config = message_to_dict(info.config)
    config.pop("schema", None)
    return TableInfo(name=info.config.name, config=config, schema=arrow_ipc.decode_schema(info.schema),
                     num_items=info.num_items, policy_version=info.policy_version)


def to_arrow(data: Any, schema: pa.Schema | None) -> pa.Table:
    """pa.Table | RecordBatch | list of dicts | dict of arrays -> pa.Table. With the
    table's schema known, Python values convert to its exact types (maps, structs)."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, Mapping):
        columns = {k: _column(v, _field_type(schema, k)) for k, v in data.items()}
        return pa.table(columns)
    if isinstance(data, Sequence):
        rows = list(data)
        names = list(dict.fromkeys(k for r in rows for k in r))
        sub = None
        if schema is not None and all(n in schema.names for n in names):
            sub = pa.schema([schema.field(n) for n in names])
        tensors = [n for n in names if sub is not None and cell_shape(sub.field(n).type) is not None]
        if not tensors:
            return pa.Table.from_pylist(rows, schema=sub)
        # per-token tensors (routed_experts): (T, ...) arrays per row, packed in one copy
        plain = pa.Table.from_pylist([{k: v for k, v in r.items() if k not in tensors} for r in rows],
                                     schema=pa.schema([f for f in sub if f.name not in tensors]))
        for n in tensors:
            plain = plain.append_column(sub.field(n), tensor_list([r.get(n) for r in rows], sub.field(n).type))
        return plain.select(names)
    raise TypeError(f"cannot insert {type(data).__name__}: give a pa.Table, RecordBatch, "
                    f"list of dicts or dict of arrays")


def _field_type(schema: pa.Schema | None, name: str) -> pa.DataType | None:
    if schema is None or name not in schema.names:
        return None
    return schema.field(name).type


def _column(values: Any, type_: pa.DataType | None) -> pa.Array:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values
    if type_ is not None and cell_shape(type_) is not None:  # rows of (T, ...) arrays, or (B, T, ...)
        return tensor_list(list(values), type_)
    if isinstance(values, np.ndarray) and values.ndim == 2:  # (B, T) -> list<T>
        b, t = values.shape
        flat = pa.array(values.reshape(-1))
        arr = pa.ListArray.from_arrays(pa.array(np.arange(0, (b + 1) * t, t, dtype=np.int32)), flat)
        return arr.cast(type_) if type_ is not None else arr
    if isinstance(values, np.ndarray):
        arr = pa.array(values)
        return arr.cast(type_) if type_ is not None and arr.type != type_ else arr
    return pa.array(list(values), type=type_)


def insert_requests(table: str, data: pa.Table, priorities: Sequence[float] | None,
                    timeout: float, durability: str | None, compress: bool,
                    message_bytes: int, parts: Sequence[int] = (),
                    part_timeouts: Sequence[float] = ()) -> Iterator[bytes]:
    """Framed InsertRequests of ~message_bytes of whole rows each (the payload is joined
    once, never copied by protobuf); the first carries the call's options (and ``parts``:
    the rows of each insert a merged call carries, with ``part_timeouts``: each one's
    timeout, ``InsertRequest.parts``). Arguments are
    checked here, before gRPC iterates the requests on its own thread."""
    pr = insert_priorities(data, priorities, durability)
    return _insert_messages(table, data, pr, timeout, DURABILITY[durability], compress, message_bytes, parts,
                            part_timeouts)


def insert_priorities(data: pa.Table, priorities: Sequence[float] | None, durability: str | None) -> np.ndarray | None:
    """An insert's priorities as an array (None: the server's default), its arguments
    checked: ValueError where they do not fit its rows."""
    pr = None if priorities is None else np.asarray(priorities, dtype=np.float64)
    if pr is not None and pr.shape != (data.num_rows,):
        raise ValueError(f"{len(pr)} priorities for {data.num_rows} rows")
    if durability not in DURABILITY:
        raise ValueError(f"durability must be one of {[k for k in DURABILITY if k]}, got {durability!r}")
    return pr


def only_message(messages: Iterator[bytes]) -> tuple[bytes | None, Iterator[bytes]]:
    """An insert's messages, looked at first: (its only message, an empty iterator) when
    it has one, which the client sends as a unary ``InsertUnary`` (measured, 10,000
    producers of 8 rows each: ~0.2 ms less CPU a call on the client), else (None, all of
    them) for a streaming ``Insert``. Encodes at most the first two."""
    first = next(messages, None)
    if first is None:
        return None, iter(())
    second = next(messages, None)
    if second is None:
        return first, iter(())
    return None, itertools.chain((first, second), messages)


def _insert_messages(table: str, data: pa.Table, priorities: np.ndarray | None, timeout: float, durability: int,
                     compress: bool, message_bytes: int, parts: Sequence[int],
                     part_timeouts: Sequence[float]) -> Iterator[bytes]:
    # A generator of its own rather than a closure: its arguments live in its frame, not in
    # one cell object each (thousands of inserts in flight hold one each).
    start = 0
    for i, (part, pieces) in enumerate(arrow_ipc.encode_parts(data, message_bytes, compress=compress)):
        req = pb.InsertRequest()
        if i == 0:
            req.table, req.timeout_s, req.durability = table, timeout, durability
            req.parts.extend(parts)
            req.part_timeouts_s.extend(part_timeouts)
        if priorities is not None:
            req.priorities.extend(priorities[start:start + part.num_rows].tolist())
        start += part.num_rows
        yield framing.encode(req, INSERT_PAYLOAD, *pieces)


class StreamPoller:
    """The polling state of one ``stream()`` iteration, shared by both clients: each poll
    waits at most ``poll_timeout``, never past the end of ``idle_timeout``."""

    def __init__(self, table: str, group: str, batch_size: int, poll_timeout: float,
                 idle_timeout: float | None, visibility_timeout: float | None, start: str, compress: bool):
        self.poll_timeout, self.idle_timeout = poll_timeout, idle_timeout
        self._request = dict(table=table, group=group, batch_size=batch_size,
                             visibility_timeout_s=visibility_timeout or 0, start=start, compress=compress)
        self.idle_since = time.monotonic()

    def request(self, ack: Sequence[int] | np.ndarray = ()) -> tuple[pb.StreamRequest, float]:
        """The next poll's request, acking ``ack`` first, and how long it may wait."""
        poll = self.poll_timeout
        if self.idle_timeout is not None:
            poll = max(0.0, min(poll, self.idle_timeout - (time.monotonic() - self.idle_since)))
        return pb.StreamRequest(timeout_s=poll, ack_item_ids=list(map(int, ack)), **self._request), poll

    def got_rows(self) -> None:
        self.idle_since = time.monotonic()

    def idle(self) -> bool:
        """After a poll that timed out: is the stream over?"""
        return self.idle_timeout is not None and time.monotonic() - self.idle_since >= self.idle_timeout


def insert_result(resp: pb.InsertResponse) -> InsertResult:
    return InsertResult(np.array(resp.item_ids, dtype=np.uint64), resp.num_inserted, resp.num_duplicates,
                        resp.num_stale)


def reservation(resp: pb.ReserveResponse) -> Reservation:
    return Reservation(resp.reservation_id, resp.count, resp.lease_deadline, resp.policy_version)


def priority_update(resp: pb.UpdatePrioritiesResponse) -> PriorityUpdate:
    return PriorityUpdate(resp.num_updated, np.array(resp.unknown_item_ids, dtype=np.uint64))


def rows(messages: Sequence[tuple[pb.RowsResponse, memoryview]], with_weights: bool) -> SampleBatch:
    """Decoded RowsResponses of one batch -> SampleBatch. The Arrow data points into the
    received message buffers: no copy between the wire and the arrays handed out."""
    tables = [arrow_ipc.decode(payload) for _, payload in messages]
    data = tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    def col(name: str, dtype) -> np.ndarray:
        return np.concatenate([np.asarray(getattr(m, name), dtype=dtype) for m, _ in messages]) \
            if messages else np.zeros(0, dtype)

    return SampleBatch(
        ids=col("item_ids", np.uint64), data=data, priorities=col("priorities", np.float64),
        times_sampled=col("times_sampled", np.int64), policy_versions=col("policy_versions", np.int64),
        probabilities=col("probabilities", np.float64) if with_weights else None,
        weights=col("weights", np.float64) if with_weights else None)


def stats(resp: pb.StatsResponse) -> dict[str, dict[str, float]]:
    return {t.table: dict(t.values) for t in resp.tables}


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


def metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None
