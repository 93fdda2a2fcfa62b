"""AsyncClient: many producers in one event loop, and the same API as Client."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pyarrow as pa
import pytest

from expstore_client import AsyncClient

from ._util import num_items, trajectories

PRODUCERS = 1000


@pytest.mark.parametrize("num_clients", [1, 4])
def test_thousand_concurrent_producers(shared_server, client, table_name, num_clients):
    client.create_table(table_name)
    data = trajectories(2 * PRODUCERS, tokens=(16, 64), id_prefix="prod")
    batches = [data.slice(2 * i, 2) for i in range(PRODUCERS)]

    async def main():
        clients = [AsyncClient(shared_server.address) for _ in range(num_clients)]
        try:
            async def produce(i):
                return await clients[i % len(clients)].insert(table_name, batches[i], timeout=30)
            t0 = time.monotonic()
            results = await asyncio.gather(*(produce(i) for i in range(PRODUCERS)))
            return results, time.monotonic() - t0
        finally:
            for c in clients:
                await c.close()

    try:
        results, elapsed = asyncio.run(main())
        assert all(r.num_inserted == 2 and r.num_duplicates == 0 for r in results)
        ids = np.concatenate([r.item_ids for r in results])
        assert len(set(ids.tolist())) == 2 * PRODUCERS
        assert num_items(client, table_name) == 2 * PRODUCERS
        got = client.get(table_name, results[123].item_ids)
        assert got.data.column("traj_id").to_pylist() == ["prod-246", "prod-247"]
        assert elapsed < 60, elapsed
    finally:
        client.drop_table(table_name)


def test_concurrent_producers_on_one_client_with_dicts(shared_server, client, table_name):
    """One AsyncClient, many tasks inserting lists of dicts (the schema is fetched once)."""
    client.create_table(table_name)
    rows = trajectories(200, id_prefix="dict").to_pylist()

    async def main():
        async with AsyncClient(shared_server.address) as c:
            results = await asyncio.gather(*(c.insert(table_name, rows[i:i + 2]) for i in range(0, 200, 2)))
            return [r.num_inserted for r in results]

    try:
        assert asyncio.run(main()) == [2] * 100
        assert num_items(client, table_name) == 200
    finally:
        client.drop_table(table_name)


def test_async_api_round_trip(shared_server, table_name):
    async def main():
        async with AsyncClient(shared_server.address) as c:
            await c.create_table(table_name, sampler="fifo")
            try:
                data = trajectories(10, id_prefix="aio")
                res = await c.insert(table_name, data, priorities=np.arange(1, 11))
                again = await c.insert(table_name, data)
                assert again.num_duplicates == 10 and again.item_ids.tolist() == res.item_ids.tolist()
                info = await c.describe(table_name)
                assert info.num_items == 10
                assert table_name in [t.name for t in await c.list_tables()]
                got = await c.get(table_name, res.item_ids)
                assert got.data.column("tokens").to_pylist() == data.column("tokens").to_pylist()
                assert got.priorities.tolist() == list(map(float, range(1, 11)))
                batch = await c.sample(table_name, 4, compress=True)
                assert batch.ids.tolist() == res.item_ids[:4].tolist()
                done = await c.update_priorities(table_name, [*res.item_ids[:2], 10**9], [3.0, 4.0, 5.0])
                assert done.num_updated == 2 and done.unknown_item_ids.tolist() == [10**9]
                assert await c.set_policy_version(table_name, 2) == 0
                seen = []
                async for b in c.stream(table_name, "g", 3, poll_timeout=0.2, idle_timeout=0.3):
                    seen += b.ids.tolist()
                    assert await b.ack() == len(b)
                assert seen == res.item_ids.tolist()
                stats = await c.stats(table_name)
                assert stats[table_name]["group.g.acked"] == 10
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await c.sample("no_such_table", 1)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await c.insert(table_name, pa.table({"nope": [1]}))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            finally:
                await c.drop_table(table_name)

    asyncio.run(main())


def test_async_blocked_sample_wakes_on_insert(shared_server, table_name):
    async def main():
        async with AsyncClient(shared_server.address) as trainer, AsyncClient(shared_server.address) as producer:
            await producer.create_table(table_name, rate_limiter={"type": "min_size", "min_size_to_sample": 5})
            try:
                waiting = asyncio.create_task(trainer.sample(table_name, 5, timeout=10))
                await asyncio.sleep(0.3)
                assert not waiting.done()
                t0 = time.monotonic()
                await producer.insert(table_name, trajectories(5))
                batch = await asyncio.wait_for(waiting, 5)
                assert len(batch) == 5 and time.monotonic() - t0 < 1.0
            finally:
                await producer.drop_table(table_name)

    asyncio.run(main())


def test_sync_and_async_clients_agree(shared_server, client, table_name):
    client.create_table(table_name)
    try:
        ids = client.insert(table_name, trajectories(5)).item_ids

        async def read():
            async with AsyncClient(shared_server.address) as c:
                return await c.get(table_name, ids)

        a, s = asyncio.run(read()), client.get(table_name, ids)
        assert a.data.equals(s.data) and a.ids.tolist() == s.ids.tolist()
    finally:
        client.drop_table(table_name)
