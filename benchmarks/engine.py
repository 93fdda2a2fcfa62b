"""Engine only (in process, no gRPC): prioritized sampling of 256 items from 1M and 10M.

Per table size N and table kind (a memory table, ``tiers = "memory"``; and the DEFAULT
durable table, ``tiers = "ssd"`` in a temporary data dir, whose every sample appends a
'sampled' record to its journal at durability wal):

- ``Table.sample(256)`` on a generic table (one int64 column, prioritized sampler with
  alpha=0.6, beta=0.4, random priorities, max_size=N), built by ``Table.insert`` of
  1M-row batches (so the payload is N/1M chunks; the sample time includes the lock, the
  sum-tree descent, the (chunk, row) sort, times_sampled bookkeeping, the journal record
  of a durable table, the read plan and gathering 256 tiny rows);
- ``Table.update_priorities`` of the 256 sampled ids (the trainer's other per-step call);
- once per N, ``expstore.samplers.Prioritized.sample(256)`` alone: the sum tree.

Each is timed per call with perf_counter; p50/p99 in microseconds. ``--quick`` measures
the durable table at 1M only. Prints JSON.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from expstore.samplers import Prioritized
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.table import Table

BATCH = 256
BUILD_ROWS = 1_000_000
KINDS = {"memory table": "memory", "durable table (ssd, default)": "ssd"}


def _percentiles(times: list[float]) -> dict:
    us = np.array(times) * 1e6
    return {"calls": len(us), "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean())}


def _timed(fn, calls: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def build_table(n: int, rng: np.random.Generator, store: Catalog | None = None) -> tuple[Table, float]:
    """A prioritized generic table of n items: a memory table, or one in ``store``."""
    spec = TableSpec(name="engine", kind="generic", schema=pa.schema([("x", pa.int64())]),
                     sampler=SamplerSpec(type="prioritized", alpha=0.6, beta=0.4),
                     max_size=n, memory_bytes=1 << 40, tiers="memory" if store is None else "ssd")
    table = Table(spec, seed=0) if store is None else store.create_table(spec)
    t0 = time.perf_counter()
    for lo in range(0, n, BUILD_ROWS):
        k = min(BUILD_ROWS, n - lo)
        batch = pa.record_batch([pa.array(np.arange(lo, lo + k, dtype=np.int64))], names=["x"])
        table.insert(batch, priorities=rng.random(k) + 0.01, timeout=0)
    return table, time.perf_counter() - t0


def measure_table(n: int, calls: int, tiers: str) -> dict:
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="expstore-engine-")) if tiers != "memory" else None
    store = Catalog(tmp) if tmp is not None else None
    try:
        table, build_s = build_table(n, rng, store)
        if store is not None:
            store.wait_for_snapshots()  # the build's snapshot is written off the lock: not during the samples
        assert len(table) == n
        out = {"items": n, "table_build_s": build_s}
        out["table_sample"] = _percentiles(_timed(lambda: table.sample(BATCH, timeout=0), calls))
        ids = table.sample(BATCH, timeout=0).item_ids
        out["table_update_priorities"] = _percentiles(
            _timed(lambda: table.update_priorities(ids, rng.random(BATCH) + 0.01), calls))
        del table
    finally:
        if store is not None:
            store.close()
            shutil.rmtree(tmp, ignore_errors=True)
        gc.collect()
    return out


def measure_sampler(n: int, calls: int) -> dict:
    rng = np.random.default_rng(0)
    sampler = Prioritized(alpha=0.6, beta=0.4)
    t0 = time.perf_counter()
    sampler.insert_priorities(np.arange(n, dtype=np.int64), rng.random(n) + 0.01)
    return {"sampler_build_s": time.perf_counter() - t0,
            "sampler_sample": _percentiles(_timed(lambda: sampler.sample(BATCH, rng), calls))}


def run(quick: bool) -> dict:
    calls = 300 if quick else 2000
    out: dict = {}
    for n in (1_000_000, 10_000_000):
        out[str(n)] = {**measure_table(n, calls, "memory"), **measure_sampler(n, calls), "kinds": {}}
        for kind, tiers in KINDS.items():
            if tiers == "memory":
                m = out[str(n)]
            elif quick and n > 1_000_000:
                continue
            else:
                m = measure_table(n, calls, tiers)
            out[str(n)]["kinds"][kind] = {k: m[k] for k in ("table_sample", "table_update_priorities",
                                                            "table_build_s")}
    return out


if __name__ == "__main__":
    from expstore_server.main import keep_freed_memory
    keep_freed_memory()  # as the server does by default
    print(json.dumps(run("--quick" in sys.argv)))
