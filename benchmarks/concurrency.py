"""Many concurrent producers: 1,000 and 10,000 asyncio tasks over a handful of AsyncClient channels.

One fresh expstore server; one trajectory table (uniform, max_size above the load). In
one event loop, ``producers`` tasks share ``channels`` AsyncClients (task i uses client
i % channels); each inserts ``calls`` batches of ``rows`` ~300 B rows (fresh traj_ids)
back to back. The clients are the defaults, which send the small inserts tasks make while
4 of the table's are on the wire as one call (docs/rpc.md#merged-inserts): the
Insert calls the server got (``rpcs``, from its audit log) are reported beside the
producers' inserts. All start together; reported: total items/s over the wall time from the
start to the last insert, per-insert latency p50/p99/max, errors (any exception), and a
check that the table holds every row. The same producers then run against the raw gRPC
server of ``raw_grpc`` (grpc.aio channels, each call one unary ``Put`` of one message
the size of the batch's Arrow IPC stream, as the client sends such an insert:
InsertUnary): the ceiling for this call mix; the 10,000 at once also as client-streaming
``Upload`` calls of that one message (Insert's shape, which gRPC moves with more work).
The 10,000-producer row (``TEN_K``: one insert each, 16 channels) runs on a fresh server
with the DEFAULT durable table, directly (no batcher), against its own raw ceiling; then
again with the inserts spread over a window (``run``). Its bursts also report the CPU
each call cost the server process (all its threads) and this client process
(``cpu_ms_per_call``): on a machine whose cores the client shares with the server, calls/s
follow the two together, and the CPU per call varies less from run to run than calls/s.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Awaitable, Callable

import grpc
import numpy as np

from expstore_proto import arrow_ipc
from expstore.synthetic import trajectories
from expstore_client import AsyncClient

from . import raw_grpc, server
from .agentic_scale import cpu_seconds, own_cpu_seconds
from .wire import relabel


async def _drive(producers: int, calls: int, call: Callable[[int, int], Awaitable], spread_s: float = 0.0) -> dict:
    """Run ``call(i, j)`` for j in range(calls) in each of ``producers`` tasks, all released
    at once; with ``spread_s``, each task first waits a uniformly random part of it (an
    environment step in progress), which offers ``producers / spread_s`` calls/s."""
    go = asyncio.Event()
    latencies: list[float] = []
    errors: list[str] = []
    delays = np.random.default_rng(0).uniform(0.0, spread_s, producers) if spread_s else np.zeros(producers)

    async def produce(i: int) -> None:
        await go.wait()
        if delays[i]:
            await asyncio.sleep(delays[i])
        for j in range(calls):
            t0 = time.perf_counter()
            try:
                await call(i, j)
                latencies.append(time.perf_counter() - t0)
            except Exception as e:  # counted, not raised: the figure is the error count
                details = e.details() if isinstance(e, grpc.aio.AioRpcError) else e
                errors.append(f"{type(e).__name__}: {details}")

    tasks = [asyncio.create_task(produce(i)) for i in range(producers)]
    await asyncio.sleep(0.1)
    start = time.perf_counter()
    go.set()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    lat = np.array(latencies) * 1e3 if latencies else np.zeros(1)
    return {"wall_s": wall, "inserts": len(latencies), "calls_per_s": len(latencies) / wall,
            "latency_ms": {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
                           "max": float(lat.max())},
            "errors": len(errors), "error_samples": sorted(set(errors))[:5]}


async def _producers(address: str, producers: int, channels: int, calls: int, rows: int,
                     spread_s: float = 0.0) -> dict:
    clients = [AsyncClient(address) for _ in range(channels)]
    await clients[0].create_table("conc", sampler="uniform", max_size=10_000_000, memory_bytes=16 << 30)
    data = trajectories(rows, tokens=20)
    out = await _drive(producers, calls,
                       lambda i, j: clients[i % channels].insert("conc", relabel(data, f"p{i}-{j}")), spread_s)
    stored = int((await clients[0].stats("conc"))["conc"]["items"])
    for c in clients:
        await c.close()
    return {"producers": producers, "channels": channels, "calls_per_producer": calls, "rows_per_call": rows,
            "arrow_bytes_per_row": data.nbytes / rows, **out, "items_per_s": out["calls_per_s"] * rows,
            "stored_items": stored, "expected_items": producers * calls * rows}


async def _batched_producers(address: str, producers: int, channels: int, calls: int, rows: int) -> dict:
    """The same producers through one InsertBatcher per channel (5 ms linger)."""
    clients = [AsyncClient(address) for _ in range(channels)]
    await clients[0].create_table("conc_batched", sampler="uniform", max_size=10_000_000, memory_bytes=16 << 30)
    batchers = [c.batcher("conc_batched", linger_s=0.005, max_rows=2048) for c in clients]
    data = trajectories(rows, tokens=20)
    out = await _drive(producers, calls,
                       lambda i, j: batchers[i % channels].insert(relabel(data, f"b{i}-{j}")))
    stored = int((await clients[0].stats("conc_batched"))["conc_batched"]["items"])
    rpcs = sum(b.calls for b in batchers)
    for c in clients:
        await c.close()
    return {**out, "items_per_s": out["calls_per_s"] * rows, "stored_items": stored,
            "expected_items": producers * calls * rows, "rpcs": rpcs}


async def _raw_producers(address: str, producers: int, channels: int, calls: int, rows: int,
                         spread_s: float = 0.0, unary: bool = False) -> dict:
    """The producers against the raw server: each call one client-streaming ``Upload`` of
    one message; or, with ``unary``, one unary ``Put``."""
    chans = [grpc.aio.insecure_channel(address, raw_grpc.OPTIONS) for _ in range(channels)]
    message = bytes(len(arrow_ipc.encode(trajectories(rows, tokens=20))))
    stubs = [c.unary_unary(f"/{raw_grpc.SERVICE}/Put") if unary else c.stream_unary(f"/{raw_grpc.SERVICE}/Upload")
             for c in chans]
    out = await _drive(producers, calls,
                       lambda i, j: stubs[i % channels](message if unary else iter([message]), timeout=60), spread_s)
    for c in chans:
        await c.close()
    return {"message_bytes": len(message), **out, "items_per_s": out["calls_per_s"] * rows}


def with_cpu(srv: server.ServerProcess, burst: Callable[[], dict]) -> dict:
    """``burst()``'s figures and the CPU ms per call it cost the server and this process."""
    before = cpu_seconds(srv.pid), own_cpu_seconds()
    out = burst()
    calls = max(out["inserts"], 1)
    out["cpu_ms_per_call"] = {"server": 1e3 * (cpu_seconds(srv.pid) - before[0]) / calls,
                              "client": 1e3 * (own_cpu_seconds() - before[1]) / calls}
    return out


TEN_K = dict(producers=10_000, channels=16, calls=1, rows=8)
PACED_SHARE = 0.5  # the paced 10,000 producers offer this share of the raw burst's calls/s


def run(quick: bool) -> dict:
    """Besides the bursts (every producer at once: their p99 is the time to drain the
    burst, ``producers / calls_per_s``, for the raw server too), 10,000 producers whose
    inserts are spread over a window that offers ``PACED_SHARE`` of the raw burst's
    calls/s: the latency a producer sees at a load the server is asked to sustain."""
    shape = dict(producers=1000, channels=8, calls=3 if quick else 10, rows=8)
    with server.start_expstore() as srv:
        out = asyncio.run(_producers(srv.address, **shape))
        out["rpcs"] = srv.audited_calls("Insert", "conc")
        out["batched"] = asyncio.run(_batched_producers(srv.address, **shape))
    with server.start_expstore() as srv:
        out["10k"] = with_cpu(srv, lambda: asyncio.run(_producers(srv.address, **TEN_K)))
        out["10k"]["rpcs"] = srv.audited_calls("Insert", "conc")
    with raw_grpc.start() as srv:  # unary calls, as the client sends an insert of one message
        out["raw"] = asyncio.run(_raw_producers(srv.address, **shape, unary=True))
        out["10k"]["raw"] = with_cpu(srv, lambda: asyncio.run(_raw_producers(srv.address, **TEN_K, unary=True)))
        out["10k"]["raw_stream"] = with_cpu(srv, lambda: asyncio.run(_raw_producers(srv.address, **TEN_K)))
        spread_s = TEN_K["producers"] / (PACED_SHARE * out["10k"]["raw"]["calls_per_s"])
        paced_raw = asyncio.run(_raw_producers(srv.address, **TEN_K, spread_s=spread_s, unary=True))
    with server.start_expstore() as srv:
        out["10k_paced"] = asyncio.run(_producers(srv.address, **TEN_K, spread_s=spread_s))
        out["10k_paced"]["rpcs"] = srv.audited_calls("Insert", "conc")
    out["10k_paced"].update(raw=paced_raw, spread_s=spread_s, offered_calls_per_s=TEN_K["producers"] / spread_s)
    return out


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv)))
