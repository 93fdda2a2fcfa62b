"""Server memory per stored byte, per table kind.

For each kind (a memory table, ``tiers = "memory"``; the DEFAULT durable table, ``tiers =
"ssd"``), a fresh expstore server (in this process's environment, so ``run`` can compare
glibc malloc settings) gets one trajectory table (uniform sampler, max_size and memory
budget far above the load). Its idle RSS (VmRSS from /proc, after CreateTable) is the
baseline. Then one sync Client inserts batches of 256 x ~36 KiB rows (fresh traj_ids
each) until ``target`` payload bytes are in; after a 1 s pause RSS is read again (by then
the server is at rest and has returned the memory malloc held freed, ``malloc_trim_idle_s``;
VmHWM is the peak under load, with gRPC's receive buffers).
Reported: the payload as the client's Arrow ``nbytes`` and as the server's
``memory_bytes`` stat, the RSS growth over the baseline (and peak VmHWM), and growth /
payload. A durable table holds its rows in its memory cache too, and RocksDB adds its
memtables and block cache (``ROCKSDB_BYTES``: their budget, docs/config.md).
"""

from __future__ import annotations

import json
import sys
import time

from expstore.synthetic import trajectories
from expstore.tiers.rocks import CACHE_BYTES, MEMTABLE_BYTES
from expstore_client import Client

from . import server
from .wire import BATCH, relabel


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} for pid {pid}")


KINDS = {"memory table": "memory", "durable table (ssd, default)": "ssd"}
ROCKSDB_BYTES = MEMTABLE_BYTES + CACHE_BYTES


def run(quick: bool) -> dict:
    return {"kinds": {kind: measure(quick, tiers) for kind, tiers in KINDS.items()}, "rocksdb_bytes": ROCKSDB_BYTES}


def measure(quick: bool, tiers: str) -> dict:
    target = 300e6 if quick else 2e9
    data = trajectories(BATCH, tokens=4096)
    with server.start_expstore() as srv, Client(srv.address) as client:
        client.create_table("mem", sampler="uniform", max_size=10_000_000, memory_bytes=64 << 30, tiers=tiers)
        time.sleep(0.5)
        baseline = srv.rss_bytes()
        arrow_bytes, batches, t0 = 0, 0, time.perf_counter()
        while arrow_bytes < target:
            client.insert("mem", relabel(data, f"m{batches}"))
            arrow_bytes += data.nbytes
            batches += 1
        insert_s = time.perf_counter() - t0
        time.sleep(1.0)
        rss, peak = srv.rss_bytes(), _status(srv.pid, "VmHWM")
        stats = client.stats("mem")["mem"]
    growth = rss - baseline
    return {"items": int(stats["items"]), "batches": batches, "insert_s": insert_s,
            "arrow_nbytes": arrow_bytes, "memory_bytes_stat": int(stats["memory_bytes"]),
            "rss_idle": baseline, "rss_after": rss, "rss_peak": peak, "rss_growth": growth,
            "growth_per_arrow_byte": growth / arrow_bytes,
            "growth_per_stat_byte": growth / max(1, stats["memory_bytes"])}


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv)))
