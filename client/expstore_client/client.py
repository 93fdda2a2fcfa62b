"""The synchronous client, used inside training loops. Thread-safe: one gRPC channel,
shared by every thread; calls carry no client-side state but a schema cache.

Errors are ``grpc.RpcError`` with the server's status code and message (for example
DEADLINE_EXCEEDED when the rate limiter held a call back past ``timeout``).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import grpc
import numpy as np
import pyarrow as pa

from expstore_proto import arrow_ipc
from expstore_proto.v1 import expstore_pb2 as pb
from expstore_proto.service import client_stub

from . import _codec
from ._codec import InsertResult, PriorityUpdate, TableInfo
from .batch import SampleBatch

DEFAULT_TIMEOUT = 30.0
MESSAGE_BYTES = 8 << 20
MAX_MESSAGE_BYTES = 256 << 20
_SLACK = 5.0  # seconds an RPC deadline exceeds the call's own timeout_s


def make_credentials(tls: bool | str | bytes | Path | None) -> grpc.ChannelCredentials | None:
    """None/False: plaintext. True: TLS with system roots. bytes or a path: TLS trusting
    that PEM root certificate."""
    if not tls:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    root = tls if isinstance(tls, bytes) else Path(tls).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=root)


class Client:
    """>>> client = Client("127.0.0.1:50051")
    >>> client.create_table("rollouts", sampler={"type": "prioritized", "alpha": 0.6})
    >>> client.insert("rollouts", [{"traj_id": "a", ...}])
    >>> batch = client.sample("rollouts", 256)
    """

    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, *,
                 tls: bool | str | bytes | Path | None = None, timeout: float = DEFAULT_TIMEOUT,
                 message_bytes: int = MESSAGE_BYTES, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 channel_options: Sequence[tuple[str, Any]] = ()) -> None:
        """``channel_options``: extra gRPC channel arguments (e.g. reconnect backoff)."""
        options = _codec.channel_options(max_message_bytes) + list(channel_options)
        creds = make_credentials(tls)
        self._channel = grpc.secure_channel(target, creds, options) if creds else \
            grpc.insecure_channel(target, options)
        self._stub = client_stub(self._channel)
        self._metadata = _codec.metadata(token)
        self.timeout = timeout
        self.message_bytes = message_bytes
        self._schemas: dict[str, pa.Schema] = {}

    # -- tables -----------------------------------------------------------------------

    def create_table(self, name: str, *, kind: str = "trajectory", schema: pa.Schema | None = None,
                     sampler: str | Mapping[str, Any] = "uniform",
                     rate_limiter: Mapping[str, Any] | None = None, if_not_exists: bool = False,
                     **config: Any) -> TableInfo:
        """Create a table. ``config`` takes the other TableConfig fields: remover,
        max_size, max_times_sampled, max_staleness, memory_bytes, key_column, dedup_window,
        tiers, ssd_bytes, durability, archive, vocab_size (token ids must be below it),
        metadata (string notes such as the console's ``tokenizer``), group_timeout_s and
        group_timeout_action, ingest_checks (a list), routed_experts (``{"layers": L,
        "top_k": k, "num_experts": E}``); the sampler mapping may hold task_quotas
        (``{task: {"min": share, "max": share}}``). See docs/config.md."""
        req = pb.CreateTableRequest(config=_codec.table_config(name, kind=kind, schema=schema, sampler=sampler,
                                                               rate_limiter=rate_limiter, **config),
                                    if_not_exists=if_not_exists)
        return _codec.table_info(self._call(self._stub.CreateTable, req))

    def drop_table(self, name: str) -> None:
        self._call(self._stub.DropTable, pb.DropTableRequest(table=name))
        self._schemas.pop(name, None)

    def list_tables(self) -> list[TableInfo]:
        return [_codec.table_info(t) for t in self._call(self._stub.ListTables, pb.ListTablesRequest()).tables]

    def describe(self, name: str) -> TableInfo:
        info = _codec.table_info(self._call(self._stub.DescribeTable, pb.DescribeTableRequest(table=name)))
        self._schemas[name] = info.schema
        return info

    # -- rows in ----------------------------------------------------------------------

    def insert(self, table: str, data: Any, *, priorities: Sequence[float] | None = None,
               timeout: float | None = None, durability: str | None = None,
               compress: bool = False) -> InsertResult:
        """Insert rows (pa.Table, RecordBatch, list of dicts or dict of arrays), all or
        none. Waits up to ``timeout`` for the rate limiter. Retrying with the same
        traj_ids is safe: rows already stored are reported as duplicates."""
        return self.insert_future(table, data, priorities=priorities, timeout=timeout,
                                  durability=durability, compress=compress).result()

    def insert_future(self, table: str, data: Any, *, priorities: Sequence[float] | None = None,
                      timeout: float | None = None, durability: str | None = None,
                      compress: bool = False) -> "InsertFuture":
        """Start an insert and return at once; ``.result()`` waits for it. With a few
        inserts in flight a producer encodes its next batch while the server validates
        this one (each insert is still all or none)."""
        arrow = _codec.to_arrow(data, self._schema(table, data))
        timeout = self.timeout if timeout is None else timeout
        requests = _codec.insert_requests(table, arrow, priorities, timeout, durability, compress,
                                          self.message_bytes)
        return InsertFuture(self._stub.Insert.future(requests, timeout=timeout + _SLACK, metadata=self._metadata))

    # -- rows out ---------------------------------------------------------------------

    def sample(self, table: str, batch_size: int, *, timeout: float | None = None,
               compress: bool = False, step: int | None = None,
               data_versions: Mapping[str, tuple[int | None, int | None]] | None = None) -> SampleBatch:
        """Sample a batch. With ``step``, the server records the batch's manifest (item
        ids, policy versions) under that training step (``manifest(table, step)``).
        ``data_versions`` (``{task: (lo, hi)}``, ``"*"`` for the other tasks, None for an
        open bound; task mixing with a ``data_version`` column) samples only those versions."""
        timeout = self.timeout if timeout is None else timeout
        req = pb.SampleRequest(table=table, batch_size=batch_size, timeout_s=timeout, compress=compress, step=step,
                               data_versions=_codec.version_ranges(data_versions))
        return _codec.rows(list(self._call(self._stub.Sample, req, timeout)), with_weights=True)

    def sampler(self, table: str, batch_size: int, *, prefetch: int = 2, timeout: float | None = None,
                compress: bool = False) -> Iterator[SampleBatch]:
        """Sample batches forever, keeping ``prefetch`` Sample calls in flight so that the
        server gathers the next batch while this one is used (Reverb's in-flight samples).
        Closing the iterator cancels the calls in flight; the server may already have
        counted them as sampled."""
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1")
        timeout = self.timeout if timeout is None else timeout
        req = pb.SampleRequest(table=table, batch_size=batch_size, timeout_s=timeout, compress=compress)
        inflight: deque = deque()
        try:
            while True:
                while len(inflight) < prefetch:
                    inflight.append(self._call(self._stub.Sample, req, timeout))
                yield _codec.rows(list(inflight.popleft()), with_weights=True)
        finally:
            for call in inflight:
                call.cancel()

    def stream(self, table: str, group: str, batch_size: int, *, poll_timeout: float = 5.0,
               idle_timeout: float | None = None, visibility_timeout: float | None = None,
               start: str = "earliest", compress: bool = False) -> Iterator[SampleBatch]:
        """Iterate a consumer group's batches in insertion order (at most ``batch_size``
        each). Ack each batch (``batch.ack()``) once processed, or it is redelivered
        after the visibility timeout. Ends after ``idle_timeout`` seconds without rows
        (None: never)."""
        poller = _codec.StreamPoller(table, group, batch_size, poll_timeout, idle_timeout,
                                     visibility_timeout, start, compress)
        while True:
            req, poll = poller.request()
            try:
                messages = list(self._call(self._stub.Stream, req, poll))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                if poller.idle():
                    return
                continue
            poller.got_rows()
            batch = _codec.rows(messages, with_weights=False)
            batch._ack = lambda ids=batch.ids: self.ack(table, group, ids)
            yield batch

    def ack(self, table: str, group: str, item_ids: Sequence[int] | np.ndarray) -> int:
        resp = self._call(self._stub.Ack, pb.AckRequest(table=table, group=group, item_ids=list(map(int, item_ids))))
        return resp.num_acked

    def update_priorities(self, table: str, item_ids, priorities) -> PriorityUpdate:
        """Set the priorities of the live items among ``item_ids`` (the last entry wins
        for a repeated id). Ids of items that have left are ignored and returned in
        ``unknown_item_ids``: the rest are updated all the same."""
        req = pb.UpdatePrioritiesRequest(table=table, item_ids=list(map(int, item_ids)),
                                         priorities=list(map(float, priorities)))
        return _codec.priority_update(self._call(self._stub.UpdatePriorities, req))

    def set_policy_version(self, table: str, version: int) -> int:
        """Set the table's current policy version; returns how many stale items left."""
        req = pb.SetPolicyVersionRequest(table=table, version=version)
        return self._call(self._stub.SetPolicyVersion, req).num_expired

    def get(self, table: str, item_ids, *, compress: bool = False) -> SampleBatch:
        req = pb.GetRequest(table=table, item_ids=list(map(int, item_ids)), compress=compress)
        return _codec.rows(list(self._call(self._stub.Get, req)), with_weights=False)

    def stats(self, table: str | None = None) -> dict[str, dict[str, float]]:
        return _codec.stats(self._call(self._stub.Stats, pb.StatsRequest(table=table or "")))

    def query(self, sql: str, *, max_rows: int = 0, timeout: float | None = None) -> pa.RecordBatchReader:
        """Run one SELECT on the server (docs/cli.md, "query"): its record batches as they
        arrive, at most ``max_rows`` rows (0: all). Each batch points into its received
        message: no copy. The first message is awaited here (it carries the schema)."""
        messages = iter(self._call(self._stub.Query, pb.QueryRequest(sql=sql, max_rows=max_rows), timeout))
        first = arrow_ipc.decode(next(messages)[1])

        def batches() -> Iterator[pa.RecordBatch]:
            yield from first.to_batches()
            for _, payload in messages:
                yield from arrow_ipc.decode(payload).to_batches()

        return pa.RecordBatchReader.from_batches(first.schema, batches())

    def query_table(self, sql: str, *, max_rows: int = 0, timeout: float | None = None) -> pa.Table:
        """The whole result of ``query`` as one table."""
        return self.query(sql, max_rows=max_rows, timeout=timeout).read_all()

    # -- training cuts and checkpoints ------------------------------------------------

    def commit_cut(self, table: str, group: str, step: int, item_ids=(), *, tag: str = "") -> int:
        """Atomically ack what training step ``step`` consumed, remember the stream
        position under ``step`` and record the ids as the step's manifest (replacing an
        earlier commit of ``step``); returns the number acked. With no ids it creates a
        group that has not read yet (a trainer's step 0)."""
        req = pb.CommitCutRequest(table=table, group=group, step=step, item_ids=list(map(int, item_ids)), tag=tag)
        return self._call(self._stub.CommitCut, req).num_acked

    def resume(self, table: str, group: str, step: int) -> dict[str, int]:
        """Rewind ``group`` to its cut at ``step``: everything after it is delivered again,
        and the manifests of later steps are forgotten."""
        resp = self._call(self._stub.Resume, pb.ResumeRequest(table=table, group=group, step=step))
        return {"position": resp.position, "inflight": resp.inflight}

    def manifest(self, table: str, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(item ids, policy versions) that training step ``step`` sampled or committed."""
        resp = self._call(self._stub.GetManifest, pb.GetManifestRequest(table=table, step=step))
        return np.array(resp.item_ids, dtype=np.uint64), np.array(resp.policy_versions, dtype=np.int64)

    def checkpoint(self, name: str = "", *, timeout: float | None = None) -> dict[str, Any]:
        """Snapshot the whole server to its remote tier (inserts and samples go on)."""
        resp = self._call(self._stub.Checkpoint, pb.CheckpointRequest(name=name), timeout or 3600.0)
        return {"name": resp.name, "uri": resp.uri, "num_bytes": resp.num_bytes, "seconds": resp.seconds}

    # -- lifecycle --------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _schema(self, table: str, data: Any) -> pa.Schema | None:
        if isinstance(data, (pa.Table, pa.RecordBatch)):
            return None
        if table not in self._schemas:
            self.describe(table)
        return self._schemas[table]

    def _call(self, method, request, timeout: float | None = None):
        # The RPC deadline leaves the server time to answer DEADLINE_EXCEEDED itself.
        deadline = (timeout if timeout is not None else self.timeout) + _SLACK
        return method(request, timeout=deadline, metadata=self._metadata)


class InsertFuture:
    """An insert in flight (``Client.insert_future``)."""

    def __init__(self, call: grpc.Future) -> None:
        self._call = call

    def done(self) -> bool:
        return self._call.done()

    def result(self, timeout: float | None = None) -> InsertResult:
        """The InsertResult; raises the call's grpc.RpcError if it failed."""
        return _codec.insert_result(self._call.result(timeout))
