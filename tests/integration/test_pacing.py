"""Admission-paced staleness over the wire (docs/semantics.md, "Staleness"): the pacing
config round-trips, Reserve waits for the trainer and fails DEADLINE_EXCEEDED saying why,
rows name their reservation, Release gives rows back; and with a real server, concurrent
producers and a trainer, pacing trains long tasks at their share started where eviction
under-trains them (the shares are printed for the record)."""

from __future__ import annotations

import asyncio
import random

import grpc
import numpy as np
import pyarrow as pa
import pytest

from expstore_client import AsyncClient

from ._util import rpc_error, trajectories

pytestmark = pytest.mark.timeout(180)


def rows(n: int, reservation: int | None, *, prefix: str, version: int = 0, task: str = "math") -> pa.Table:
    t = trajectories(n, tokens=12, id_prefix=prefix, policy_version=version, tasks=(task,))
    return t if reservation is None else t.append_column("reservation_id", pa.array([reservation] * n, pa.uint64()))


def test_reserve_release_and_their_statuses(client, table_name, drop):
    info = client.create_table(table_name, sampler="fifo", max_times_sampled=1, max_staleness=1,
                               pacing={"rollouts_per_version": 2, "lease_s": 60.0})
    drop(table_name)
    assert client.describe(table_name).config == info.config
    assert info.config["pacing"] == {"rollouts_per_version": 2, "lease_s": 60.0}
    assert info.schema.field("reservation_id").type == pa.uint64()
    a = client.reserve(table_name, 3, timeout=0)
    assert (a.id, a.count, a.policy_version) == (1, 3, 0) and a.lease_deadline > 0
    e = rpc_error(lambda: client.reserve(table_name, 2, timeout=0.2), grpc.StatusCode.DEADLINE_EXCEEDED)
    assert "pacing: a reservation of 2 rows waits for the trainer: 3 rows admitted, 4 allowed" in e.details()
    rpc_error(lambda: client.reserve(table_name, 5, timeout=0), grpc.StatusCode.INVALID_ARGUMENT)
    e = rpc_error(lambda: client.insert(table_name, rows(1, None, prefix="x")), grpc.StatusCode.INVALID_ARGUMENT)
    assert "row 0, column 'reservation_id': the table paces admission" in e.details()
    assert client.insert(table_name, rows(2, a.id, prefix="a")).num_inserted == 2
    assert client.release(table_name, a.id) == 1 and client.release(table_name, a.id) == 0
    rpc_error(lambda: client.release(table_name, 99), grpc.StatusCode.NOT_FOUND)
    assert client.reserve(table_name, 2, timeout=0).id == 2  # the released row came back
    stats = client.stats(table_name)[table_name]
    assert (stats["pacing_admitted"], stats["pacing_settled_rows"], stats["pacing_released_rows"]) == (4, 2, 1)
    client.create_table(table_name + "_free")
    drop(table_name + "_free")
    rpc_error(lambda: client.reserve(table_name + "_free", 1, timeout=0), grpc.StatusCode.FAILED_PRECONDITION)


B, S = 8, 2
SHORT_S, LONG_S = 0.005, 0.4


async def run_mix(address: str, table: str, paced: bool, *, starts: int = 240, producers: int = 16) -> dict:
    """``producers`` coroutines start rollouts (long or short, 1/2 each, drawn when the
    rollout starts) until ``starts`` have started; one trainer samples batches of B and
    sets the next version after each; at the end it trains what is left."""
    config = dict(sampler="fifo", max_times_sampled=1, max_staleness=S)
    if paced:
        config["pacing"] = {"rollouts_per_version": B}
    rng = random.Random(7)
    started, trained = {"long": 0, "short": 0}, {"long": 0, "short": 0}
    async with AsyncClient(address) as client:
        await client.create_table(table, **config)
        version, left, k = 0, starts, 0

        async def producer() -> None:
            nonlocal left, k
            while left > 0:
                reservation = None
                if paced:
                    reservation = (await client.reserve(table, 1, timeout=60)).id
                if left <= 0:  # others started the last ones meanwhile
                    await client.release(table, reservation) if paced else None
                    return
                left -= 1
                kind = "long" if rng.random() < 0.5 else "short"
                started[kind] += 1
                at = version
                await asyncio.sleep(LONG_S if kind == "long" else SHORT_S)
                k += 1
                await client.insert(table, rows(1, reservation, prefix=f"r{k}", version=at, task=kind))

        def count(batch) -> None:
            for kind in batch.data.column("task").to_pylist():
                trained[kind] += 1

        async def trainer(done: asyncio.Event) -> None:
            nonlocal version
            while not done.is_set():
                try:
                    count(await client.sample(table, B, timeout=0.05))
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    continue
                version += 1
                await client.set_policy_version(table, version)

        done = asyncio.Event()
        training = asyncio.ensure_future(trainer(done))
        await asyncio.gather(*(producer() for _ in range(producers)))
        done.set()
        await training
        left_over = int((await client.stats(table))[table]["items"])
        if left_over:
            count(await client.sample(table, left_over, timeout=5))
        stats = (await client.stats(table))[table]
        await client.drop_table(table)
    return {"started": started, "trained": trained, "removed_stale": stats["removed_stale"]}


def share(counts: dict) -> float:
    return counts["long"] / max(1, counts["long"] + counts["short"])


def test_pacing_trains_long_tasks_at_their_share_where_eviction_under_trains_them(shared_server, table_name):
    evicting = asyncio.run(run_mix(shared_server.address, table_name + "_evict", paced=False))
    paced = asyncio.run(run_mix(shared_server.address, table_name + "_paced", paced=True))
    for name, run in (("evicting", evicting), ("paced", paced)):
        print(f"{name}: long tasks {share(run['started']):.3f} of those started, "
              f"{share(run['trained']):.3f} of those trained (chi-square {chi_square(run):.1f}): {run}")
    assert paced["trained"] == paced["started"] and paced["removed_stale"] == 0  # exact counts
    assert sum(evicting["started"].values()) == 240 and evicting["removed_stale"] > 0
    assert np.isclose(share(paced["trained"]), share(paced["started"]))
    # evicting: long tasks are trained less than their share started; a chi-square test of
    # independence of (long or short) x (trained or evicted): p < 0.001
    assert share(evicting["trained"]) < share(evicting["started"])
    assert chi_square(evicting) > 10.83


def chi_square(run: dict) -> float:
    observed = np.array([[run["trained"][k], run["started"][k] - run["trained"][k]] for k in ("long", "short")], float)
    expected = observed.sum(1, keepdims=True) * observed.sum(0, keepdims=True) / observed.sum()
    cells = expected > 0  # paced: nothing evicted, an empty column (chi-square 0)
    return float(((observed - expected)[cells] ** 2 / expected[cells]).sum())
