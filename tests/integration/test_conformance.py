"""One client contract: the same suite against Client, AsyncClient and ShardedClient
(one shard and two), over real servers.

The suite speaks the async contract; a synchronous client is adapted by running each
call in a thread (``Api``), so every test runs unchanged against every client. Where
ShardedClient's answers differ by design (sharded item ids; per-shard ``resume`` and
``checkpoint``), the test says so.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest

from expstore_client import AsyncClient, Client, ShardedClient

from ._util import start_server, trajectories

pytestmark = pytest.mark.timeout(300)

# The contract: what every client offers, with the same arguments.
CONTRACT = ("create_table", "drop_table", "list_tables", "describe", "schema", "insert", "insert_future",
            "sample", "sampler", "stream", "ack", "nack", "update_priorities", "set_policy_version", "reserve", "release",
            "get", "stats",
            "query", "query_table", "commit_cut", "resume", "manifest", "checkpoint", "close")
KINDS = ("Client", "AsyncClient", "ShardedClient-1", "ShardedClient-2")


def _public(cls) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


def _parameters(cls, name: str) -> list[tuple[str, object]]:
    sig = inspect.signature(getattr(cls, name))
    return [(p.name, p.default) for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]


def test_client_and_async_client_offer_the_same_methods_with_the_same_arguments():
    # AsyncClient's extras: batcher (asyncio only). Client's sync iterators and futures
    # wrap AsyncClient's methods of the same name.
    assert _public(Client) == _public(AsyncClient) - {"batcher"}
    for name in _public(Client):
        assert _parameters(Client, name) == _parameters(AsyncClient, name), name
        assert inspect.getdoc(getattr(Client, name)) == inspect.getdoc(getattr(AsyncClient, name)), name


def test_every_client_has_the_contract():
    for cls in (Client, AsyncClient, ShardedClient):
        missing = [n for n in CONTRACT if not callable(getattr(cls, n, None))]
        assert not missing, (cls.__name__, missing)
    for name in CONTRACT:  # ShardedClient may add options, never rename or drop one
        params = inspect.signature(getattr(ShardedClient, name)).parameters
        open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values())  # passed on to Client's
        assert open_ended or all(p in params for p, _ in _parameters(Client, name)), name


@pytest.fixture(scope="module")
def second_server(tmp_path_factory):
    s = start_server(Path(tmp_path_factory.mktemp("second")) / "data")
    yield s
    s.stop()


class Api:
    """Any client behind the async contract: AsyncClient's coroutines as they are, a
    synchronous client's methods each run in a thread."""

    def __init__(self, client, is_async: bool, sharded: bool) -> None:
        self.client, self.is_async, self.sharded = client, is_async, sharded

    def __getattr__(self, name: str):
        method = getattr(self.client, name)
        if self.is_async:
            return method

        async def call(*args, **kwargs):
            return await asyncio.to_thread(method, *args, **kwargs)
        return call

    async def iterate(self, name: str, *args, limit: int | None = None, ack: bool = False, **kwargs) -> list:
        """The items of an iterating method (``sampler``, ``stream``), at most ``limit``,
        each acked as it comes if ``ack``; the iterator is closed afterwards."""
        out = []
        iterator = getattr(self.client, name)(*args, **kwargs)
        try:
            while limit is None or len(out) < limit:
                if self.is_async:
                    try:
                        item = await iterator.__anext__()
                    except StopAsyncIteration:
                        break
                else:
                    item = await asyncio.to_thread(next, iterator, None)
                    if item is None:
                        break
                out.append(item)
                if ack:
                    await self.settle(item.ack() if self.is_async else await asyncio.to_thread(item.ack))
        finally:
            if self.is_async:
                await iterator.aclose()
            else:
                await asyncio.to_thread(iterator.close)
        return out

    async def settle(self, value):
        """A coroutine's or a plain call's result (``batch.ack()``)."""
        return await value if inspect.isawaitable(value) else value

    async def insert_later(self, table: str, data, **options):
        """``insert_future``, then its result."""
        if self.is_async:
            return await (await self.client.insert_future(table, data, **options))
        future = await asyncio.to_thread(self.client.insert_future, table, data, **options)
        return await asyncio.to_thread(future.result, 30)

    async def query_batches(self, sql: str) -> tuple[pa.Schema, list[pa.RecordBatch]]:
        if self.is_async:
            result = await self.client.query(sql)
            return result.schema, [b async for b in result]
        reader = await asyncio.to_thread(self.client.query, sql)
        return reader.schema, await asyncio.to_thread(lambda: list(reader))


@pytest.fixture(params=KINDS)
def connect(request, shared_server):
    """``async with connect() as api``: the parametrised client behind ``Api``."""
    kind = request.param
    servers = [shared_server.address]
    if kind == "ShardedClient-2":
        servers.append(request.getfixturevalue("second_server").address)

    class Connection:
        async def __aenter__(self) -> Api:
            if kind == "AsyncClient":
                self.client = AsyncClient(servers[0])
            elif kind == "Client":
                self.client = Client(servers[0])
            else:
                self.client = ShardedClient(servers)
            self.api = Api(self.client, kind == "AsyncClient", kind.startswith("Sharded"))
            return self.api

        async def __aexit__(self, *exc) -> None:
            await self.api.close()

    return Connection


def run(coro) -> None:
    asyncio.run(coro)


def name_of(request) -> str:
    return "c_" + "".join(ch if ch.isalnum() else "_" for ch in request.node.name)[:80]


def test_tables(connect, request):
    table = name_of(request)

    async def main():
        async with connect() as api:
            info = await api.create_table(table, sampler="fifo", max_size=100)
            assert info.name == table and info.config["max_size"] == 100
            try:
                with pytest.raises(grpc.RpcError) as err:
                    await api.create_table(table, sampler="fifo", max_size=100)
                assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
                assert (await api.create_table(table, sampler="fifo", max_size=100, if_not_exists=True)).name == table
                assert table in [t.name for t in await api.list_tables()]
                assert (await api.describe(table)).num_items == 0
                assert "traj_id" in (await api.schema(table)).names
                await api.insert(table, trajectories(4, id_prefix="t"))
                assert (await api.describe(table)).num_items == 4
                assert (await api.stats(table))[table]["items"] == 4
            finally:
                await api.drop_table(table)
            with pytest.raises(grpc.RpcError) as err:
                await api.describe(table)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    run(main())


def test_rows_in_and_out(connect, request):
    table = name_of(request)

    async def main():
        async with connect() as api:
            await api.create_table(table, sampler="uniform")
            try:
                data = trajectories(8, id_prefix="r")
                first = await api.insert(table, data, priorities=np.arange(1, 9))
                assert first.num_inserted == 8 and len(np.unique(first.item_ids)) == 8
                again = await api.insert(table, data)  # a retry: every row a duplicate
                assert again.num_duplicates == 8 and again.item_ids.tolist() == first.item_ids.tolist()
                later = await api.insert_later(table, trajectories(4, id_prefix="f"))
                assert later.num_inserted == 4
                rows = trajectories(1, id_prefix="d").to_pylist()  # Python rows: converted by the stored schema
                assert (await api.insert(table, rows)).num_inserted == 1

                order = first.item_ids[::-1]
                got = await api.get(table, order)
                assert got.ids.tolist() == order.tolist()
                assert got.data.column("traj_id").to_pylist() == data.column("traj_id").to_pylist()[::-1]
                assert got.priorities.tolist() == list(map(float, range(8, 0, -1)))

                batch = await api.sample(table, 5)
                assert len(batch) == 5 and batch.weights.shape == (5,) and batch.probabilities.shape == (5,)
                batches = await api.iterate("sampler", table, 3, prefetch=2, limit=3)
                assert [len(b) for b in batches] == [3, 3, 3]

                unknown = int(first.item_ids.max()) + 1000
                done = await api.update_priorities(table, [*first.item_ids[:2], unknown], [3.0, 4.0, 5.0])
                assert done.num_updated == 2 and done.unknown_item_ids.tolist() == [unknown]
                assert await api.set_policy_version(table, 1) == 0
            finally:
                await api.drop_table(table)

    run(main())


def test_paced_reservations(connect, request):
    """ShardedClient reserves on the shard of the rows' group_id (``key``), and each shard
    paces its own rows."""
    table = name_of(request)

    async def main():
        async with connect() as api:
            await api.create_table(table, sampler="fifo", max_staleness=0, pacing={"rollouts_per_version": 2})
            try:
                key = {"key": "g1"} if api.sharded else {}
                r = await api.reserve(table, 2, timeout=0, **key)
                assert (r.count, r.policy_version) == (2, 0)
                with pytest.raises(grpc.RpcError) as err:
                    await api.reserve(table, 1, timeout=0, **key)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                data = trajectories(2, id_prefix="p")
                data = data.set_column(data.schema.get_field_index("group_id"), "group_id", pa.array(["g1"] * 2))
                data = data.append_column("reservation_id", pa.array([r.id] * 2, pa.uint64()))
                assert (await api.insert(table, data.slice(0, 1))).num_inserted == 1
                assert await api.release(table, r.id, **key) == 1
                assert await api.release(table, r.id, **key) == 0
                stats = (await api.stats(table))[table]
                assert (stats["pacing_admitted"], stats["pacing_settled_rows"]) == (1, 1)
            finally:
                await api.drop_table(table)

    run(main())


def test_stream_ack_cut_resume_manifest(connect, request):
    table = name_of(request)

    async def main():
        async with connect() as api:
            await api.create_table(table, sampler="fifo")
            try:
                ids = (await api.insert(table, trajectories(6, id_prefix="s"))).item_ids
                seen = []
                for batch in await api.iterate("stream", table, "g", 4, poll_timeout=0.2, idle_timeout=0.5):
                    seen += batch.ids.tolist()
                    assert await api.settle(batch.ack()) == len(batch)
                assert sorted(seen) == sorted(ids.tolist())
                assert (await api.stats(table))[table]["group.g.acked"] == 6

                assert await api.commit_cut(table, "trainer", 0) == 0  # a group that has not read yet
                (batch,) = await api.iterate("stream", table, "trainer", 6, poll_timeout=1.0, limit=1)
                assert await api.commit_cut(table, "trainer", 1, batch.ids) == len(batch)
                manifest_ids, versions = await api.manifest(table, 1)
                assert sorted(manifest_ids.tolist()) == sorted(batch.ids.tolist()) and len(versions) == len(batch)
                where = await api.resume(table, "trainer", 0)
                positions = where.values() if api.sharded else [where]  # per shard
                assert all(set(p) == {"position", "inflight"} for p in positions)
                again = await api.iterate("stream", table, "trainer", 6, poll_timeout=0.3, idle_timeout=1.0)
                assert set(batch.ids.tolist()) <= {i for b in again for i in b.ids.tolist()}  # rewound
            finally:
                await api.drop_table(table)

    run(main())


def test_a_nacked_batch_comes_back_first_at_once(connect, request):
    """A batch handed back (``nack``) is the group's next delivery, long before its
    visibility timeout; an acked row stays acked; an id never delivered is NOT_FOUND."""
    table = name_of(request)

    async def main():
        async with connect() as api:
            await api.create_table(table, sampler="fifo")
            try:
                ids = (await api.insert(table, trajectories(10, id_prefix="n"))).item_ids.tolist()
                (first,) = await api.iterate("stream", table, "g", 4, visibility_timeout=600, limit=1)
                assert await api.ack(table, "g", first.ids[:1]) == 1
                assert await api.nack(table, "g", first.ids) == len(first) - 1
                rest = await api.iterate("stream", table, "g", 4, visibility_timeout=600, poll_timeout=0.2,
                                         idle_timeout=0.5, ack=True)
                again = [i for b in rest for i in b.ids.tolist()]
                assert sorted(again) == sorted(set(ids) - {int(first.ids[0])})
                if not api.sharded:  # (a sharded stream reads its shards side by side)
                    assert again == ids[1:]
                stats = (await api.stats(table))[table]
                assert stats["group.g.acked"] == 10 and stats["group.g.redelivered"] == len(first) - 1
                with pytest.raises(grpc.RpcError) as e:
                    await api.nack(table, "g", [max(ids) + 1000])
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
            finally:
                await api.drop_table(table)

    run(main())


def test_an_auto_acked_stream_acks_each_batch_with_the_next_call_and_the_last_at_close(connect, request):
    table = name_of(request)

    async def main():
        async with connect() as api:
            await api.create_table(table, sampler="fifo")
            try:
                ids = (await api.insert(table, trajectories(10, id_prefix="a"))).item_ids
                first = await api.iterate("stream", table, "g", 4, poll_timeout=0.5, limit=2, auto_ack=True)
                # Two batches read (ShardedClient's may hold fewer rows: shares of 4 drawn
                # by the shards' sizes), then closed: the second was acked at close, the
                # first only by the call that fetched the second.
                acked = (await api.stats(table))[table]["group.g.acked"]
                assert len(first) == 2 and acked == len(first[0]) + len(first[1])
                rest = await api.iterate("stream", table, "g", 4, poll_timeout=0.2, idle_timeout=0.5, auto_ack=True)
                seen = [i for b in first + rest for i in b.ids.tolist()]
                assert sorted(seen) == sorted(ids.tolist())
                stats = (await api.stats(table))[table]
                assert stats["group.g.acked"] == 10 and stats["group.g.inflight"] == 0  # the last: at the idle end
            finally:
                await api.drop_table(table)

    run(main())


def test_query(connect, request):
    table = name_of(request)

    async def main():
        async with connect() as api:
            await api.create_table(table)
            try:
                await api.insert(table, trajectories(5, id_prefix="q"))
                sql = f"SELECT traj_id FROM {table} ORDER BY traj_id"
                schema, batches = await api.query_batches(sql)
                assert schema.names == (["traj_id", "shard"] if api.sharded else ["traj_id"])  # merged: by shard
                assert sorted(pa.Table.from_batches(batches, schema).column(0).to_pylist()) == \
                    [f"q-{i}" for i in range(5)]
                whole = await api.query_table(f"SELECT traj_id FROM {table} WHERE traj_id > 'q-2'")
                assert sorted(whole.column("traj_id").to_pylist()) == ["q-3", "q-4"]
            finally:
                await api.drop_table(table)

    run(main())


def test_errors_carry_the_servers_status(connect, request):
    table = name_of(request)

    async def main():
        async with connect() as api:
            await api.create_table(table, rate_limiter={"type": "min_size", "min_size_to_sample": 10})
            try:
                with pytest.raises(grpc.RpcError) as err:
                    await api.sample(table, 1, timeout=0.2)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                with pytest.raises(grpc.RpcError) as err:
                    await api.insert(table, pa.table({"nope": [1]}))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert table in err.value.details()
                with pytest.raises(grpc.RpcError) as err:
                    await api.set_policy_version(table, -1)
                assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
            finally:
                await api.drop_table(table)

    run(main())


def test_checkpoint(connect):
    async def main():
        async with connect() as api:
            done = await api.checkpoint()
            for info in (done.values() if api.sharded else [done]):  # per shard
                assert info["name"] and info["uri"] and info["num_bytes"] > 0

    run(main())
