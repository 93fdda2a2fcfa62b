"""7d. Restart of a crashed data dir, with and without journal snapshots (see benchmarks/tiers/__init__.py)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from expstore.journal import Journal
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog

from ..wire import relabel

from .data import BATCH, RESTART_BATCH, RESTART_TOKENS, _du, pool, realistic


# -- 4. restart ---------------------------------------------------------------------------

def _no_snapshots() -> None:
    Journal.wants_snapshot = lambda self: False


def build_restart_dir(data_dir: str, items: int, snapshots: bool) -> None:
    """(Child process) fill a data dir, then exit without closing: a crash."""
    if not snapshots:
        _no_snapshots()
    pool = [realistic(RESTART_BATCH, tokens=RESTART_TOKENS, seed=200 + s, prefix=f"r{s}") for s in range(4)]
    store = Catalog(data_dir)
    # A cache above the data: the samples during the build read memory, not SSD blocks (~0.5 s each).
    table = store.create_table(TableSpec("restart", tiers="ssd", memory_bytes=4 << 30, max_size=items * 2,
                                         sampler=SamplerSpec("uniform")))
    done, i = 0, 0
    t0 = time.perf_counter()
    while done < items:
        k = min(RESTART_BATCH, items - done)
        t = relabel(pool[i % 4], f"r{i}")
        table.insert(t if k == RESTART_BATCH else t.slice(0, k))
        table.sample(BATCH, timeout=0)
        done, i = done + k, i + 1
    build = {"build_s": time.perf_counter() - t0, "inserts": i, "items": len(table),
             "arrow_bytes": int(sum(pool[j % 4].nbytes for j in range(i)))}
    print(json.dumps(build), flush=True)
    os._exit(0)


def _reopen(data_dir: Path) -> tuple[float, dict, float]:
    t0 = time.perf_counter()
    store = Catalog(data_dir)
    seconds = time.perf_counter() - t0
    restored = dict(store.restored["restart"])
    t1 = time.perf_counter()
    store.table("restart").sample(BATCH, timeout=0)
    first_sample = time.perf_counter() - t1
    store.close()
    return seconds, restored, first_sample


def bench_restart(tmp: Path, quick: bool) -> dict:
    items = 100_000 if quick else 1_000_000
    out: dict = {"items": items, "tokens_per_item": RESTART_TOKENS, "rows_per_insert": RESTART_BATCH, "cases": {}}
    original = Journal.wants_snapshot
    cases = (("with snapshots", True), ("no snapshot", False))
    dirs = {case: tmp / f"restart-{'snap' if snapshots else 'nosnap'}" for case, snapshots in cases}
    builders = {case: subprocess.Popen([sys.executable, "-m", "benchmarks.tiers", "--build-restart", str(dirs[case]),
                                        str(items), "1" if snapshots else "0"], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
                for case, snapshots in cases}  # both at once (2 cores): the builds are not what is measured
    built = {}
    for case, proc in builders.items():
        stdout, stderr = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"restart build failed: {stderr[-2000:]}")
        built[case] = json.loads(stdout.strip().splitlines()[-1])
    for case, snapshots in cases:
        d, res = dirs[case], built[case]
        res["disk_bytes"] = _du(d)
        if not snapshots:
            _no_snapshots()  # so that closing the reopened store writes none either
        try:
            s, restored, first = _reopen(d)
            res["crash_restart"] = {"seconds": s, "first_sample_ms": first * 1e3, **restored}
            clean = [_reopen(d) for _ in range(2 if quick else 3)]
            res["clean_restart"] = {"seconds": statistics.median(c[0] for c in clean),
                                    "all_seconds": [c[0] for c in clean],
                                    "first_sample_ms": statistics.median(c[2] for c in clean) * 1e3, **clean[-1][1]}
        finally:
            Journal.wants_snapshot = original
        out["cases"][case] = res
        if snapshots:
            out["checkpoint_dir"] = str(d)
        else:
            shutil.rmtree(d, ignore_errors=True)
    return out


