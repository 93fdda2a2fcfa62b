"""ShardedClient: tables spread over several expstore servers, behind Client's API.

Each server (a *shard*) holds its own copy of every table; the client decides where
rows go and gathers them back (docs/sharding.md):

- placement: a row lives on the shard its ``group_id`` (else ``traj_id``) hashes to, by
  rendezvous hashing over the shard names (``_placement``): a GRPO group never splits,
  and every client, in any process and whatever order it lists the servers in, agrees;
- item ids: sharded ids ``shard << 48 | local id`` (``_shard_ids``), accepted back by
  get, update_priorities, ack and commit_cut;
- sampling: each batch is split across shards by their sizes or total priority, so
  uniform, prioritized and group sampling keep the single table's distribution and
  importance weights over the union (``_union``);
- a shard that is down (UNAVAILABLE) fails the inserts of its rows at once, naming it
  (or they retry with exponential backoff: ``insert_retries``), while sampling, streaming,
  stats, list_tables and describe skip it; it rejoins as soon as it answers again.

Calls that must reach every shard (create/drop table, set_policy_version, ack, query,
commit_cut, resume, manifest, checkpoint) raise ``ShardError`` naming each shard that
failed, after the others applied the call. Thread-safe, like Client.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import grpc
import numpy as np
import pyarrow as pa

from expstore_proto.v1 import expstore_pb2 as pb

from . import _codec, _merge, _shard_ids
from ._codec import InsertResult, PriorityUpdate, Reservation, TableInfo
from ._placement import place, placement_keys
from ._shard_errors import ShardedInsertError, ShardError
from ._targets import resolve
from ._union import UnionSampler
from .batch import SampleBatch
from .client import DEFAULT_TIMEOUT, MAX_MESSAGE_BYTES, MESSAGE_BYTES, Client, InsertFuture
from .reward_audit import reward_audit

T = TypeVar("T")
STREAM_WAIT_SLICE_S = 0.25  # longest wait on empty shards before polling them all again


def is_down(error: grpc.RpcError) -> bool:
    """A shard that cannot be reached (or is draining) answers UNAVAILABLE."""
    return error.code() == grpc.StatusCode.UNAVAILABLE


def names_shards(target: str | Sequence[str]) -> bool:
    """Whether ``target`` lists shards ("a:1,b:2" or a sequence) rather than one server."""
    return not isinstance(target, str) or "," in target


def connect(target: str | Sequence[str], token: str | None = None, **options: Any) -> "Client | ShardedClient":
    """A ``Client`` for one server ("host:port"), a ``ShardedClient`` for a list of shards
    ("a:1,b:2" or a sequence); ``options`` go to the constructor. What every tool that
    takes a ``--server``/``--target`` string uses, so each accepts shards the same way."""
    cls = ShardedClient if names_shards(target) else Client
    return cls(target, token, **options)


class ShardedClient:
    """>>> client = ShardedClient(["expstore-0.expstore:50051", "expstore-1.expstore:50051"])
    >>> client.create_table("rollouts", sampler={"type": "prioritized", "alpha": 0.6})
    >>> client.insert("rollouts", rows)           # each row to the shard of its group
    >>> batch = client.sample("rollouts", 256)    # over the union; batch.ids are sharded ids

    ``servers``: addresses, "a,b,c" or ``dns:///host:port`` (resolved once). Table
    configs apply per shard: ``max_size`` and the rate limiter bound each shard's table.
    ``stats_ttl_s``: how long the shards' sizes used to split samples are cached.
    ``insert_retries``: retries of the parts of an insert whose shard is down (0: fail at
    once), after ``retry_backoff_s``, doubling up to ``max_backoff_s``.
    ``reconnect_backoff_s``: the longest gRPC waits before reconnecting to a down shard.
    """

    def __init__(self, servers: str | Sequence[str], token: str | None = None, *,
                 tls: bool | str | bytes | Path | None = None, timeout: float = DEFAULT_TIMEOUT,
                 message_bytes: int = MESSAGE_BYTES, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 stats_ttl_s: float = 1.0, insert_retries: int = 0, retry_backoff_s: float = 0.05,
                 max_backoff_s: float = 2.0, reconnect_backoff_s: float = 2.0, seed: int | None = None) -> None:
        self.shards: list[str] = resolve(servers)
        if len(self.shards) > _shard_ids.MAX_SHARDS:
            raise ValueError(f"{len(self.shards)} servers: a sharded client takes at most {_shard_ids.MAX_SHARDS}")
        backoff_ms = max(1, int(reconnect_backoff_s * 1000))
        options = [("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
                   ("grpc.max_reconnect_backoff_ms", backoff_ms)]
        self._clients = [Client(address, token, tls=tls, timeout=timeout, message_bytes=message_bytes,
                                max_message_bytes=max_message_bytes, channel_options=options)
                         for address in self.shards]
        self._pool = ThreadPoolExecutor(max_workers=min(64, 4 * len(self.shards)), thread_name_prefix="expstore-shard")
        self.timeout = timeout
        self.stats_ttl_s = stats_ttl_s
        self.insert_retries, self.retry_backoff_s, self.max_backoff_s = insert_retries, retry_backoff_s, max_backoff_s
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()
        self._infos: dict[str, TableInfo] = {}
        self._stats: dict[str, tuple[float, list[dict | None], dict[int, grpc.RpcError]]] = {}

    # -- shards and ids ---------------------------------------------------------------

    def shard(self, name: str) -> Client:
        """The Client of one shard (its own, unsharded ids)."""
        return self._clients[self._index(name)]

    def split_ids(self, item_ids) -> dict[str, np.ndarray]:
        """Sharded ids -> {shard name: that shard's own item ids}."""
        return {self.shards[k]: local for k, (_, local) in _shard_ids.by_shard(item_ids, len(self.shards)).items()}

    def item_ids(self, shard: str, local_ids) -> np.ndarray:
        """One shard's own item ids (e.g. the ``item_id`` of query rows) -> sharded ids."""
        return _shard_ids.encode(self._index(shard), local_ids, shard)

    def _index(self, name: str) -> int:
        try:
            return self.shards.index(name)
        except ValueError:
            raise KeyError(f"no shard {name!r} (shards: {', '.join(self.shards)})") from None

    # -- tables -----------------------------------------------------------------------

    def create_table(self, name: str, **options: Any) -> TableInfo:
        """Create the table on every shard (Client.create_table's arguments). If a shard
        fails, the others keep the table: retry with ``if_not_exists=True``."""
        self._forget(name)
        infos = self._all(f"create table {name!r}", lambda c: c.create_table(name, **options))
        return _merge.table_info([infos[k] for k in sorted(infos)])

    def drop_table(self, name: str) -> None:
        self._forget(name)
        self._all(f"drop table {name!r}", lambda c: c.drop_table(name))

    def list_tables(self) -> list[TableInfo]:
        """Every table of the shards that are up, items summed."""
        done, _ = self._up("list tables", lambda c: c.list_tables())
        return _merge.table_infos([done[k] for k in sorted(done)])

    def describe(self, name: str) -> TableInfo:
        """The table over the shards that are up: items summed, the newest policy version."""
        done, _ = self._up(f"describe table {name!r}", lambda c: c.describe(name))
        info = self._infos[name] = _merge.table_info([done[k] for k in sorted(done)])
        return info

    def schema(self, table: str) -> pa.Schema:
        """The table's stored schema (cached after the first call)."""
        return self._info(table).schema

    def _info(self, table: str) -> TableInfo:
        return self._infos.get(table) or self.describe(table)

    def _forget(self, table: str) -> None:
        self._infos.pop(table, None)
        self._stats.pop(table, None)

    # -- rows in ----------------------------------------------------------------------

    def insert(self, table: str, data: Any, *, priorities: Sequence[float] | None = None,
               timeout: float | None = None, durability: str | None = None, compress: bool = False) -> InsertResult:
        """Insert rows, each to the shard of its group (or traj_id); the shards' parts go
        concurrently, each all or none on its shard. Raises ShardedInsertError naming the
        shards that failed (retrying the whole insert is safe)."""
        return self.insert_future(table, data, priorities=priorities, timeout=timeout, durability=durability,
                                  compress=compress).result()

    def insert_future(self, table: str, data: Any, *, priorities: Sequence[float] | None = None,
                      timeout: float | None = None, durability: str | None = None,
                      compress: bool = False) -> "ShardedInsertFuture":
        """Start an insert's parts and return at once; ``.result()`` waits (and retries)."""
        info = self._info(table)
        arrow = _codec.to_arrow(data, info.schema)
        pr = None if priorities is None else np.asarray(priorities, dtype=np.float64)
        if pr is not None and pr.shape != (arrow.num_rows,):
            raise ValueError(f"table {table!r}: {len(pr)} priorities for {arrow.num_rows} rows")
        keys = placement_keys(arrow, info.config.get("key_column"))
        if keys is None:  # no key to place by: the whole insert to one shard
            with self._rng_lock:
                shard_of_row = np.full(arrow.num_rows, self._rng.integers(len(self.shards)))
        else:
            shard_of_row = place(keys, self.shards)
        order = np.argsort(shard_of_row, kind="stable")
        bounds = np.searchsorted(shard_of_row[order], np.arange(len(self.shards) + 1))
        rows = {k: order[bounds[k]:bounds[k + 1]] for k in range(len(self.shards)) if bounds[k + 1] > bounds[k]}

        def start(k: int) -> InsertFuture:
            index = rows[k]  # ascending; a contiguous run (one shard, one group) needs no copy
            contiguous = int(index[-1]) - int(index[0]) + 1 == len(index)
            part = arrow.slice(int(index[0]), len(index)) if contiguous else arrow.take(pa.array(index))
            return self._clients[k].insert_future(table, part, priorities=None if pr is None else pr[rows[k]],
                                                  timeout=timeout, durability=durability, compress=compress)

        return ShardedInsertFuture(self, table, arrow.num_rows, rows, start)

    # -- rows out ---------------------------------------------------------------------

    def sample(self, table: str, batch_size: int, *, timeout: float | None = None,
               compress: bool = False, step: int | None = None,
               data_versions: Mapping[str, tuple[int | None, int | None]] | None = None) -> SampleBatch:
        """Sample over the union of the shards that are up (see ``_union``): probabilities
        and importance weights are the union's. With ``step``, each shard records the
        manifest of its part. ``data_versions`` (as in ``Client.sample``) restricts each
        shard's part; the batch is split across shards by their whole sizes (rows are
        spread over shards by hash, so each shard holds about its share of every version)."""
        union = UnionSampler.of(table, self._info(table).config.get("sampler", {}))
        units = union.units(batch_size)
        stats, failures = self._table_stats(table)
        masses = union.masses(stats)
        up = np.array([s is not None for s in stats])
        taken = np.zeros(len(self.shards), dtype=np.int64)
        parts: list[tuple[int, SampleBatch]] = []
        with self._rng_lock:
            todo = union.split(units, masses, up, taken, self._rng) if up.any() else taken
        while True:
            if not up.any():
                raise ShardError(f"table {table!r}: sample: no shard is up", {self.shards[k]: e for k, e in failures.items()})
            asked = [int(k) for k in np.flatnonzero(todo)] or [int(np.flatnonzero(up)[0])]
            done, failed = self._each(lambda k: self._clients[k].sample(
                table, int(todo[k]) * union.group_size, timeout=timeout, compress=compress, step=step,
                data_versions=data_versions), asked)
            self._raise_unless_down(f"table {table!r}: sample", failed)
            parts += sorted(done.items())
            taken[list(done)] += todo[list(done)]
            if not failed:
                break
            up[list(failed)] = False
            failures.update(failed)
            self._mark_down(table, failed)
            missing = int(todo[list(failed)].sum())
            if up.any():
                with self._rng_lock:
                    todo = union.split(missing, masses, up, taken, self._rng)
        batch = _shard_ids.concat(parts, self.shards, with_weights=True)
        return union.reweight(batch, _shard_ids.decode(batch.ids)[0], union.draw_masses(masses, up))

    def sampler(self, table: str, batch_size: int, *, prefetch: int = 2, timeout: float | None = None,
                compress: bool = False) -> Iterator[SampleBatch]:
        """Sample batches forever, ``prefetch`` samples in flight. Closing the iterator
        drops the batches in flight (the shards counted them as sampled)."""
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1")
        ahead = ThreadPoolExecutor(max_workers=prefetch, thread_name_prefix="expstore-prefetch")
        inflight: deque = deque()
        try:
            while True:
                while len(inflight) < prefetch:
                    inflight.append(ahead.submit(self.sample, table, batch_size, timeout=timeout, compress=compress))
                yield inflight.popleft().result()
        finally:
            ahead.shutdown(wait=False, cancel_futures=True)

    def stream(self, table: str, group: str, batch_size: int, *, poll_timeout: float = 5.0,
               idle_timeout: float | None = None, visibility_timeout: float | None = None,
               start: str = "earliest", compress: bool = False, auto_ack: bool = False) -> Iterator[SampleBatch]:
        """Iterate a consumer group over every shard (each shard keeps the group's offsets
        for its items): each batch gathers at most ``batch_size`` rows, split across the
        shards that are up by their sizes. ``batch.ack()`` acks each row on its shard.
        ``auto_ack`` as AsyncClient.stream's: each shard's rows of the last batch are
        acked by the next call to that shard (an Ack, where a round asks it for no rows)."""
        poller = _codec.StreamPoller(table, group, batch_size, poll_timeout, idle_timeout,
                                     visibility_timeout, start, compress)
        unacked: dict[int, np.ndarray] = {}  # auto_ack: shard -> its ids handed out and not yet acked
        try:
            while True:
                request, poll = poller.request()
                batch = self._stream_round(table, group, request, unacked, wait=0.0, by_size=True)
                if batch is None and poll > 0:  # nothing anywhere: wait on every shard, briefly
                    batch = self._stream_round(table, group, request, unacked, wait=min(poll, STREAM_WAIT_SLICE_S),
                                                by_size=False)
                if batch is None:
                    if poller.idle():
                        return
                    continue
                poller.got_rows()
                if auto_ack:
                    for k, (_, ids) in _shard_ids.by_shard(batch.ids, len(self.shards)).items():
                        unacked[k] = np.concatenate([unacked[k], ids]) if k in unacked else ids
                yield batch.acked_by(lambda ids=batch.ids: self.ack(table, group, ids))
        except GeneratorExit:  # closed: the last batch is done with
            self._on_shards(Client.ack, table, group, unacked)
            raise

    def _stream_round(self, table: str, group: str, request: pb.StreamRequest, unacked: dict[int, np.ndarray], *,
                      wait: float, by_size: bool) -> SampleBatch | None:
        """One Stream call to each shard given a share of ``request.batch_size``, each acking
        its ``unacked`` ids first (an Ack to a shard with ids and no share); the ids of the
        shards that answered are dropped from ``unacked`` (a down shard's are sent again)."""
        stats, failures = self._table_stats(table)
        up = np.array([s is not None for s in stats])
        if not up.any():
            raise ShardError(f"table {table!r}: stream: no shard is up", {self.shards[k]: e for k, e in failures.items()})
        sizes = np.array([s.get("items", 0.0) if s else 0.0 for s in stats]) if by_size else up.astype(float)
        p = sizes if sizes.sum() > 0 else up.astype(float)
        with self._rng_lock:
            shares = self._rng.multinomial(request.batch_size, p / p.sum())

        def poll(k: int) -> SampleBatch | None:
            if not shares[k]:
                self._clients[k].ack(table, group, unacked[k])
                return None
            req = pb.StreamRequest()
            req.CopyFrom(request)
            req.batch_size, req.timeout_s = int(shares[k]), wait
            req.ack_item_ids[:] = unacked.get(k, np.zeros(0, np.uint64)).tolist()
            return self._clients[k].poll_stream(req, wait)

        done, failed = self._each(poll, sorted(set(np.flatnonzero(shares).tolist()) | set(unacked)))
        self._raise_unless_down(f"table {table!r}: stream", failed)
        self._mark_down(table, failed)
        for k in done:
            unacked.pop(k, None)
        parts = [(k, b) for k, b in sorted(done.items()) if b is not None and len(b)]
        return _shard_ids.concat(parts, self.shards, with_weights=False) if parts else None

    def ack(self, table: str, group: str, item_ids) -> int:
        return self._on_shards(Client.ack, table, group, self._local(item_ids))

    def nack(self, table: str, group: str, item_ids) -> int:
        """Hand rows back to the group on the shards that delivered them (``Client.nack``)."""
        return self._on_shards(Client.nack, table, group, self._local(item_ids))

    def _local(self, item_ids) -> dict[int, np.ndarray]:
        """Sharded ids as shard -> its local ids."""
        return {k: ids for k, (_, ids) in _shard_ids.by_shard(item_ids, len(self.shards)).items()}

    def _on_shards(self, call: Callable[..., int], table: str, group: str, ids: dict[int, np.ndarray]) -> int:
        """``call`` (``Client.ack`` or ``Client.nack``) of shard-local ids (shard -> its ids)
        on their shards; the sum of what they answer."""
        done = self._all(f"table {table!r}: {call.__name__}", lambda c, k: call(c, table, group, ids[k]), ids)
        return sum(done.values())

    def update_priorities(self, table: str, item_ids, priorities) -> PriorityUpdate:
        """Each shard updates its live items; ``unknown_item_ids`` are the sharded ids no
        shard knows (in the order given)."""
        pr = np.asarray(priorities, dtype=np.float64)
        parts = _shard_ids.by_shard(item_ids, len(self.shards))
        if pr.shape != (sum(len(p) for p, _ in parts.values()),):
            raise ValueError(f"table {table!r}: {len(pr)} priorities for {sum(len(p) for p, _ in parts.values())} ids")
        done = self._all(f"table {table!r}: update priorities",
                         lambda c, k: c.update_priorities(table, parts[k][1], pr[parts[k][0]]), parts)
        unknown = np.concatenate([np.zeros(0, np.uint64)] + [
            _shard_ids.encode(k, r.unknown_item_ids, self.shards[k]) for k, r in sorted(done.items())])
        given = np.asarray(item_ids, dtype=np.uint64).reshape(-1)
        unknown = given[np.isin(given, unknown)]
        _, first = np.unique(unknown, return_index=True)
        return PriorityUpdate(sum(r.num_updated for r in done.values()), unknown[np.sort(first)])

    def set_policy_version(self, table: str, version: int) -> int:
        """Set the version on every shard; returns how many stale items left in all."""
        done = self._all(f"table {table!r}: set policy version", lambda c: c.set_policy_version(table, version))
        return sum(done.values())

    def reserve(self, table: str, count: int = 1, *, key: str, timeout: float | None = None,
                lease_s: float | None = None) -> Reservation:
        """Reserve on the shard the rollout's rows will go to: ``key`` is their
        ``group_id`` (else ``traj_id``). Each shard paces its own rows, so give each
        table ``pacing.rollouts_per_version`` = the trainer's rows per version / shards.
        The reservation's id is that shard's: rows with this key carry it there."""
        return self._clients[self._shard_of(key)].reserve(table, count, timeout=timeout, lease_s=lease_s)

    def release(self, table: str, reservation_id: int, *, key: str) -> int:
        """``Client.release`` on the shard of ``key`` (as given to ``reserve``)."""
        return self._clients[self._shard_of(key)].release(table, reservation_id)

    def _shard_of(self, key: str) -> int:
        return int(place(pa.array([key], pa.string()), self.shards)[0])

    def get(self, table: str, item_ids, *, compress: bool = False) -> SampleBatch:
        """Rows by sharded id, in the order asked."""
        parts = _shard_ids.by_shard(item_ids, len(self.shards)) or {0: (np.zeros(0, np.int64), np.zeros(0, np.uint64))}
        done = self._all(f"table {table!r}: get", lambda c, k: c.get(table, parts[k][1], compress=compress), parts)
        keys = sorted(done)
        batch = _shard_ids.concat([(k, done[k]) for k in keys], self.shards, with_weights=False)
        return _shard_ids.reorder(batch, np.concatenate([parts[k][0] for k in keys]))

    def stats(self, table: str | None = None, *, per_shard: bool = False) -> dict:
        """{table: {key: value}} merged over the shards that are up (counters and gauges
        summed, settings such as policy_version as their max, consumer positions left
        out; ``shards_up``, ``shards_down``); ``per_shard=True``: {shard: Client.stats()}
        of the shards that are up."""
        done, down = self._up("stats", lambda c: c.stats(table))
        if per_shard:
            return {self.shards[k]: done[k] for k in sorted(done)}
        return _merge.stats({self.shards[k]: done[k] for k in sorted(done)}, [self.shards[k] for k in down])

    def query(self, sql: str, *, max_rows: int = 0, timeout: float | None = None,
              merge: str | None = None) -> pa.RecordBatchReader:
        """Run ``sql`` on every shard. Without ``merge``: the shards' rows one shard after
        the other, with a ``shard`` column (``item_id`` is the shard's own id). With
        ``merge``: a second SQL (DuckDB, client-side) over those rows as the relation
        ``results``, for map-reduce aggregates, e.g. ``SELECT task, sum(n) AS n FROM
        results GROUP BY task``. ``max_rows`` bounds the final result."""
        shard_rows = max_rows if merge is None else 0
        readers = self._all("query", lambda c: c.query(sql, max_rows=shard_rows, timeout=timeout))
        rows = _merge.with_shard({self.shards[k]: r for k, r in readers.items()}, shard_rows)
        return rows if merge is None else _merge.merge_sql(rows.read_all(), merge, max_rows)

    def query_table(self, sql: str, *, max_rows: int = 0, timeout: float | None = None,
                    merge: str | None = None) -> pa.Table:
        return self.query(sql, max_rows=max_rows, timeout=timeout, merge=merge).read_all()

    def audit(self, table: str, reward: str, *, where: str | None = None, limit: int | None = None,
              tolerance: float = 1e-6, workers: int | None = None, item_timeout: float = 30.0,
              progress: bool | None = None):
        """Recompute rewards over every shard's rows (``expstore.audit``, one worker pool)
        into one report whose results carry a ``shard`` column. ``limit``: the rows with
        the lowest item ids, ties across shards by shard name (``reward_audit``)."""
        return reward_audit(lambda sql, timeout: self.query(sql, timeout=timeout), table, reward, where=where,
                            limit=limit, tolerance=tolerance, workers=workers, item_timeout=item_timeout,
                            progress=progress)

    # -- training cuts and checkpoints ------------------------------------------------

    def commit_cut(self, table: str, group: str, step: int, item_ids=(), *, tag: str = "") -> int:
        """A cut on every shard (each atomic on its shard, not across shards): each acks
        its own ids and remembers its position under ``step``."""
        parts = _shard_ids.by_shard(item_ids, len(self.shards))
        none = np.zeros(0, dtype=np.uint64)
        done = self._all(f"table {table!r}: commit cut {step}", lambda c, k: c.commit_cut(
            table, group, step, parts[k][1] if k in parts else none, tag=tag), range(len(self.shards)))
        return sum(done.values())

    def resume(self, table: str, group: str, step: int) -> dict[str, dict[str, int]]:
        """Rewind ``group`` to its cut at ``step`` on every shard: {shard: position, inflight}."""
        done = self._all(f"table {table!r}: resume {step}", lambda c: c.resume(table, group, step))
        return {self.shards[k]: done[k] for k in sorted(done)}

    def manifest(self, table: str, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(sharded ids, policy versions) step ``step`` sampled, over the shards (a shard
        that served none of that step's draws has no manifest for it)."""
        done, failed = self._each(lambda k: self._clients[k].manifest(table, step))
        missing = {k for k, e in failed.items() if e.code() == grpc.StatusCode.NOT_FOUND}
        if set(failed) - missing or not done:
            raise ShardError(f"table {table!r}: manifest of step {step}", {self.shards[k]: e for k, e in failed.items()})
        keys = sorted(done)
        ids = [_shard_ids.encode(k, done[k][0], self.shards[k]) for k in keys]
        return np.concatenate(ids), np.concatenate([done[k][1] for k in keys])

    def checkpoint(self, name: str = "", *, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Snapshot every shard to its own remote tier: {shard: Client.checkpoint()}."""
        done = self._all("checkpoint", lambda c: c.checkpoint(name, timeout=timeout))
        return {self.shards[k]: done[k] for k in sorted(done)}

    # -- lifecycle --------------------------------------------------------------------

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self._clients:
            client.close()

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- fan-out ----------------------------------------------------------------------

    def _each(self, call: Callable[[int], T], shards: Iterable[int] | None = None
              ) -> tuple[dict[int, T], dict[int, grpc.RpcError]]:
        """Run ``call(shard index)`` on the shards concurrently: (results, errors)."""
        futures = {k: self._pool.submit(call, k) for k in (range(len(self.shards)) if shards is None else shards)}
        done: dict[int, T] = {}
        failed: dict[int, grpc.RpcError] = {}
        for k, future in futures.items():
            try:
                done[k] = future.result()
            except grpc.RpcError as e:
                failed[k] = e
        return done, failed

    def _all(self, what: str, call: Callable[..., T], shards: Iterable[int] | None = None) -> dict[int, T]:
        """``call(client)`` (or ``call(client, index)`` where ``shards`` is given) on each
        shard; ShardError naming every shard that failed."""
        fn = (lambda k: call(self._clients[k])) if shards is None else (lambda k: call(self._clients[k], k))
        done, failed = self._each(fn, shards)
        if failed:
            raise ShardError(what, {self.shards[k]: e for k, e in failed.items()})
        return done

    def _up(self, what: str, call: Callable[[Client], T]) -> tuple[dict[int, T], list[int]]:
        """``call`` on every shard, skipping the shards that are down: (results, down)."""
        done, failed = self._each(lambda k: call(self._clients[k]))
        self._raise_unless_down(what, failed)
        if not done:
            raise ShardError(f"{what}: no shard is up", {self.shards[k]: e for k, e in failed.items()})
        return done, sorted(failed)

    def _raise_unless_down(self, what: str, failed: Mapping[int, grpc.RpcError]) -> None:
        other = {self.shards[k]: e for k, e in failed.items() if not is_down(e)}
        if other:
            raise ShardError(what, other)

    def _table_stats(self, table: str) -> tuple[list[dict | None], dict[int, grpc.RpcError]]:
        """Each shard's stats of ``table`` (None: down), cached for ``stats_ttl_s``."""
        cached = self._stats.get(table)
        if cached is not None and cached[0] > time.monotonic():
            return list(cached[1]), dict(cached[2])
        done, failed = self._each(lambda k: self._clients[k].stats(table)[table])
        self._raise_unless_down(f"table {table!r}: stats", failed)
        stats = [done.get(k) for k in range(len(self.shards))]
        self._stats[table] = (time.monotonic() + self.stats_ttl_s, stats, failed)
        return list(stats), dict(failed)

    def _mark_down(self, table: str, failed: Mapping[int, grpc.RpcError]) -> None:
        """Leave shards that just failed out of the cached stats until the next refresh."""
        cached = self._stats.get(table)
        if failed and cached is not None:
            stats = [None if k in failed else s for k, s in enumerate(cached[1])]
            self._stats[table] = (cached[0], stats, {**cached[2], **failed})


class ShardedInsertFuture:
    """An insert in flight on several shards (``ShardedClient.insert_future``)."""

    def __init__(self, client: ShardedClient, table: str, num_rows: int, rows: dict[int, np.ndarray],
                 start: Callable[[int], InsertFuture]) -> None:
        self._client, self._table, self._num_rows, self._rows, self._start = client, table, num_rows, rows, start
        self._calls = {k: start(k) for k in rows}

    def done(self) -> bool:
        return all(call.done() for call in self._calls.values())

    def result(self, timeout: float | None = None) -> InsertResult:
        """The InsertResult (sharded ids, in row order); ShardedInsertError if a part failed
        (after the client's ``insert_retries`` for shards that were down)."""
        c = self._client
        stored: dict[int, InsertResult] = {}
        for attempt in range(c.insert_retries + 1):
            failed: dict[int, grpc.RpcError] = {}
            for k, call in self._calls.items():
                try:
                    stored[k] = call.result(timeout)
                except grpc.RpcError as e:
                    failed[k] = e
            retry = [k for k, e in failed.items() if is_down(e)]
            if not failed or len(retry) < len(failed) or attempt == c.insert_retries:
                break
            delay = min(c.max_backoff_s, c.retry_backoff_s * 2 ** attempt)
            time.sleep(delay * random.uniform(0.5, 1.0))  # jitter: producers do not retry in lockstep
            self._calls = {k: self._start(k) for k in retry}
        if failed:
            c._mark_down(self._table, {k: e for k, e in failed.items() if is_down(e)})
            failed_rows = np.sort(np.concatenate([self._rows[k] for k in failed]))
            raise ShardedInsertError(self._table, {c.shards[k]: e for k, e in failed.items()},
                                     {c.shards[k]: len(self._rows[k]) for k in failed},
                                     {c.shards[k]: self._sharded(k, r) for k, r in stored.items()}, failed_rows)
        ids = np.zeros(self._num_rows, dtype=np.uint64)
        for k, r in stored.items():
            ids[self._rows[k]] = _shard_ids.encode(k, r.item_ids, c.shards[k])
        return InsertResult(ids, sum(r.num_inserted for r in stored.values()),
                            sum(r.num_duplicates for r in stored.values()), sum(r.num_stale for r in stored.values()))

    def _sharded(self, k: int, result: InsertResult) -> InsertResult:
        return dataclasses.replace(result, item_ids=_shard_ids.encode(k, result.item_ids, self._client.shards[k]))
