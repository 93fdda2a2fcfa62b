"""How long a table's journal snapshot makes its other calls wait: a sampler's latency
while inserts into a large durable table make snapshots fall due, with snapshots written
on the catalog's snapshot thread (the default) and, as the baseline in the same run,
written by the inserting call under the table lock (as before).

In process (no gRPC): a default durable table (``tiers = "ssd"``) filled with ``--items``
rows of ~300 B (20 tokens), 256 an insert; then a thread samples 64 rows one call at a
time while the main thread inserts ``--inserts`` more batches (the table stays full: the
oldest items leave). Reported per mode: sampler p50 / p99 / p99.9 / max, the snapshots
taken, the time each held the table lock (capture, or capture + pack + write in the
baseline) and, on the writer thread, the pack and write. A shared 2-core machine gives
noisy tails: compare the two modes of one run.

``python -m benchmarks.snapshot_stall [--items N] [--inserts N]`` prints its table on
stderr and its JSON on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from unittest import mock

import numpy as np

from expstore import recovery
from expstore.catalog import Catalog
from expstore.journal import Journal
from expstore.spec import TableSpec
from expstore.synthetic import trajectories

from .report import _f, _table
from .wire import relabel

MODES = ("writer thread", "under the lock")


def one_mode(mode: str, items: int, inserts: int) -> dict:
    held, written = [], []
    fields, write = recovery.snapshot_fields, Journal._write

    def timed_fields(table):
        t0 = time.perf_counter()
        out = fields(table)
        held.append(time.perf_counter() - t0)
        return out

    def timed_write(journal, state, upto):
        t0 = time.perf_counter()
        write(journal, state, upto)
        written.append(time.perf_counter() - t0)

    def under_the_lock(journal, state):  # the baseline: the caller writes it, lock held
        t0 = time.perf_counter()
        journal.write_snapshot(state)
        held[-1] += time.perf_counter() - t0

    patches = [mock.patch.object(recovery, "snapshot_fields", timed_fields),
               mock.patch.object(Journal, "_write", timed_write)]
    if mode == "under the lock":
        patches.append(mock.patch.object(Journal, "snapshot", under_the_lock))
    data = trajectories(256, tokens=20)
    with tempfile.TemporaryDirectory(prefix="expstore-snapstall-") as tmp:
        store = Catalog(f"{tmp}/d")
        t = store.create_table(TableSpec("s", max_size=items))
        for i in range(items // 256):
            t.insert(relabel(data, f"f{i}"))
        latencies, stop = [], threading.Event()

        def sampler():
            while not stop.is_set():
                t0 = time.perf_counter()
                t.sample(64)
                latencies.append(time.perf_counter() - t0)

        for p in patches:
            p.start()
        try:
            thread = threading.Thread(target=sampler)
            thread.start()
            for i in range(inserts):
                t.insert(relabel(data, f"g{i}"))
            stop.set()
            thread.join()
            store.close()  # writes the snapshots still queued
        finally:
            for p in patches:
                p.stop()
    lat = np.array(latencies) * 1e3
    return {"samples": len(lat), "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "p999_ms": float(np.percentile(lat, 99.9)), "max_ms": float(lat.max()), "snapshots": len(written),
            "held_ms_max": 1e3 * max(held, default=0.0),
            "writer_ms_max": 1e3 * max(written, default=0.0) if mode == "writer thread" else None}


def run(items: int, inserts: int) -> dict:
    return {"items": items, "inserts": inserts, "modes": {mode: one_mode(mode, items, inserts) for mode in MODES}}


def render(result: dict) -> str:
    rows = [[mode, str(r["samples"]), _f(r["p50_ms"], 1), _f(r["p99_ms"], 1), _f(r["p999_ms"], 1),
             _f(r["max_ms"], 1), str(r["snapshots"]), _f(r["held_ms_max"], 1),
             "-" if r["writer_ms_max"] is None else _f(r["writer_ms_max"], 1)]
            for mode, r in result["modes"].items()]
    return (f"snapshot stall: sample(64) while {result['inserts']} inserts of 256 x ~300 B go into a full "
            f"durable table of {result['items']:,} items\n"
            + _table(["snapshots written", "samples", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "snapshots",
                      "lock held, worst ms", "writer, worst ms"], rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks.snapshot_stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--inserts", type=int, default=400)
    args = p.parse_args(argv)
    result = run(args.items, args.inserts)
    print(render(result), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
