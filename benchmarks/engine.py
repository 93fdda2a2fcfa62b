"""Engine only (in process, no gRPC): prioritized sampling of 256 items from 1M and 10M.

Two measurements per table size N:

- ``Table.sample(256)`` on a generic table (one int64 column, prioritized sampler with
  alpha=0.6, beta=0.4, random priorities, max_size=N, memory budget 1 TiB), built by
  ``Table.insert`` of 1M-row batches (so the payload is N/1M chunks; the sample time
  includes the sum-tree descent, the (chunk, row) sort, times_sampled bookkeeping and
  gathering 256 tiny rows);
- ``expstore.samplers.Prioritized.sample(256)`` alone: the sum tree, nothing else.

Plus ``Table.update_priorities`` of the 256 sampled ids (the trainer's other per-step
call). Each is timed per call with perf_counter; p50/p99 in microseconds. Prints JSON.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import numpy as np
import pyarrow as pa

from expstore.samplers import Prioritized
from expstore.spec import SamplerSpec, TableSpec
from expstore.table import Table

BATCH = 256
BUILD_ROWS = 1_000_000


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


def build_table(n: int, rng: np.random.Generator) -> tuple[Table, float]:
    spec = TableSpec(name="engine", kind="generic", schema=pa.schema([("x", pa.int64())]),
                     sampler=SamplerSpec(type="prioritized", alpha=0.6, beta=0.4),
                     max_size=n, memory_bytes=1 << 40)
    table = Table(spec, seed=0)
    t0 = time.perf_counter()
    for lo in range(0, n, BUILD_ROWS):
        k = min(BUILD_ROWS, n - lo)
        batch = pa.record_batch([pa.array(np.arange(lo, lo + k, dtype=np.int64))], names=["x"])
        table.insert(batch, priorities=rng.random(k) + 0.01, timeout=0)
    return table, time.perf_counter() - t0


def measure(n: int, calls: int) -> dict:
    rng = np.random.default_rng(0)
    table, build_s = build_table(n, rng)
    assert len(table) == n
    out = {"items": n, "table_build_s": build_s}
    out["table_sample"] = _percentiles(_timed(lambda: table.sample(BATCH, timeout=0), calls))
    ids = table.sample(BATCH, timeout=0).item_ids
    out["table_update_priorities"] = _percentiles(
        _timed(lambda: table.update_priorities(ids, rng.random(BATCH) + 0.01), calls))
    del table
    gc.collect()
    sampler = Prioritized(alpha=0.6, beta=0.4)
    t0 = time.perf_counter()
    sampler.insert_priorities(np.arange(n, dtype=np.int64), rng.random(n) + 0.01)
    out["sampler_build_s"] = time.perf_counter() - t0
    out["sampler_sample"] = _percentiles(_timed(lambda: sampler.sample(BATCH, rng), calls))
    return out


def run(quick: bool) -> dict:
    calls = 300 if quick else 2000
    return {str(n): measure(n, calls) for n in (1_000_000, 10_000_000)}


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv)))
