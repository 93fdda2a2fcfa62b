"""Durable tables, in process (no gRPC): insert, sample, codec, restart, checkpoint.

Five measurements, each against a ceiling measured in the same run where one exists:

1. insert: batches of 256 trajectories (realistic tokens, below) of ~36 KiB and of ~300 B
   rows into a fresh table of each kind: the DEFAULT durable table (tiers "ssd", memory
   cache 256 MiB) at durability wal (its default), fsync and memory, and a memory table
   (tiers "memory"); then 4 threads at wal and at fsync (group commit: the fsyncs run are
   counted). Ceilings: raw writes of the same stored values under the same keys to a
   RocksDB with the engine's options (``Database``: blob files, LZ4 at flush), one
   WriteBatch per insert, the log unsynced or synced per batch (1 and 4 threads). Each
   config gets its own data dir; configs alternate per round; median of rounds.
2. sample(256), uniform, p50/p99 when the data sits in memory (durable table, cache
   larger than the data), on the SSD only (cache of 1 MiB: every sample reads RocksDB
   blocks; the OS page cache is warm, as it is right after the inserts), then a consumer
   group streaming the table once through (``stream(256)`` + ``ack``), and on the
   remote tier (file:// Lance under the temp dir; ssd_bytes 1 MiB, ``demote`` until 0).
   A remote read promotes whole chunks into memory, so: the first sample (cold), the
   steady state after it (cache larger than the data), and with a 1 MiB cache (every
   sample cold).
3. the SSD tier's blocks (``codec.encode_block``/``decode_block``: IPC messages; the CRC32
   check on decode) against one whole-batch IPC stream with Arrow's zstd (``_ipc_stream``):
   MB/s of Arrow bytes, on one 256-row batch whole and in the SSD tier's ~64 KiB blocks,
   realistic tokens vs the uniform tokens of ``expstore.synthetic``; the ratio of the
   blocks is that of the files after RocksDB's LZ4 (written to a Database and flushed).
4. restart of 1M items (64 tokens each; --quick: 100k): a child process builds each data
   dir (the two at once) (inserts of 2048 rows, one sample(256) after each) and exits without closing (a
   crash); ``Catalog(data_dir)`` is timed on the crash restart, then on clean restarts.
   Once with the journal's own snapshots, once with snapshots turned off for the whole
   life of the dir (``Journal.wants_snapshot`` patched in this process and the child):
   every record replayed.
5. ``Checkpointer.create`` to a file:// remote vs fsspec ``put`` (local copy) of a
   RocksDB checkpoint of the same database; and, if ``moto_server`` starts, the same
   against S3 on 127.0.0.1 (moto keeps objects in memory, in its own process).

"Realistic" token data: token ids drawn i.i.d. from a Zipf law (s = 1.1) over a
151,936-id vocabulary (Qwen2's), ranks shuffled onto ids; logprobs float32 <= 0 (as
``synthetic``: -Exp(1) on completion tokens, 0 on the prompt). Real text also repeats
n-grams, which zstd would find too: these ratios are a floor. Runs with glibc's large
buffers kept (``keep_freed_memory``), as the server does by default. Prints JSON on its
last stdout line and the tables (``render``) on stderr.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
from rocksdict import WriteBatch

from expstore import codec
from expstore.checkpoint import Checkpointer
from expstore.journal import Journal
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.tiers.remote import SealedObjects, RemoteTier
from expstore.tiers.rocks import BLOCK_BYTES, CHUNK_FAMILY, Database
from expstore_server.main import keep_freed_memory

from .report import _f, _table
from .wire import relabel

BATCH = 256
TOKENS = 4096          # ~36 KiB a row
VOCAB = 151_936
ZIPF_S = 1.1
RESTART_TOKENS = 64
RESTART_BATCH = 2048   # ~1.4 MB chunks: above the 1 MiB small-chunk merge threshold
MiB = 1 << 20

# -- data ---------------------------------------------------------------------------------

_ZIPF: tuple[np.ndarray, np.ndarray] | None = None


def zipf_tokens(total: int, rng: np.random.Generator) -> np.ndarray:
    """``total`` int32 token ids, i.i.d. Zipf(s=ZIPF_S) over VOCAB ids (rank -> id shuffled)."""
    global _ZIPF
    if _ZIPF is None:
        p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF_S
        _ZIPF = (np.cumsum(p / p.sum()), np.random.default_rng(12345).permutation(VOCAB).astype(np.int32))
    cdf, ids = _ZIPF
    return ids[np.minimum(np.searchsorted(cdf, rng.random(total)), VOCAB - 1)]


def realistic(n: int, tokens: int = TOKENS, seed: int = 0, prefix: str = "t") -> pa.Table:
    """``synthetic.trajectories`` (uniform tokens in [0, 50k)) with the tokens replaced."""
    t = trajectories(n, tokens=tokens, seed=seed, id_prefix=prefix)
    col = t.column("tokens").combine_chunks()
    values = zipf_tokens(len(col.values), np.random.default_rng(seed + 1))
    new = pa.ListArray.from_arrays(col.offsets, pa.array(values, pa.int32()))
    i = t.schema.get_field_index("tokens")
    return t.set_column(i, t.schema.field(i), new)


_POOL: list[pa.Table] = []


def pool() -> list[pa.Table]:
    """Four distinct 256-row realistic batches, built once (~1 s each), reused by 7a and 7b."""
    if not _POOL:
        _POOL.extend(realistic(BATCH, seed=s, prefix=f"p{s}") for s in range(4))
    return _POOL


def blocks(batch: pa.RecordBatch) -> list[pa.RecordBatch]:
    """The slices the SSD tier encodes one value each (RocksTier.encode's rule)."""
    n = batch.num_rows
    step = max(1, BLOCK_BYTES // max(1, batch.get_total_buffer_size() // max(1, n)))
    return [batch.slice(lo, min(step, n - lo)) for lo in range(0, n, step)]


def _batch(t: pa.Table) -> pa.RecordBatch:
    return t.combine_chunks().to_batches()[0]


def _pct(times: list[float]) -> dict:
    ms = np.array(times) * 1e3
    return {"calls": len(ms), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "max_ms": float(ms.max())}


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _raw_db(path: Path) -> tuple[Database, str]:
    """A RocksDB with the engine's options (``Database``: blob files, LZ4 at flush, the
    memtable budget) and one table's chunk family, for raw writes."""
    db = Database(path)
    return db, db.family(f"{CHUNK_FAMILY}1")


# -- 1. insert ----------------------------------------------------------------------------

SIZES = {"36 KiB": TOKENS, "300 B": 20}  # row size -> tokens per row (benchmarks.wire's sizes)
KINDS = {"durable table (ssd, default)": "ssd", "memory table": "memory"}


def _labelled(data: list[pa.Table], n: int, prefix: str) -> list[pa.Table]:
    """n batches cycling over ``data`` with fresh traj_ids (the key of trajectory tables)."""
    return [relabel(data[i % len(data)], f"{prefix}{i}") for i in range(n)]


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


def _insert_raw(root: Path, encoded: list[list[bytes]], n: int, sync: bool, threads: int = 1) -> dict:
    """The ceiling: the same stored values (``codec.encode_block`` of each block, done
    before the clock starts) under the same keys, one WriteBatch per insert."""
    db, family = _raw_db(root / "raw")
    h = db.handle[family]
    counter = iter(range(1 << 40))
    lock = threading.Lock()
    lat: list[float] = []

    def one(i: int):
        with lock:
            chunk = next(counter)
        wb = WriteBatch(raw_mode=True)
        prefix = (1).to_bytes(4, "big") + chunk.to_bytes(8, "big")
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
    """name -> (run(dir), the ceiling it is compared with)."""
    ssd = "durable table (ssd, default)"
    return {
        "raw RocksDB put (WAL)": (lambda d: _insert_raw(d, encoded, n, sync=False), None),
        "raw RocksDB put + fsync": (lambda d: _insert_raw(d, encoded, n, sync=True), None),
        f"{ssd}, wal (default)": (lambda d: _insert_expstore(d, data, n, "ssd", "wal"), "raw RocksDB put (WAL)"),
        f"{ssd}, fsync": (lambda d: _insert_expstore(d, data, n, "ssd", "fsync"), "raw RocksDB put + fsync"),
        f"{ssd}, memory": (lambda d: _insert_expstore(d, data, n, "ssd", "memory"), "raw RocksDB put (WAL)"),
        "memory table": (lambda d: _insert_expstore(d, data, n, "memory", None), "raw RocksDB put (WAL)"),
        "raw RocksDB put + fsync, 4 threads": (lambda d: _insert_raw(d, encoded, n, sync=True, threads=4), None),
        f"{ssd}, wal, 4 threads": (lambda d: _insert_expstore(d, data, n, "ssd", "wal", threads=4),
                                   "raw RocksDB put (WAL)"),
        f"{ssd}, fsync, 4 threads": (lambda d: _insert_expstore(d, data, n, "ssd", "fsync", threads=4),
                                     "raw RocksDB put + fsync, 4 threads"),
    }


def bench_insert(tmp: Path, quick: bool) -> dict:
    """Per row size: every config (``_insert_configs``) in a fresh data dir, the configs
    alternating within each round; the median round of each."""
    out: dict = {"sizes": {}}
    for size, tokens in SIZES.items():
        data = pool() if tokens == TOKENS else [realistic(BATCH, tokens=tokens, seed=s, prefix=f"s{s}") for s in range(4)]
        batches = [_batch(t) for t in data]
        encoded = [[codec.encode_block(b) for b in blocks(rb)] for rb in batches]
        arrow = float(np.mean([t.nbytes for t in data]))
        stored = float(np.mean([sum(map(len, e)) for e in encoded]))
        rounds, n = (1, 5) if quick else (3, 12)
        if tokens != TOKENS:
            n *= 8  # small inserts: more of them
        configs = _insert_configs(data, encoded, n)
        runs: dict[str, list[dict]] = {k: [] for k in configs}
        for _ in range(rounds):
            for name, (fn, _) in configs.items():
                d = Path(tempfile.mkdtemp(dir=tmp, prefix="ins-"))
                try:
                    runs[name].append(fn(d))
                finally:
                    shutil.rmtree(d, ignore_errors=True)
        res = {"arrow_bytes_per_batch": arrow, "stored_bytes_per_batch": stored, "rows_per_batch": BATCH,
               "batches_per_round": n, "rounds": rounds, "order": list(configs), "configs": {}}
        for name, rs in runs.items():
            r = sorted(rs, key=lambda x: x["wall_s"])[len(rs) // 2]
            res["configs"][name] = {"items_per_s": BATCH * n / r["wall_s"], "MB_per_s": arrow * n / r["wall_s"] / 1e6,
                                    "latency": r["latency"], "ceiling": configs[name][1],
                                    "fsyncs": r.get("fsyncs"), "rounds_wall_s": [x["wall_s"] for x in rs]}
        out["sizes"][size] = res
    return out


# -- 2. sample ----------------------------------------------------------------------------

def _timed(fn, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


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


# -- 3. codec -----------------------------------------------------------------------------

_ZSTD_IPC = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=1))


def _ipc_stream(batch: pa.RecordBatch) -> bytes:
    """The baseline: a self-describing IPC stream with Arrow's per-buffer zstd."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=_ZSTD_IPC) as writer:
        writer.write(batch)
    return sink.getvalue().to_pybytes()


def _read_ipc_stream(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def _on_disk(values: list[bytes]) -> int:
    """Bytes of the blob and SST files holding ``values`` once RocksDB flushed them."""
    d = Path(tempfile.mkdtemp(prefix="expstore-codec-"))
    try:
        db, family = _raw_db(d)
        wb = WriteBatch(raw_mode=True)
        for i, v in enumerate(values):
            wb.put(i.to_bytes(8, "big"), v, db.handle[family])
        db.write(wb)
        db.flush()
        db.close()
        return sum(p.stat().st_size for p in (d / "rocksdb").glob("*") if p.suffix in (".blob", ".sst"))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def bench_codec(quick: bool) -> dict:
    reps = 5 if quick else 20
    data = {"realistic (Zipf 152k)": _batch(realistic(BATCH, seed=7)),
            "synthetic (uniform 50k)": _batch(trajectories(BATCH, tokens=TOKENS, seed=7))}
    out = {}
    for label, rb in data.items():
        for unit, parts in (("batch", [rb]), (f"{BLOCK_BYTES >> 10} KiB blocks", blocks(rb))):
            arrow = rb.get_total_buffer_size()
            if unit == "batch":  # a self-describing IPC stream
                encode, decode = _ipc_stream, _read_ipc_stream
            else:  # the SSD tier's blocks: record batch messages, the schema kept once per chunk
                encode = codec.encode_block
                decode = lambda e: codec.decode_block(e, rb.schema, "bench", zlib.crc32(e))  # noqa: E731
            enc = [encode(p) for p in parts]
            t_enc = min(_timed(lambda: [encode(p) for p in parts], reps))
            t_dec = min(_timed(lambda: [decode(e) for e in enc], reps))
            stored = sum(map(len, enc)) if unit == "batch" else _on_disk(enc)
            out[f"{label}, {unit}"] = {"arrow_bytes": arrow, "encoded_bytes": stored, "values": len(parts),
                                       "ratio": arrow / stored, "encode_MB_per_s": arrow / t_enc / 1e6,
                                       "decode_MB_per_s": arrow / t_dec / 1e6}
        cols = {}
        for name in ("tokens", "logprobs", "loss_mask"):
            one = pa.record_batch([rb.column(name)], names=[name])
            cols[name] = one.get_total_buffer_size() / len(_ipc_stream(one))
        out[f"{label}, batch"]["column_ratios"] = cols
    return out


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
                                       stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
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


# -- 5. checkpoint ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto() -> tuple[subprocess.Popen, str] | None:
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        return None
    port = _free_port()
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    proc.wait()
    return None


def _checkpoint_pair(store: Catalog, tmp: Path, remote: SealedObjects, fs: fsspec.AbstractFileSystem, dest: str,
                     rounds: int, label: str) -> dict:
    exp, ceil, links = [], [], []
    num_bytes = 0
    for r in range(rounds):
        info = Checkpointer(store, remote).create(f"{label}-{r}")
        exp.append(info.seconds)
        num_bytes = info.num_bytes
        src = tmp / f"ckpt-src-{r}"
        t0 = time.perf_counter()
        store.db.checkpoint(src)
        links.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fs.put(str(src), f"{dest}/ceiling-{r}", recursive=True)
        ceil.append(time.perf_counter() - t0)
        shutil.rmtree(src, ignore_errors=True)
    gb = num_bytes / 1e9
    e, c = statistics.median(exp), statistics.median(ceil)
    return {"num_bytes": num_bytes, "expstore_s": e, "ceiling_s": c,
            "expstore_s_per_GB": e / gb, "ceiling_s_per_GB": c / gb, "rocksdb_checkpoint_s": statistics.median(links),
            "expstore_rounds_s": exp, "ceiling_rounds_s": ceil}


def bench_checkpoint(tmp: Path, data_dir: Path, quick: bool) -> dict:
    rounds = 2 if quick else 3
    out: dict = {"rounds": rounds}
    store = Catalog(data_dir)
    try:
        local_root = tmp / "ckpt-remote"
        out["file"] = _checkpoint_pair(store, tmp, SealedObjects(f"file://{local_root}"), fsspec.filesystem("file"),
                                       str(tmp / "ckpt-ceiling"), rounds, "file")
        shutil.rmtree(local_root, ignore_errors=True)
        shutil.rmtree(tmp / "ckpt-ceiling", ignore_errors=True)
        moto = _start_moto()
        if moto is None:
            out["s3"] = {"skipped": "moto_server did not start"}
        else:
            proc, endpoint = moto
            try:
                import boto3
                import s3fs
                kw = dict(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
                boto3.client("s3", endpoint_url=endpoint, **kw).create_bucket(Bucket="bench")
                fs = s3fs.S3FileSystem(key="testing", secret="testing",
                                       client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})
                out["s3"] = _checkpoint_pair(store, tmp, SealedObjects("s3://bench/expstore", fs=fs), fs,
                                             "bench/ceiling", 1, "s3")
                out["s3"]["endpoint"] = endpoint
            finally:
                proc.kill()
                proc.wait()
    finally:
        store.close()
    return out


# -- the run ------------------------------------------------------------------------------

def run(quick: bool) -> dict:
    keep_freed_memory()  # as the server does by default: large buffers reused, not faulted in afresh
    tmp = Path(tempfile.mkdtemp(prefix="expstore-tiers-"))
    out: dict = {"quick": quick}
    timings = {}
    try:
        for name, fn in (("codec", lambda: bench_codec(quick)), ("insert", lambda: bench_insert(tmp, quick)),
                         ("sample", lambda: bench_sample(tmp, quick)), ("restart", lambda: bench_restart(tmp, quick))):
            t0 = time.perf_counter()
            out[name] = fn()
            timings[name] = time.perf_counter() - t0
            print(f"tiers: {name} done in {timings[name]:.0f} s", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        out["checkpoint"] = bench_checkpoint(tmp, Path(out["restart"].pop("checkpoint_dir")), quick)
        timings["checkpoint"] = time.perf_counter() - t0
        out["timings_s"] = timings
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- the tables ---------------------------------------------------------------------------


def render(t: dict) -> str:
    mode = "quick" if t.get("quick") else "full"
    parts = [f"7. Durable tables, in process ({mode}; benchmarks/tiers.py)"]

    for size, ins in t["insert"]["sizes"].items():
        c = ins["configs"]
        rows = []
        for name in ins["order"]:
            r = c[name]
            ceiling = r["ceiling"]
            ratio = f"{r['items_per_s'] / c[ceiling]['items_per_s']:.2f}x of {ceiling}" if ceiling else "ceiling"
            rows.append([name, _f(r["items_per_s"]), _f(r["MB_per_s"]), _f(r["latency"]["p50_ms"], 1),
                         _f(r["latency"]["p99_ms"], 1), "" if r.get("fsyncs") is None else r["fsyncs"], ratio])
        ssd = "durable table (ssd, default)"
        group = c[f"{ssd}, fsync, 4 threads"]["items_per_s"] / c[f"{ssd}, wal, 4 threads"]["items_per_s"]
        parts += ["\n".join([
            f"7a. Insert, {ins['rows_per_batch']} rows x {ins['arrow_bytes_per_batch'] / BATCH:,.0f} B ({size} rows; "
            f"Arrow {ins['arrow_bytes_per_batch'] / 1e6:.2f} MB/batch, written {ins['stored_bytes_per_batch'] / 1e6:.2f} MB); "
            f"{ins['batches_per_round']} batches/round, median of {ins['rounds']} rounds, fresh data dir each",
            _table(["table kind, durability", "items/s", "Arrow MB/s", "p50 ms", "p99 ms", "fsyncs", "ratio"], rows,
                   align_left=1),
            f"   fsync with 4 threads (group commit) = {group:.2f}x wal with 4 threads; raw RocksDB: the same "
            "stored values and keys, one WriteBatch per insert, the engine's options (blob files, LZ4 at flush)"])]

    s = t["sample"]
    rows = []
    mem_p50 = s["tables"]["memory"]["steady"]["p50_ms"]
    labels = {"memory": "memory (cache > data)", "ssd": "SSD (1 MiB cache)",
              "remote": "remote (cache > data)", "remote_cold": "remote (1 MiB cache)"}
    for name in labels:
        r = s["tables"][name]
        for phase in ("first", "steady", "cold", "stream"):
            if phase not in r:
                continue
            b = r["after_first"] if name == "remote" and phase == "steady" else r["before"]
            where = f"{b['items_memory']:,} / {b['items_ssd']:,} / {b['items_remote']:,}"
            p = r[phase]
            rows.append([labels[name], phase, p["calls"], _f(p["p50_ms"], 1), _f(p["p99_ms"], 1), _f(p["max_ms"], 1),
                         f"{p['p50_ms'] / mem_p50:.1f}x", where])
    extra = [f"reopen of the store (4 tables) before the remote rows: {s['reopen_s']:.2f} s"]
    for name in ("remote", "remote_cold"):
        r = s["tables"][name]
        a = r["after"]
        extra.append(f"{name}: demote() x {r['demoted_chunks']} chunks in {r['demote_s']:.1f} s "
                     f"({s['arrow_bytes'] / 1e6 / r['demote_s']:.0f} Arrow MB/s); after sampling: "
                     f"{a['promotions']:,} promotions, {a['evictions']:,} evictions")
    parts += ["\n".join([f"7b. Sample(256), uniform, in process: {s['items']:,} items, {s['arrow_bytes'] / 1e6:,.0f} MB Arrow "
              f"per table (ratio = p50 / memory p50); remote tables sampled after a store reopen (memory empty)",
              _table(["data in", "phase", "calls", "p50 ms", "p99 ms", "max ms", "vs memory",
                      "items mem / ssd / remote before"], rows, align_left=2),
              *("   " + e for e in extra),
              "   SSD reads hit the OS page cache (written moments before; caches not dropped)"])]

    rows = []
    for name in sorted(t["codec"], key=lambda k: (not k.startswith("realistic"), k)):
        r = t["codec"][name]
        rows.append([name, r["values"], _f(r["arrow_bytes"] / 1e6, 2), _f(r["encoded_bytes"] / 1e6, 2),
                     f"{r['ratio']:.2f}x", _f(r["encode_MB_per_s"]), _f(r["decode_MB_per_s"])])
    cols = "; ".join(f"{k}: " + ", ".join(f"{c} {v:.2f}x" for c, v in r["column_ratios"].items())
                     for k, r in t["codec"].items() if "column_ratios" in r)
    parts += ["\n".join(["7c. SSD blocks (IPC; ratio: the files after RocksDB LZ4) vs one IPC stream (zstd-1), 256 rows x 4096 tokens; MB/s of Arrow bytes, best of reps",
              _table(["data, unit", "values", "Arrow MB", "encoded MB", "ratio", "encode MB/s", "decode MB/s"], rows),
              "   per column: " + cols])]

    r = t["restart"]
    rows = []
    for case in ("with snapshots", "no snapshot"):
        x = r["cases"][case]
        for kind in ("crash_restart", "clean_restart"):
            y = x[kind]
            rows.append([case, kind.replace("_", " "), f"{y['items']:,}", f"{y['records']:,}", _f(y["seconds"], 2),
                         _f(y["first_sample_ms"], 1), f"{x['inserts']:,}", _f(x["build_s"], 0),
                         _f(x["disk_bytes"] / 1e6)])
    note = " (--quick: 100k, not 1M)" if t.get("quick") else ""
    parts += ["\n".join([f"7d. Restart: Catalog(data_dir) with {r['items']:,} items{note} x {r['tokens_per_item']} tokens, "
              f"inserted {r['rows_per_insert']} rows at a time, one sample(256) after each insert",
              _table(["journal", "restart", "items", "records replayed", "seconds", "1st sample ms", "inserts",
                      "build s", "disk MB"], rows, align_left=2),
              "   crash: the builder exited without closing; clean: reopened after a close (median of 2-3; each "
              "reopen then samples once, so records grow by 1); build s: both dirs built at once; "
              "'no snapshot': Journal.wants_snapshot patched off for the dir's whole life"])]

    ck = t["checkpoint"]
    rows = []
    for dest in ("file", "s3"):
        x = ck.get(dest)
        if not x:
            continue
        if "skipped" in x:
            rows.append([dest, "", "", "", "", "", x["skipped"]])
            continue
        label = "file:// (local disk)" if dest == "file" else "S3 (moto on 127.0.0.1, in memory)"
        rows.append([label, _f(x["num_bytes"] / 1e6), _f(x["expstore_s"], 2), _f(x["expstore_s_per_GB"], 2),
                     _f(x["ceiling_s"], 2), _f(x["ceiling_s_per_GB"], 2),
                     f"{x['ceiling_s'] / x['expstore_s']:.0%}"])
    parts += ["\n".join(["7e. Checkpoint of the restart data dir (median of rounds); ceiling: fsspec put(recursive) of a "
              "RocksDB checkpoint of the same DB",
              _table(["remote", "MB", "Checkpointer s", "s/GB", "fsspec put s", "s/GB", "speed vs ceiling"], rows)])]
    return "\n\n".join(parts)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--build-restart":
        build_restart_dir(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
    result = run("--quick" in sys.argv)
    print(render(result), file=sys.stderr, flush=True)
    print(json.dumps(result))
