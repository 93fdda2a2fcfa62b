"""7a. Inserts into durable and memory tables against raw writes of the same stored bytes
(see benchmarks/tiers/__init__.py): RocksDB puts for chunks under ``FILE_BYTES``, one file
per insert for larger ones, as the SSD tier stores each."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from rocksdict import WriteBatch

from expstore import codec
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.tiers.rocks import FILE_BYTES

from .data import BATCH, MiB, SIZES, TOKENS, _batch, _labelled, _pct, _raw_db, blocks, pool, realistic


# -- 1. insert ----------------------------------------------------------------------------

def _insert_expstore(root: Path, pool: list[pa.Table], n: int, tiers: str, durability: str | None,
                     threads: int = 1) -> dict:
    pool = _labelled(pool, n + 1, "ins")  # built before the clock starts
    store = Catalog(root / "data")
    table = store.create_table(TableSpec("ins", tiers=tiers, memory_bytes=256 * MiB if tiers != "memory" else 64 << 30,
                                         max_size=10_000_000, sampler=SamplerSpec("uniform")))
    table.insert(pool[n], durability=durability)  # warm-up
    lat: list[float] = []
    syncs = store.db.syncs

    def work(k: int, offset: int):
        for i in range(k):
            t0 = time.perf_counter()
            table.insert(pool[offset + i], durability=durability)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    _run_threads(work, n, threads)
    wall = time.perf_counter() - t0
    items, syncs = len(table), store.db.syncs - syncs
    store.close()
    assert items == (n + 1) * pool[0].num_rows, items
    return {"wall_s": wall, "batches": n, "latency": _pct(lat), "fsyncs": syncs}


def _insert_raw(root: Path, encoded: list[list[bytes]], n: int, sync: bool, threads: int = 1,
                in_files: bool = False) -> dict:
    """The ceiling: the same stored values (``codec.encode_block`` of each block, done
    before the clock starts) as the SSD tier stores them, one insert at a time: under the
    same keys, one WriteBatch per insert; or (``in_files``, chunks of at least
    FILE_BYTES) as one chunk file per insert (``ChunkFiles``, fdatasync'd with ``sync``)
    and a 40-byte meta put. The log is fsync'd with ``sync``."""
    db, family = _raw_db(root / "raw")
    h = db.handle[family]
    files = db.chunk_files(1)
    written = [codec.SerializedBlocks(e) for e in encoded] if in_files else []  # checksummed now, off the clock
    counter = iter(range(1 << 40))
    lock = threading.Lock()
    lat: list[float] = []

    def one(i: int):
        with lock:
            chunk = next(counter)
        wb = WriteBatch(raw_mode=True)
        prefix = (1).to_bytes(4, "big") + chunk.to_bytes(8, "big")
        if in_files:
            files.write(chunk, written[i % len(written)], sync=sync)
        else:
            for j, v in enumerate(encoded[i % len(encoded)]):
                wb.put(prefix + j.to_bytes(4, "big"), v, h)
        wb.put(prefix + b"\xff\xff\xff\xff", b"x" * 40, h)
        db.write(wb, "wal")
        if sync:
            db.sync()

    def work(k: int, offset: int):
        for i in range(k):
            t0 = time.perf_counter()
            one(offset + i)
            lat.append(time.perf_counter() - t0)

    one(0)  # warm-up
    t0 = time.perf_counter()
    _run_threads(work, n, threads)
    wall = time.perf_counter() - t0
    db.close()
    return {"wall_s": wall, "batches": n, "latency": _pct(lat)}


def _run_threads(work, n: int, threads: int) -> None:
    if threads == 1:
        work(n, 0)
        return
    per = [n // threads + (i < n % threads) for i in range(threads)]
    ts = [threading.Thread(target=work, args=(k, sum(per[:i]))) for i, k in enumerate(per)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _insert_configs(data: list[pa.Table], encoded: list[list[bytes]], n: int) -> dict:
    """name -> (run(dir), the ceiling it is compared with): the raw writes of the kind the
    SSD tier makes for chunks of this size, and, for chunk files, raw RocksDB puts of the
    same values too (what the SSD tier wrote before chunk files)."""
    ssd = "durable table (ssd, default)"
    in_files = data[0].get_total_buffer_size() >= FILE_BYTES
    raw = "raw chunk file" if in_files else "raw RocksDB put"
    configs = {
        f"{raw} (WAL)": (lambda d: _insert_raw(d, encoded, n, sync=False, in_files=in_files), None),
        f"{raw} + fsync": (lambda d: _insert_raw(d, encoded, n, sync=True, in_files=in_files), None),
    }
    if in_files:
        configs["raw RocksDB put (WAL)"] = (lambda d: _insert_raw(d, encoded, n, sync=False), None)
    return {
        **configs,
        f"{ssd}, wal (default)": (lambda d: _insert_expstore(d, data, n, "ssd", "wal"), f"{raw} (WAL)"),
        f"{ssd}, fsync": (lambda d: _insert_expstore(d, data, n, "ssd", "fsync"), f"{raw} + fsync"),
        f"{ssd}, memory": (lambda d: _insert_expstore(d, data, n, "ssd", "memory"), f"{raw} (WAL)"),
        "memory table": (lambda d: _insert_expstore(d, data, n, "memory", None), f"{raw} (WAL)"),
        f"{raw} + fsync, 4 threads": (lambda d: _insert_raw(d, encoded, n, sync=True, threads=4, in_files=in_files),
                                      None),
        f"{ssd}, wal, 4 threads": (lambda d: _insert_expstore(d, data, n, "ssd", "wal", threads=4), f"{raw} (WAL)"),
        f"{ssd}, fsync, 4 threads": (lambda d: _insert_expstore(d, data, n, "ssd", "fsync", threads=4),
                                     f"{raw} + fsync, 4 threads"),
    }


def _in_fresh_dir(tmp: Path, fn) -> dict:
    d = Path(tempfile.mkdtemp(dir=tmp, prefix="ins-"))
    try:
        return fn(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def bench_insert(tmp: Path, quick: bool) -> dict:
    """Per row size: every config (``_insert_configs``) in a fresh data dir, the configs
    alternating within each round; the median round of each. A discarded run of the first
    config comes first: the run's first writes pay for memory the VM has not touched yet
    (measured: a raw chunk-file insert 21 ms, p99 100 ms, where the same config took 7.6
    to 9.5 ms once warm)."""
    out: dict = {"sizes": {}}
    for size, tokens in SIZES.items():
        data = pool() if tokens == TOKENS else [realistic(BATCH, tokens=tokens, seed=s, prefix=f"s{s}") for s in range(4)]
        batches = [_batch(t) for t in data]
        encoded = [[codec.encode_block(b).to_pybytes() for b in blocks(rb)] for rb in batches]
        arrow = float(np.mean([t.nbytes for t in data]))
        stored = float(np.mean([sum(map(len, e)) for e in encoded]))
        rounds, n = (1, 5) if quick else (3, 12)
        if tokens != TOKENS:
            n *= 8  # small inserts: more of them
        configs = _insert_configs(data, encoded, n)
        runs: dict[str, list[dict]] = {k: [] for k in configs}
        _in_fresh_dir(tmp, next(iter(configs.values()))[0])  # the warm-up, discarded
        for _ in range(rounds):
            for name, (fn, _) in configs.items():
                runs[name].append(_in_fresh_dir(tmp, fn))
        res = {"arrow_bytes_per_batch": arrow, "stored_bytes_per_batch": stored, "rows_per_batch": BATCH,
               "batches_per_round": n, "rounds": rounds, "order": list(configs), "configs": {}}
        for name, rs in runs.items():
            r = sorted(rs, key=lambda x: x["wall_s"])[len(rs) // 2]
            res["configs"][name] = {"items_per_s": BATCH * n / r["wall_s"], "MB_per_s": arrow * n / r["wall_s"] / 1e6,
                                    "latency": r["latency"], "ceiling": configs[name][1],
                                    "fsyncs": r.get("fsyncs"), "rounds_wall_s": [x["wall_s"] for x in rs]}
        out["sizes"][size] = res
    return out


