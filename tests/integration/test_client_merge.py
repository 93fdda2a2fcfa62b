"""Small inserts a client makes while another of their table's is on the wire go out as
one call (client/expstore_client/merge.py), each caller answered as if alone: its ids,
its duplicates, its own error; and the table's inserts keep the order they were made in."""

from __future__ import annotations

import asyncio
import gc
import re

import grpc
import pytest

from expstore_client import AsyncClient

from ._util import audit_lines, trajectories, wait_until, with_loss_mask

pytestmark = pytest.mark.timeout(120)
CALLS = 120


def _insert_calls(data_dir, table: str) -> list[int]:
    """The rows of each Insert call the server's audit log recorded for ``table``."""
    return [int(re.match(r"rows=(\d+)", x["detail"]).group(1)) for x in audit_lines(data_dir)
            if x["table"] == table and x["method"] == "Insert"]


async def _gather(client: AsyncClient, table: str, batches: list) -> list:
    """Every insert made at once, in list order: results or exceptions."""
    return await asyncio.gather(*(client.insert(table, b) for b in batches), return_exceptions=True)


def test_concurrent_small_inserts_share_calls_each_answered_as_its_own_in_the_order_made(shared_server, client,
                                                                                          table_name):
    client.create_table(table_name, sampler="fifo")
    first = trajectories(8, tokens=16, id_prefix=f"{table_name}-first-")
    fresh = [trajectories(8, tokens=16, id_prefix=f"{table_name}-p{i}", seed=i) for i in range(CALLS)]

    async def run():
        async with AsyncClient(shared_server.address, flight=False) as c:
            first_ids = (await c.insert(table_name, first)).item_ids.tolist()
            return first_ids, await _gather(c, table_name, fresh[:CALLS // 2] + [first] * 5 + fresh[CALLS // 2:])

    first_ids, results = asyncio.run(run())
    assert not [r for r in results if isinstance(r, BaseException)]
    again = results[CALLS // 2:CALLS // 2 + 5]
    mine = results[:CALLS // 2] + results[CALLS // 2 + 5:]
    for r in mine:
        assert (r.num_inserted, r.num_duplicates, r.num_stale, len(r.item_ids)) == (8, 0, 0, 8)
    for r in again:  # resent rows: each caller told they were stored already, under their ids
        assert (r.num_inserted, r.num_duplicates, r.item_ids.tolist()) == (0, 8, first_ids)
    ids = [i for r in mine for i in r.item_ids.tolist()]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)  # stored in the order the inserts were made
    assert client.get(table_name, [mine[7].item_ids[3]]).data.column("traj_id").to_pylist() == [
        f"{table_name}-p7-3"]
    assert wait_until(lambda: sum(_insert_calls(shared_server.data_dir, table_name)) == 8 * (CALLS + 6))
    calls = _insert_calls(shared_server.data_dir, table_name)
    assert len(calls) < CALLS // 2, calls  # merged: far fewer calls than inserts


def test_a_bad_insert_in_a_merged_call_fails_alone_and_the_others_are_stored(shared_server, client, table_name):
    client.create_table(table_name, sampler="uniform")
    bad = with_loss_mask(trajectories(6, tokens=16, id_prefix=f"{table_name}-bad-"), row=4, token=10, value=2)
    batches = [trajectories(8, tokens=16, id_prefix=f"{table_name}-p{i}", seed=i) for i in range(CALLS)]
    batches[CALLS // 2:CALLS // 2] = [bad]

    async def run():
        async with AsyncClient(shared_server.address, flight=False) as c:
            await c.insert(table_name, trajectories(1, id_prefix=f"{table_name}-warm-"))
            return await _gather(c, table_name, batches)

    results = asyncio.run(run())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(failed) == 1 and results[CALLS // 2] is failed[0]
    assert failed[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "row 4" in failed[0].details() and "'loss_mask'" in failed[0].details()  # its own rows' error
    assert all(r.num_inserted == 8 for r in results if not isinstance(r, BaseException))
    assert client.stats(table_name)[table_name]["items"] == 8 * CALLS + 1


def test_a_large_insert_keeps_its_place_among_merged_small_ones(shared_server, client, table_name):
    client.create_table(table_name, sampler="fifo")
    small = [trajectories(4, tokens=16, id_prefix=f"{table_name}-s{i}-", seed=i) for i in range(40)]
    large = trajectories(64, tokens=4096, id_prefix=f"{table_name}-large-")  # > merge.MAX_BYTES: alone
    assert large.get_total_buffer_size() > 1 << 20

    async def run():
        async with AsyncClient(shared_server.address, flight=False) as c:
            await c.insert(table_name, trajectories(1, id_prefix=f"{table_name}-warm-"))
            return await _gather(c, table_name, small[:20] + [large] + small[20:])

    results = asyncio.run(run())
    assert not [r for r in results if isinstance(r, BaseException)]
    before, big, after = results[:20], results[20], results[21:]
    assert big.num_inserted == 64
    assert max(i for r in before for i in r.item_ids) < min(big.item_ids)
    assert max(big.item_ids) < min(i for r in after for i in r.item_ids)


def test_a_caller_that_goes_away_leaves_the_others_answered(shared_server, client, table_name):
    client.create_table(table_name, sampler="uniform")
    batches = [trajectories(4, tokens=16, id_prefix=f"{table_name}-c{i}-", seed=i) for i in range(30)]

    async def run():
        async with AsyncClient(shared_server.address, flight=False) as c:
            await c.insert(table_name, trajectories(1, id_prefix=f"{table_name}-warm-"))
            tasks = [asyncio.ensure_future(c.insert(table_name, b)) for b in batches]
            await asyncio.sleep(0)  # every insert has taken its place
            tasks[10].cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(run())
    assert isinstance(results[10], asyncio.CancelledError)
    assert all(r.num_inserted == 4 for i, r in enumerate(results) if i != 10)


def test_closing_a_client_answers_its_waiting_merged_inserts_and_leaves_no_error_unretrieved(shared_server, client,
                                                                                              table_name):
    client.create_table(table_name, sampler="uniform")
    reported = []

    async def run():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        c = AsyncClient(shared_server.address, flight=False)
        await c.insert(table_name, trajectories(1, id_prefix=f"{table_name}-warm-"))
        tasks = [asyncio.ensure_future(c.insert(table_name, trajectories(2, id_prefix=f"{table_name}-c{i}")))
                 for i in range(20)]
        await asyncio.sleep(0)  # 4 on the wire, the rest in a group behind them
        await c.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        gc.collect()  # a task whose error nobody retrieved reports it as it goes
        await asyncio.sleep(0)
        return results

    results = asyncio.run(run())
    assert all(isinstance(r, BaseException) or r.num_inserted == 2 for r in results)
    assert not reported, reported
