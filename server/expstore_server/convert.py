"""Proto <-> engine conversions. Pure functions: no I/O, no gRPC calls."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from expstore.errors import InvalidArgument
from expstore_proto import arrow_ipc, ipc_size
from expstore_proto.messages import message_to_dict
from expstore_proto.v1 import expstore_pb2 as pb
from expstore.spec import TableSpec
from expstore.table import InsertResult, Rows, Table

from . import frames


def spec_from_proto(config: pb.TableConfig) -> TableSpec:
    d = message_to_dict(config)
    if "schema" in d:
        try:
            d["schema"] = arrow_ipc.decode_schema(d["schema"])
        except (pa.ArrowException, ValueError, OSError) as e:
            raise InvalidArgument(f"table {config.name!r}: schema is not an Arrow IPC schema: {e}") from None
    return TableSpec.from_dict(d)


def spec_to_proto(spec: TableSpec) -> pb.TableConfig:
    s, r = spec.sampler, spec.rate_limiter
    sampler = pb.SamplerConfig(type=s.type, alpha=s.alpha, beta=s.beta, group_size=s.group_size,
                               drop_zero_variance=s.drop_zero_variance, group_order=s.group_order,
                               task_weights=s.task_weights or {},
                               task_quotas={t: pb.TaskQuota(**q) for t, q in (s.task_quotas or {}).items()})
    limiter = pb.RateLimiterConfig(type=r.type, min_size_to_sample=r.min_size_to_sample,
                                   samples_per_insert=r.samples_per_insert)
    for name in ("error_buffer", "min_diff", "max_diff", "size"):
        if getattr(r, name) is not None:
            setattr(limiter, name, getattr(r, name))
    config = pb.TableConfig(
        name=spec.name, kind=spec.kind, sampler=sampler, remover=spec.remover,
        max_size=spec.max_size, max_times_sampled=spec.max_times_sampled, rate_limiter=limiter,
        memory_bytes=spec.memory_bytes, dedup_window=spec.dedup_window, tiers=spec.tiers,
        ssd_bytes=spec.ssd_bytes, durability=spec.durability, archive=spec.archive,
        metadata=spec.metadata or {}, group_timeout_action=spec.group_timeout_action,
        ingest_checks=list(spec.ingest_checks or ()), share_prefixes=spec.share_prefixes)
    if spec.schema is not None:
        config.schema = arrow_ipc.encode_schema(spec.schema)
    if spec.key_column is not None:
        config.key_column = spec.key_column
    if spec.max_staleness is not None:
        config.max_staleness = spec.max_staleness
    if spec.vocab_size is not None:
        config.vocab_size = spec.vocab_size
    if spec.group_timeout_s is not None:
        config.group_timeout_s = spec.group_timeout_s
    if spec.routed_experts is not None:
        e = spec.routed_experts
        config.routed_experts.CopyFrom(pb.RoutedExpertsConfig(layers=e.layers, top_k=e.top_k,
                                                              num_experts=e.num_experts))
    for name in ("hot_retention_s", "hot_retention_bytes", "retention_s", "retention_bytes"):
        if getattr(spec, name) is not None:
            setattr(config, name, getattr(spec, name))
    if spec.pacing is not None:
        config.pacing.CopyFrom(pb.PacingConfig(rollouts_per_version=spec.pacing.rollouts_per_version,
                                               lease_s=spec.pacing.lease_s))
    return config


def version_ranges(ranges) -> dict[str, tuple[int | None, int | None]] | None:
    """SampleRequest.data_versions -> ``Table.sample``'s ``data_versions`` (None: unset)."""
    if not ranges:
        return None
    return {task: (r.min if r.HasField("min") else None, r.max if r.HasField("max") else None)
            for task, r in ranges.items()}


def insert_response(result: InsertResult) -> pb.InsertResponse:
    """What an insert did (gRPC's Insert and Flight's DoPut answer alike)."""
    return pb.InsertResponse(item_ids=result.item_ids.tolist(), num_inserted=result.num_inserted,
                             num_duplicates=result.num_duplicates, num_stale=result.num_stale)


def table_info(table: Table) -> pb.TableInfo:
    return pb.TableInfo(config=spec_to_proto(table.spec), schema=arrow_ipc.encode_schema(table.schema),
                        num_items=len(table), policy_version=table.policy_version)


def rows_to_messages(rows: Rows, *, compress: bool, message_bytes: int) -> list[bytes]:
    """Split rows over framed RowsResponse messages of about ``message_bytes``, each a
    whole IPC stream (see ``frames``: the payload is not copied by protobuf)."""
    out, start = [], 0
    for part in arrow_ipc.split_rows(rows.data, message_bytes):
        end = start + part.num_rows
        out.append(frames.rows_message(rows_facts(rows, start, end), part, compress=compress))
        start = end
    return out


def rows_facts(rows: Rows, start: int, end: int) -> pb.RowsResponse:
    """What travels beside rows ``start:end``'s data: ids, priorities, counts, versions,
    and a sample's probabilities and weights."""
    meta = pb.RowsResponse(
        item_ids=rows.item_ids[start:end].tolist(), priorities=rows.priorities[start:end].tolist(),
        times_sampled=rows.times_sampled[start:end].tolist(),
        policy_versions=rows.policy_versions[start:end].tolist())
    if rows.probabilities is not None:
        meta.probabilities.extend(rows.probabilities[start:end].tolist())
        meta.weights.extend(rows.weights[start:end].tolist())
    return meta


RESPONSE_FRAMING = 64 << 10
"""Bytes a response message needs besides its rows: the IPC schema and batch metadata,
buffer padding, item ids and priorities. A row may take max_message_bytes less this."""


def decode_rows(data, *, table: str, message: int, row_offset: int, max_bytes: int) -> tuple[pa.Table, int]:
    """Decode and fully validate an untrusted IPC stream (bad offsets must never reach a take):
    its rows and their Arrow bytes (at least ``nbytes``: the buffers' declared sizes).

    Refused with InvalidArgument, naming the table (and the row, counted over the whole
    call from ``row_offset``): a stream whose record batches declare more than
    ``max_bytes`` once decompressed, before anything is decompressed; rows that take
    more than ``max_bytes`` once their dictionaries are expanded; and a row that no
    response message of ``max_bytes`` could carry back (it could be stored, never sampled).

    The stream is framed once (``arrow_ipc.messages``): the sizes are read from the
    record batches' metadata, then the same messages are decoded against the schema of
    the first, read and checked once per schema (by its bytes: ``_schema_of``); a stream
    with dictionaries or in the other byte order is decoded by Arrow's stream reader
    instead. Measured for 8 trajectory rows (5 KB uncompressed), each call a fresh
    payload: ~50 us, where framing and decoding the stream twice, reading ``nbytes``
    (~3 us a column) and comparing a schema read afresh took ~175 us.
    """
    what = f"table {table!r}: insert message {message}"
    try:
        head, batches = arrow_ipc.messages(data)
        declared = sum(ipc_size.message_bytes(m) for m in batches)
        schema = _schema_of(head)  # before decoding: names checked, once per schema
    except (pa.ArrowException, ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError
        raise InvalidArgument(f"{what}: not a valid Arrow IPC stream: {e}") from None
    if declared > max_bytes:
        raise InvalidArgument(f"{what}: its rows would take {declared} bytes decompressed, more than "
                              f"max_message_bytes ({max_bytes}); send fewer rows per message")
    try:
        if schema.plain and all(m.type == "record batch" for m in batches):
            read = arrow_ipc.read_batches(schema.schema, batches)
            for batch in read:  # a table's validate costs ~20 us more, for no more checks
                batch.validate(full=True)
            rows, nbytes = pa.Table.from_batches(read, schema.schema), declared
        else:
            rows = arrow_ipc.decode(data)
            rows.validate(full=True)
            nbytes = rows.nbytes
    except (pa.ArrowException, ValueError, OSError) as e:
        raise InvalidArgument(f"{what}: not a valid Arrow IPC stream: {e}") from None
    _check_row_sizes(rows, nbytes, schema.dictionaries, what, table, row_offset, max_bytes)
    return rows, nbytes


def _check_row_sizes(rows: pa.Table, nbytes: int, dictionaries: bool, what: str, table: str, row_offset: int,
                     max_bytes: int) -> None:
    limit = max_bytes - RESPONSE_FRAMING
    if nbytes <= limit and not dictionaries:
        return
    sizes = ipc_size.row_bytes(rows)
    over = np.flatnonzero(sizes > limit)
    if len(over):
        r = int(over[0])
        raise InvalidArgument(f"table {table!r}: row {row_offset + r} takes {int(sizes[r])} bytes, more than one "
                              f"response message can carry back ({limit}: max_message_bytes {max_bytes} less "
                              f"{RESPONSE_FRAMING} for framing); split the trajectory or raise max_message_bytes")
    if dictionaries and int(sizes.sum()) > max_bytes:
        raise InvalidArgument(f"{what}: its rows would take {int(sizes.sum())} bytes with their dictionaries "
                              f"expanded, more than max_message_bytes ({max_bytes}); send fewer rows per message")


def _check_names(fields) -> None:
    """Read every (nested) field name: a name that is not UTF-8 raises UnicodeDecodeError."""
    for f in fields:
        f.name
        t = f.type
        _check_names(t.fields if hasattr(t, "fields") else [t.field(i) for i in range(t.num_fields)])


@dataclass(frozen=True)
class _Schema:
    """A stream's schema, its names checked, and how its batches may be decoded."""

    schema: pa.Schema
    dictionaries: bool  # some field is dictionary-encoded (at any depth)
    plain: bool  # no dictionaries and this machine's byte order: ``arrow_ipc.read_batches`` reads it


def _read_schema(message: pa.ipc.Message) -> _Schema:
    schema = pa.ipc.read_schema(message)
    _check_names(schema)
    dictionaries = ipc_size.has_dictionary(schema)
    return _Schema(schema, dictionaries, not dictionaries and ipc_size.native_byte_order(message))


_schema_of = ipc_size.SchemaMessageMemo(_read_schema)  # one schema, call after call


def ids_of(values) -> np.ndarray:
    return np.fromiter(values, dtype=np.uint64, count=len(values))
