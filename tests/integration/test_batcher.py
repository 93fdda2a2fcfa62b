"""InsertBatcher: many tasks' inserts coalesced into few RPCs, per-caller semantics kept."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from expstore_client import AsyncClient

from ._util import trajectories, with_loss_mask


def run(coro):
    return asyncio.run(coro)


def test_many_tasks_share_few_rpcs_and_get_their_own_ids(shared_server, table_name):
    async def main():
        async with AsyncClient(shared_server.address) as c:
            await c.create_table(table_name)
            batcher = c.batcher(table_name, linger_s=0.02, max_rows=10_000)
            results = await asyncio.gather(*(batcher.insert(trajectories(2, id_prefix=f"task{i}"))
                                             for i in range(200)))
            got = await c.get(table_name, [int(i) for ids in results for i in ids])
            return batcher.calls, results, got, (await c.stats(table_name))[table_name]

    calls, results, got, stats = run(main())
    assert stats["items"] == 400 and calls < 20
    assert all(len(ids) == 2 for ids in results)
    # Each caller's ids point at its own rows.
    expected = [f"task{i}-{k}" for i in range(200) for k in range(2)]
    assert got.data.column("traj_id").to_pylist() == expected


def test_a_bad_caller_fails_alone(shared_server, table_name):
    async def main():
        async with AsyncClient(shared_server.address) as c:
            await c.create_table(table_name)
            batcher = c.batcher(table_name, linger_s=0.05)
            good = [batcher.insert(trajectories(3, id_prefix=f"good{i}")) for i in range(5)]
            bad = batcher.insert(with_loss_mask(trajectories(3, id_prefix="bad"), 1, 0, 2))
            outcome = await asyncio.gather(*good, bad, return_exceptions=True)
            return outcome, (await c.stats(table_name))[table_name]["items"]

    outcome, items = run(main())
    assert all(len(ids) == 3 for ids in outcome[:5])
    assert isinstance(outcome[5], grpc.aio.AioRpcError)
    assert outcome[5].code() == grpc.StatusCode.INVALID_ARGUMENT and "row 1" in outcome[5].details()
    assert items == 15


def test_max_rows_sends_without_waiting_for_linger(shared_server, table_name):
    async def main():
        async with AsyncClient(shared_server.address) as c:
            await c.create_table(table_name)
            batcher = c.batcher(table_name, linger_s=60, max_rows=4)
            ids = await asyncio.wait_for(batcher.insert(trajectories(4)), timeout=10)
            with pytest.raises(ValueError):
                await batcher.insert(trajectories(2), priorities=[1.0])
            return ids

    assert len(run(main())) == 4


def test_a_combined_insert_goes_as_one_record_batch(shared_server, table_name):
    """Many callers' rows are sent as one contiguous batch: the server validates and
    stores per record batch, so 25 one-row batches cost it ~5x one batch of 25 rows."""
    async def main():
        async with AsyncClient(shared_server.address) as c:
            await c.create_table(table_name)
            batches, insert = [], c.insert

            async def counting(table, rows, **kw):
                batches.append(len(rows.to_batches()))
                return await insert(table, rows, **kw)

            c.insert = counting
            batcher = c.batcher(table_name, linger_s=0.05, max_rows=10_000)
            await asyncio.gather(*(batcher.insert(trajectories(1, id_prefix=f"t{i}")) for i in range(25)))
            return batches, (await c.stats(table_name))[table_name]["items"]

    batches, items = run(main())
    assert items == 25 and batches and set(batches) == {1}
