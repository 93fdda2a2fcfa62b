"""7b. sample(256) and a consumer group's stream from memory, SSD and remote (see benchmarks/tiers/__init__.py)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.tiers.remote import RemoteTier

from .data import BATCH, MiB, _labelled, _pct, _timed, pool


# -- 2. sample ----------------------------------------------------------------------------

def bench_sample(tmp: Path, quick: bool) -> dict:
    """Four tables of the same rows. memory and ssd are sampled as inserted; the remote
    ones are demoted, then the store is closed and reopened (the memory tier starts
    empty, as after any restart), so their first sample reads the remote tier."""
    n_batches = 12 if quick else 32
    calls = {"memory": 100 if quick else 300, "ssd": 10 if quick else 30, "remote": 50 if quick else 200,
             "remote_cold": 3 if quick else 4}
    data = pool()
    root = tmp / "sample"
    remote_uri = f"file://{root}/remote"
    open_store = lambda: Catalog(root / "data", remote=lambda name: RemoteTier(remote_uri, name))
    big, tiny = 8 << 30, 1 * MiB
    specs = {"memory": dict(tiers="ssd", memory_bytes=big),
             "ssd": dict(tiers="ssd", memory_bytes=tiny),
             "remote": dict(tiers="remote", memory_bytes=big, ssd_bytes=tiny),
             "remote_cold": dict(tiers="remote", memory_bytes=tiny, ssd_bytes=tiny)}
    out: dict = {"items": n_batches * BATCH, "arrow_bytes": sum(data[i % 4].nbytes for i in range(n_batches)),
                 "tables": {}}
    tables = out["tables"]

    def where(table) -> dict:
        s = table.stats()
        return {k: s.get(k, 0) for k in ("items_memory", "items_ssd", "items_remote", "memory_bytes", "ssd_bytes",
                                         "remote_bytes", "evictions", "promotions")}

    def measure(table, name: str) -> None:
        res = tables[name]
        res["before"] = where(table)
        sample = lambda: table.sample(BATCH, timeout=0)
        if name == "remote":
            res["first"] = _pct(_timed(sample, 1))
            res["after_first"] = where(table)
            res["steady"] = _pct(_timed(sample, calls[name]))
        elif name == "remote_cold":
            res["cold"] = _pct(_timed(sample, calls[name]))
        else:
            sample()  # warm-up
            res["steady"] = _pct(_timed(sample, calls[name]))
            # a consumer group reading the table once through, acking each batch
            read = lambda: table.ack("g", table.stream("g", BATCH, timeout=0).item_ids)  # noqa: E731
            res["stream"] = _pct(_timed(read, len(table) // BATCH))
        res["after"] = where(table)

    store = open_store()
    try:
        for name, kw in specs.items():
            table = store.create_table(TableSpec(name, max_size=10_000_000, sampler=SamplerSpec("uniform"), **kw))
            labelled = _labelled(data, n_batches, name)
            t0 = time.perf_counter()
            for batch in labelled:
                table.insert(batch)
            tables[name] = {"insert_s": time.perf_counter() - t0}
            if kw["tiers"] == "remote":
                t0, moved = time.perf_counter(), 0
                while (k := table.demote()):
                    moved += k
                tables[name].update(demote_s=time.perf_counter() - t0, demoted_chunks=moved)
            else:
                measure(table, name)
        store.close()
        t0 = time.perf_counter()
        store = open_store()
        out["reopen_s"] = time.perf_counter() - t0
        for name in ("remote", "remote_cold"):
            measure(store.table(name), name)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


