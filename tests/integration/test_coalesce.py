"""Concurrent Insert calls to one table are committed together (server/expstore_server/
coalesce.py): fewer chunks than calls, each call answered as if alone (its ids, its
duplicates), a bad call failing alone with its own error while the others land, and
nothing acknowledged lost to kill -9."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from expstore_client import AsyncClient, Client

from ._util import start_server, stored_traj_ids, trajectories, with_loss_mask

pytestmark = pytest.mark.timeout(180)
CALLS = 200


async def _insert_all(address: str, batches: list) -> list:
    """Insert every batch at once (one call each, two channels); results or exceptions."""
    clients = [AsyncClient(address), AsyncClient(address)]
    try:
        return await asyncio.gather(*(clients[i % 2].insert("t", b) for i, b in enumerate(batches)),
                                    return_exceptions=True)
    finally:
        for c in clients:
            await c.close()


def test_concurrent_inserts_share_chunks_and_each_call_gets_its_own_ids_and_duplicates(tmp_path):
    server = start_server(tmp_path / "data")
    try:
        c = Client(server.address)
        c.create_table("t", sampler="fifo", max_size=10**6)
        first = trajectories(8, tokens=16, id_prefix="first-")
        first_ids = c.insert("t", first).item_ids.tolist()
        fresh = [trajectories(8, tokens=16, id_prefix=f"p{i}", seed=i) for i in range(CALLS)]
        again = [first] * 10  # resent rows: duplicates of the stored ones
        results = asyncio.run(_insert_all(server.address, fresh + again))
        assert not [r for r in results if isinstance(r, BaseException)]
        for r in results[:CALLS]:
            assert (r.num_inserted, r.num_duplicates, r.num_stale, len(r.item_ids)) == (8, 0, 0, 8)
        ids = [i for r in results[:CALLS] for i in r.item_ids.tolist()]
        assert len(set(ids)) == 8 * CALLS and not set(ids) & set(first_ids)
        for r in results[CALLS:]:
            assert (r.num_inserted, r.num_duplicates, r.item_ids.tolist()) == (0, 8, first_ids)
        stats = c.stats("t")["t"]
        assert stats["items"] == 8 * (CALLS + 1)
        assert stats["chunks"] < CALLS  # calls were committed together (one chunk per call before)
        # Each call's rows under its own ids.
        got = c.get("t", [results[7].item_ids[3]]).data.column("traj_id").to_pylist()
        assert got == ["p7-3"]
    finally:
        server.stop()


def test_a_bad_call_among_concurrent_inserts_fails_alone_with_its_own_error_and_the_others_land(tmp_path):
    server = start_server(tmp_path / "data")
    try:
        c = Client(server.address)
        c.create_table("t", sampler="uniform", max_size=10**6)
        bad = with_loss_mask(trajectories(6, tokens=16, id_prefix="bad-"), row=4, token=10, value=2)
        batches = [trajectories(8, tokens=16, id_prefix=f"p{i}", seed=i) for i in range(CALLS)]
        batches[CALLS // 2:CALLS // 2] = [bad]
        results = asyncio.run(_insert_all(server.address, batches))
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 1 and results[CALLS // 2] is failed[0]
        assert failed[0].code() == grpc.StatusCode.INVALID_ARGUMENT
        alone = None
        try:
            c.insert("t", bad)
        except grpc.RpcError as e:
            alone = e
        assert alone is not None and failed[0].details() == alone.details()  # the error it gets alone
        assert "row 4" in alone.details() and "'loss_mask'" in alone.details()
        assert c.stats("t")["t"]["items"] == 8 * CALLS
    finally:
        server.stop()


def test_kill_9_after_coalesced_inserts_were_acknowledged_loses_none_of_them(tmp_path):
    server = start_server(tmp_path / "data")
    c = Client(server.address)
    c.create_table("t", sampler="uniform", max_size=10**6)  # the default: durable, acknowledged at wal
    batches = [trajectories(8, tokens=16, id_prefix=f"k{i}", seed=i) for i in range(CALLS)]
    results = asyncio.run(_insert_all(server.address, batches))
    assert not [r for r in results if isinstance(r, BaseException)]
    assert c.stats("t")["t"]["chunks"] < CALLS
    c.close()
    server.stop(signal.SIGKILL)
    server = start_server(server.data_dir)
    try:
        stored = stored_traj_ids(Client(server.address), "t", "check")
        assert sorted(stored) == sorted(i for b in batches for i in b.column("traj_id").to_pylist())
    finally:
        server.stop()
